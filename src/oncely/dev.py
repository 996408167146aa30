"""`oncely dev`: embedded servers, migrations, a dev key and every process in one."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import secrets
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from pydantic import SecretStr
from rich.console import Console

from oncely.api.auth import create_api_key, tenant_for_key
from oncely.bootstrap import (
    ApiServer,
    Resources,
    WorkerGroup,
    app_from,
    build_relay,
    connect_llm,
    open_resources,
    stop_on_signals,
)
from oncely.embedded import EmbeddedServers
from oncely.fakes.llm import serve_fake_llm
from oncely.fakes.mail import serve_fake_mail
from oncely.settings import Settings
from oncely.sql.migrate import migrate

DEV_TENANT = "dev"
console = Console(stderr=True)


async def run_dev(settings: Settings, *, port: int) -> None:
    servers = EmbeddedServers(settings.data_dir, durable=True)
    if not settings.redis_url or not settings.database_url:
        urls = await asyncio.to_thread(servers.start)
        settings = settings.model_copy(
            update={
                "redis_url": settings.redis_url or urls.redis_url,
                "database_url": settings.database_url or urls.database_url,
            }
        )
    try:
        await _run_services(await _with_fakes(settings, port), port)
    finally:
        await asyncio.to_thread(servers.stop)


async def _with_fakes(settings: Settings, port: int) -> Settings:
    """Point the model, the mail provider and webhooks at local fakes unless
    configured; sign webhooks with a dev secret kept in the data dir."""
    update: dict[str, Any] = {}
    fake_provider = f"http://127.0.0.1:{port + 102}"
    if "llm_base_url" not in settings.model_fields_set:
        update["llm_base_url"] = f"http://127.0.0.1:{port + 101}/v1"
    if "sender_url" not in settings.model_fields_set:
        update["sender"] = "http"
        update["sender_url"] = f"{fake_provider}/v1/messages"
    if settings.webhook_url is None:
        update["webhook_url"] = f"{fake_provider}/v1/events"
    if not settings.webhook_secret.get_secret_value():
        secret = await asyncio.to_thread(_dev_secret, settings.data_dir / "dev-webhook-secret")
        update["webhook_secret"] = SecretStr(secret)
    return settings.model_copy(update=update)


def _dev_secret(path: Path) -> str:
    """A ``whsec_`` secret made once per data dir, so receivers can keep it."""
    existing = _read_key(path)
    if existing:
        return existing
    secret = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
    _write_key(path, secret)
    return secret


async def _run_services(settings: Settings, port: int) -> None:
    assert settings.database_url is not None
    await migrate(settings.database_url)
    app = app_from(settings)
    async with open_resources(settings) as res, connect_llm(settings) as llm:
        key = await _dev_key(res, settings.data_dir / "dev-api-key")
        api = ApiServer(app, res, host="127.0.0.1", port=port)
        workers = WorkerGroup(app, res, llm)
        relay, router = build_relay(app, res)
        background = _fakes(settings, port)
        _banner(settings, port, key, app.names)
        stops: list[Callable[[], object]] = [api.stop, workers.stop, relay.stop]
        stops += [task.cancel for task in background]
        try:
            with stop_on_signals(*stops):
                await asyncio.gather(api.run(), workers.run(), relay.run())
        finally:
            await router.aclose()
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)


def _fakes(settings: Settings, port: int) -> list[asyncio.Task[None]]:
    starters: list[Callable[[], Coroutine[Any, Any, None]]] = []
    if settings.llm_base_url.startswith(f"http://127.0.0.1:{port + 101}/"):
        starters.append(lambda: serve_fake_llm("127.0.0.1", port + 101))
    if settings.sender_url.startswith(f"http://127.0.0.1:{port + 102}/"):
        mailbox = settings.data_dir / "mailbox.jsonl"
        starters.append(lambda: serve_fake_mail("127.0.0.1", port + 102, mailbox))
    return [asyncio.create_task(_quietly(start())) for start in starters]


async def _quietly(coro: Coroutine[Any, Any, None]) -> None:
    with contextlib.suppress(asyncio.CancelledError):
        await coro


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


def _banner(settings: Settings, port: int, key: str, workflows: list[str]) -> None:
    base = f"http://127.0.0.1:{port}"
    key_file = settings.data_dir / "dev-api-key"
    shadows = f"  Shadows      {settings.shadow}\n" if settings.shadow else ""
    console.print(f"""
[bold green]oncely dev[/bold green] is up (Ctrl-C stops everything)
  API          {base}   (docs: {base}/docs)
  Workflows    {", ".join(workflows)}   (app {settings.app})
  Model        {settings.llm_base_url}
  Mail         {settings.sender_url}   (mailbox: {settings.data_dir / "mailbox.jsonl"})
  Webhooks     {settings.webhook_url}   (secret in {settings.data_dir / "dev-webhook-secret"})
{shadows}  Redis        {settings.redis_url}
  PostgreSQL   {settings.database_url}
  API key      {key}   (also in {key_file})

Try it:
  curl -i -X POST {base}/v1/summaries \\
    -H "Authorization: Bearer $(cat {key_file})" \\
    -H "Idempotency-Key: $(python3 -c 'import uuid; print(uuid.uuid4())')" \\
    -H "Content-Type: application/json" \\
    -d '{{"text": "Retries are safe. Effects happen once.", "notify": "you@example.com"}}'
  curl -H "Authorization: Bearer $(cat {key_file})" {base}/v1/summaries/<job_id>
""")
