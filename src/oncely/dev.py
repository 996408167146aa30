"""`oncely dev`: embedded servers, migrations, a dev key and every process in one."""

from __future__ import annotations

import asyncio
from pathlib import Path

from rich.console import Console

from oncely.api.auth import create_api_key, tenant_for_key
from oncely.bootstrap import Resources, _serve, open_resources
from oncely.embedded import EmbeddedServers
from oncely.settings import Settings
from oncely.sql.migrate import migrate

DEV_TENANT = "dev"
console = Console(stderr=True)


async def run_dev(settings: Settings, *, port: int) -> None:
    servers = EmbeddedServers(settings.data_dir)
    if not settings.redis_url or not settings.database_url:
        urls = await asyncio.to_thread(servers.start)
        settings = settings.model_copy(
            update={
                "redis_url": settings.redis_url or urls.redis_url,
                "database_url": settings.database_url or urls.database_url,
            }
        )
    try:
        assert settings.database_url is not None
        await migrate(settings.database_url)
        async with open_resources(settings) as res:
            key = await _dev_key(res, settings.data_dir / "dev-api-key")
            _banner(settings, port, key)
            await _serve(res, host="127.0.0.1", port=port)
    finally:
        await asyncio.to_thread(servers.stop)


async def _dev_key(res: Resources, path: Path) -> str:
    """Reuse the key from an earlier run while it is still valid."""
    key = await asyncio.to_thread(_read_key, path)
    if key and await tenant_for_key(res.pool, key) is not None:
        return key
    key = await create_api_key(res.pool, DEV_TENANT)
    await asyncio.to_thread(_write_key, path, key)
    return key


def _read_key(path: Path) -> str | None:
    return path.read_text().strip() if path.exists() else None


def _write_key(path: Path, key: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(key + "\n")
    path.chmod(0o600)


def _banner(settings: Settings, port: int, key: str) -> None:
    base = f"http://127.0.0.1:{port}"
    console.print(f"""
[bold green]oncely dev[/bold green] is up (Ctrl-C stops everything)
  API          {base}   (docs: {base}/docs)
  Redis        {settings.redis_url}
  PostgreSQL   {settings.database_url}
  API key      {key}   (also in {settings.data_dir / "dev-api-key"})

Try it:
  curl -i -X POST {base}/v1/summaries \\
    -H "Authorization: Bearer {key}" \\
    -H "Idempotency-Key: $(uuidgen || echo my-first-request-0001)" \\
    -H "Content-Type: application/json" \\
    -d '{{"text": "oncely makes LLM steps safe to retry.", "notify": "you@example.com"}}'
""")
