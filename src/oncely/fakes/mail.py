"""The fake mail provider (DESIGN §6): a real HTTP server that dedupes on
``Idempotency-Key`` like a real email API, so tests can tell duplicates sent
(``requests``) from duplicates delivered (``effects``).

Lean on purpose: it must never be the bottleneck of a benchmark, so no access
log, no locks (one event loop), and the mailbox is appended synchronously.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, TypedDict

import structlog
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

MESSAGES_PATH = "/v1/messages"

# Long enough for a delayed request to finish, short enough not to stall a
# test's teardown.
_SHUTDOWN_S = 1.0

log = structlog.get_logger(__name__)


class Deliveries(TypedDict):
    requests: int
    effects: int
    by_key: dict[str, int]


class Faults(BaseModel):
    """What ``POST /_faults`` scripts for the requests that follow it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fail_next: int = Field(default=0, ge=0)
    status: int = Field(default=503, ge=100, le=599)
    retry_after: int | float | str | None = None
    delay_s: float = Field(default=0.0, ge=0)


class _Message(BaseModel):
    to: str = Field(min_length=1)
    subject: str
    text: str


@dataclass
class MailState:
    """Everything the provider remembers; effects survive a restart via the mailbox."""

    mailbox: Path | None
    requests: int = 0
    by_key: dict[str, int] = field(default_factory=dict)
    message_ids: dict[str, str] = field(default_factory=dict)
    faults: Faults = field(default_factory=Faults)
    failures_left: int = 0

    def __post_init__(self) -> None:
        if self.mailbox is not None:
            self.mailbox.parent.mkdir(parents=True, exist_ok=True)
            self.message_ids = _recover_mailbox(self.mailbox)

    def deliveries(self) -> Deliveries:
        return {
            "requests": self.requests,
            "effects": len(self.message_ids),
            "by_key": dict(self.by_key),
        }

    def script(self, faults: Faults) -> None:
        self.faults, self.failures_left = faults, faults.fail_next

    def take_failure(self) -> bool:
        if self.failures_left == 0:
            return False
        self.failures_left -= 1
        return True

    def deliver(self, key: str, message: _Message) -> tuple[str, bool]:
        """The message id for ``key`` and whether this call created the effect."""
        # No await in here: concurrent requests with one key cannot both deliver.
        if key in self.message_ids:
            return self.message_ids[key], False
        message_id = f"msg_{uuid.uuid4().hex}"
        if self.mailbox is not None:
            _append(self.mailbox, _mailbox_line(key, message_id, message))
        self.message_ids[key] = message_id
        return message_id, True

    def reset(self) -> None:
        self.requests, self.by_key, self.message_ids = 0, {}, {}
        self.script(Faults())
        if self.mailbox is not None:
            self.mailbox.write_text("")


def _mailbox_line(key: str, message_id: str, message: _Message) -> dict[str, Any]:
    return {
        "idempotency_key": key,
        "id": message_id,
        **message.model_dump(),
        "received_at": datetime.now(UTC).isoformat(),
    }


def _append(mailbox: Path, line: dict[str, Any]) -> None:
    _append_raw(mailbox, json.dumps(line, ensure_ascii=False) + "\n")


def _append_raw(mailbox: Path, text: str) -> None:
    with mailbox.open("a", encoding="utf-8") as f:
        f.write(text)


def _recover_mailbox(mailbox: Path) -> dict[str, str]:
    """Keys already delivered (a real provider remembers them across restarts)."""
    if not mailbox.exists():
        return {}
    text = mailbox.read_text(encoding="utf-8")
    if text and not text.endswith("\n"):
        _append_raw(mailbox, "\n")  # end a line torn by a kill, or the next one fuses with it
    known: dict[str, str] = {}
    for raw in text.splitlines():
        try:
            line = json.loads(raw)
            known.setdefault(line["idempotency_key"], line.get("id") or f"msg_{uuid.uuid4().hex}")
        except (ValueError, KeyError, TypeError):
            continue  # a torn line is no effect
    return known


_STATE = web.AppKey("state", MailState)


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


async def _post_message(request: web.Request) -> web.Response:
    state = request.app[_STATE]
    state.requests += 1
    key = request.headers.get("Idempotency-Key", "")
    if key:
        state.by_key[key] = state.by_key.get(key, 0) + 1
    failing, faults = state.take_failure(), state.faults
    # Read before the delay so a request the client gives up on still takes
    # effect, as at a real provider: the window a resend's same key covers.
    body = await request.read()
    if faults.delay_s:
        await asyncio.sleep(faults.delay_s)
    if failing:
        return _injected_failure(faults)
    if not key:
        return _error(400, "Idempotency-Key header is required")
    try:
        message = _Message.model_validate_json(body)
    except ValidationError as exc:
        return _error(422, f"invalid message: {exc.errors(include_url=False)}")
    message_id, created = state.deliver(key, message)
    return web.json_response({"id": message_id}, status=201 if created else 200)


def _injected_failure(faults: Faults) -> web.Response:
    headers = {} if faults.retry_after is None else {"Retry-After": str(faults.retry_after)}
    return _error(faults.status, "injected fault", headers)


async def _get_deliveries(request: web.Request) -> web.Response:
    return web.json_response(request.app[_STATE].deliveries())


async def _post_faults(request: web.Request) -> web.Response:
    try:
        faults = Faults.model_validate_json(await request.read())
    except ValidationError as exc:
        return _error(400, f"invalid faults: {exc.errors(include_url=False)}")
    request.app[_STATE].script(faults)
    return web.json_response(faults.model_dump())


async def _post_reset(request: web.Request) -> web.Response:
    request.app[_STATE].reset()
    return web.json_response(request.app[_STATE].deliveries())


def make_app(mailbox: Path | None = None) -> web.Application:
    app = web.Application()
    app[_STATE] = MailState(mailbox)
    app.router.add_post(MESSAGES_PATH, _post_message)
    app.router.add_get("/_deliveries", _get_deliveries)
    app.router.add_post("/_faults", _post_faults)
    app.router.add_post("/_reset", _post_reset)
    return app


async def _start(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, str]:
    """A started runner and its base URL (the real port when ``port`` is 0)."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=_SHUTDOWN_S)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    bound_host, bound_port = runner.addresses[0][:2]
    return runner, f"http://{bound_host}:{bound_port}"


async def serve_fake_mail(host: str, port: int, mailbox: Path | None) -> None:
    """Serve until cancelled."""
    runner, base_url = await _start(make_app(mailbox), host, port)
    try:
        log.info("fake_mail.listening", url=base_url + MESSAGES_PATH, mailbox=str(mailbox))
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


class FakeMailServer:
    """The fake provider on 127.0.0.1 and a free port, for the span of an ``async with``."""

    def __init__(self, mailbox: Path | None = None) -> None:
        self.mailbox = mailbox
        self._app = make_app(mailbox)
        self._runner: web.AppRunner | None = None
        self.base_url = ""

    @property
    def url(self) -> str:
        return self.base_url + MESSAGES_PATH

    @property
    def state(self) -> MailState:
        return self._app[_STATE]

    async def deliveries(self) -> Deliveries:
        return self.state.deliveries()

    async def __aenter__(self) -> FakeMailServer:
        self._runner, self.base_url = await _start(self._app, "127.0.0.1", 0)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
