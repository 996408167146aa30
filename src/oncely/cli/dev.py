"""`oncely dev`: embedded servers, migrations, a dev key and every process in one."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import secrets
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from pydantic import BaseModel, SecretStr
from rich.console import Console

from oncely.api.auth import create_api_key, tenant_for_key
from oncely.app import App
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
from oncely.cli import dev_address
from oncely.cli.invocation import port_taken
from oncely.embedded import DataDirBusy, EmbeddedServers
from oncely.fakes.llm import serve_fake_llm
from oncely.fakes.mail import serve_fake_mail
from oncely.settings import CONSOLE_KEY_MIN, Settings
from oncely.sql.migrate import migrate

DEV_TENANT = "dev"
# The fakes' ports, relative to the API's (docs/cli.md, "oncely dev").
FAKE_LLM_OFFSET = 101
FAKE_MAIL_OFFSET = 102
# Colour and markup only on a terminal (rich's own check), never in a file.
console = Console(stderr=True)


class DevRefused(Exception):
    """``oncely dev`` cannot start here; the message says why and what to do."""


async def run_dev(
    settings: Settings, *, port: int, workers: bool = True, relay: bool = True
) -> None:
    """Embedded servers (unless URLs are set), the fakes, migrations, a dev
    key and every process, until a signal. Refused, before anything starts,
    when another stack runs from the same data dir or a port is taken."""
    other = dev_address.running(settings.data_dir)
    if other is not None:
        raise DevRefused(
            f"oncely dev is already running from {settings.data_dir} (pid {other.pid},"
            f" {other.api_url}); its URLs are what every oncely command here uses"
        )
    settings = await _with_fakes(settings, port)
    _check_ports(_ports(settings, port))
    servers = EmbeddedServers(settings.data_dir, durable=True)
    if not settings.redis_url or not settings.database_url:
        try:
            urls = await asyncio.to_thread(servers.start)
        except DataDirBusy as exc:
            raise DevRefused(f"{exc}: stop it first, or use another --data-dir") from None
        settings = settings.model_copy(
            update={
                "redis_url": settings.redis_url or urls.redis_url,
                "database_url": settings.database_url or urls.database_url,
            }
        )
    try:
        await _run_services(settings, port, workers=workers, relay=relay)
    finally:
        dev_address.withdraw(settings.data_dir)
        await asyncio.to_thread(servers.stop)


def _ports(settings: Settings, port: int) -> dict[int, str]:
    """The ports this stack binds, each with what binds it."""
    ports = {port: "the API (--port)"}
    if _serves_fake_llm(settings, port):
        ports[port + FAKE_LLM_OFFSET] = f"the fake model (--port + {FAKE_LLM_OFFSET})"
    if _serves_fake_mail(settings, port):
        ports[port + FAKE_MAIL_OFFSET] = f"the fake mail provider (--port + {FAKE_MAIL_OFFSET})"
    return ports


def _check_ports(ports: dict[int, str]) -> None:
    """Each port free on 127.0.0.1, bound the way the servers bind it
    (SO_REUSEADDR: a port in TIME_WAIT is free)."""
    for number, what in ports.items():
        if port_taken("127.0.0.1", number):
            raise DevRefused(
                f"port {number} is taken, and {what} needs it;"
                " start with another --port (the fakes take it + 101 and + 102)"
            )


async def _with_fakes(settings: Settings, port: int) -> Settings:
    """Point the model, the mail provider and webhooks at local fakes unless
    configured; sign webhooks with a dev secret kept in the data dir."""
    update: dict[str, Any] = {}
    fake_provider = f"http://127.0.0.1:{port + FAKE_MAIL_OFFSET}"
    if "llm_base_url" not in settings.model_fields_set:
        update["llm_base_url"] = f"http://127.0.0.1:{port + FAKE_LLM_OFFSET}/v1"
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


async def _run_services(settings: Settings, port: int, *, workers: bool, relay: bool) -> None:
    """The API, and the workers and the relay unless left to processes of
    their own (``oncely worker``, ``oncely relay`` from the same directory
    find this stack's servers)."""
    assert settings.database_url is not None
    await migrate(settings.database_url)
    app = app_from(settings)
    async with open_resources(settings, "dev") as res, connect_llm(settings) as llm:
        key = await _dev_key(res, settings.data_dir / "dev-api-key")
        api = ApiServer(app, res, host="127.0.0.1", port=port)
        services: list[Any] = [api]
        if workers:
            services.append(WorkerGroup(app, res, llm))
        relayed, router = build_relay(app, res)
        if relay:
            services.append(relayed)
        background = _fakes(settings, port)
        stops: list[Callable[[], object]] = [service.stop for service in services]
        stops += [task.cancel for task in background]
        try:
            with stop_on_signals(*stops):
                running = asyncio.gather(*(service.run() for service in services))
                if await api.serving(running):
                    _publish(settings, port)
                    _banner(settings, port, key, app)
                await running
        finally:
            await router.aclose()
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)


def _publish(settings: Settings, port: int) -> None:
    """The stack's URLs for every oncely command run from here (dev_address)."""
    assert settings.redis_url is not None and settings.database_url is not None
    address = dev_address.DevAddress(
        pid=os.getpid(),
        api_url=f"http://127.0.0.1:{port}",
        redis_url=settings.redis_url,
        database_url=settings.database_url,
        app=settings.app,
        providers={
            "llm_base_url": settings.llm_base_url,
            "sender": settings.sender,
            "sender_url": settings.sender_url,
            "webhook_url": settings.webhook_url or "",
        },
    )
    dev_address.publish(settings.data_dir, address)


def _serves_fake_llm(settings: Settings, port: int) -> bool:
    return settings.llm_base_url.startswith(f"http://127.0.0.1:{port + FAKE_LLM_OFFSET}/")


def _serves_fake_mail(settings: Settings, port: int) -> bool:
    return settings.sender_url.startswith(f"http://127.0.0.1:{port + FAKE_MAIL_OFFSET}/")


def _fakes(settings: Settings, port: int) -> list[asyncio.Task[None]]:
    starters: list[Callable[[], Coroutine[Any, Any, None]]] = []
    if _serves_fake_llm(settings, port):
        starters.append(lambda: serve_fake_llm("127.0.0.1", port + FAKE_LLM_OFFSET))
    if _serves_fake_mail(settings, port):
        mailbox = settings.data_dir / "mailbox.jsonl"
        starters.append(lambda: serve_fake_mail("127.0.0.1", port + FAKE_MAIL_OFFSET, mailbox))
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


def _who_finds_it(settings: Settings) -> str:
    """Which ``oncely`` commands find this stack (docs/cli.md, oncely dev)."""
    if settings.data_dir == Settings.model_fields["data_dir"].default:
        return "oncely commands run from this directory"
    return f"oncely commands run with ONCELY_DATA_DIR={settings.data_dir}"


def _banner(settings: Settings, port: int, key: str, app: App) -> None:
    base = f"http://127.0.0.1:{port}"
    key_file = settings.data_dir / "dev-api-key"
    shadows = f"  Shadows      {settings.shadow}\n" if settings.shadow else ""
    first = next(iter(app))
    body = json.dumps(example_request(first.request))
    address = settings.data_dir / dev_address.FILE
    if settings.console_key is not None:
        web = f"{base}/console   (sign in with ONCELY_CONSOLE_KEY)"
    else:
        web = f"off   (set ONCELY_CONSOLE_KEY, {CONSOLE_KEY_MIN} characters or more, to turn it on)"
    console.print(
        f"""
[bold green]oncely dev[/bold green] is up (Ctrl-C stops everything)
  API          {base}   (docs: {base}/docs)
  Console      {web}
  Workflows    {", ".join(app.names)}   (app {settings.app})
  Model        {settings.llm_base_url}
  Mail         {settings.sender_url}   (mailbox: {settings.data_dir / "mailbox.jsonl"})
  Webhooks     {settings.webhook_url}   (secret in {settings.data_dir / "dev-webhook-secret"})
{shadows}  Redis        {settings.redis_url}
  PostgreSQL   {settings.database_url}
  API key      {key}   (also in {key_file})
  CLI          {_who_finds_it(settings)} use this stack (its URLs: {address})

Try it ({first.name}):""",
        soft_wrap=True,
    )
    # Printed as it is (no markup, never wrapped): it is copied and pasted.
    curl = f"""\
  curl -i -X POST {base}{first.route} \\
    -H "Authorization: Bearer $(cat {key_file})" \\
    -H "Idempotency-Key: $(python3 -c 'import uuid; print(uuid.uuid4())')" \\
    -H "Content-Type: application/json" \\
    -d '{_shell_quoted(body)}'
  curl -H "Authorization: Bearer $(cat {key_file})" {base}{first.route}/<job_id>
"""
    console.print(curl, markup=False, highlight=False, soft_wrap=True)


def _shell_quoted(text: str) -> str:
    """``text`` for inside single quotes."""
    return text.replace("'", "'\\''")


def example_request(model: type[BaseModel]) -> dict[str, Any]:
    """A request body for ``model`` from its JSON schema: each required
    field's first example, else its default, else a value of its type."""
    schema = model.model_json_schema()
    return _example_object(schema, schema.get("$defs", {}))


def _example_object(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    required = set(schema.get("required", ()))
    return {
        name: _example_value(field, defs)
        for name, field in schema.get("properties", {}).items()
        if name in required
    }


_BY_FORMAT = {
    "email": "you@example.com",
    "uri": "https://example.com/",
    "date-time": "2026-01-01T00:00:00Z",
}
_BY_TYPE: dict[str, Any] = {
    "string": "text",
    "integer": 1,
    "number": 1.0,
    "boolean": True,
    "array": [],
}


def _example_value(field: dict[str, Any], defs: dict[str, Any]) -> Any:
    if field.get("examples"):
        return field["examples"][0]
    if "default" in field:
        return field["default"]
    if "$ref" in field:
        return _example_value(defs[field["$ref"].rsplit("/", 1)[-1]], defs)
    for choice in field.get("anyOf", field.get("allOf", ())):
        if choice.get("type") != "null":
            return _example_value(choice, defs)
    if field.get("enum"):
        return field["enum"][0]
    if field.get("type") == "object":
        return _example_object(field, defs)
    if field.get("format") in _BY_FORMAT:
        return _BY_FORMAT[field["format"]]
    return _BY_TYPE.get(field.get("type", ""))
