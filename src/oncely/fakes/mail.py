"""The fake mail and webhook provider (docs/fakes.md): a real HTTP server
that dedupes on ``Idempotency-Key`` like a real email API, so tests can tell duplicates sent
(``requests``) from duplicates delivered (``effects``).

Routes:

- ``POST /v1/messages``: an email (JSON ``to``/``subject``/``text``); the
  ``Idempotency-Key`` header is required. 201 ``{"id"}`` for a new key, 200 and
  the same id for a known one.
- ``POST /v1/events``: a Standard Webhooks receiver that verifies nothing. The
  ``webhook-id`` header is required and dedupes like ``Idempotency-Key``; the
  body must be a JSON object. Events and emails are separate key spaces (two
  providers in one), both counted in ``effects``. It answers calls (docs/agents.md):
  ``{"ok": true, "id", "data"}``, ``data`` being the event's data as first
  received under that ``webhook-id``, so a repeat gets the same answer.
  Directives in the data's strings script its failures, counted per
  ``webhook-id``: ``[[fake:400]]`` refuses every request (400, no effect),
  ``[[fake:503*N]]`` answers the first N requests 503 (without ``*N``: all).
- ``GET /_deliveries``: ``{"requests", "effects", "by_key"}``; ``requests`` and
  ``by_key`` count every POST to either route.
- ``GET /_events``: the events received, as their mailbox lines (with headers
  and raw body, for checking signatures).
- ``POST /_faults`` scripts failures and delays for the POSTs that follow (to
  either route); ``POST /_reset`` forgets everything.

Random faults, for soaks (``oncely fake-mail --faults 503=0.05,drop=0.02 --seed
S``): each POST to either route meets at most one, at its kind's rate, after a
scripted fault had its turn:

- ``503``: answered 503, nothing delivered.
- ``timeout``: the request is held ``hold_s`` (longer than the client waits)
  and then handled as usual, so the effect happens after the sender gave up.
- ``drop``: the effect happens (it is in the mailbox and counted) and the
  connection is closed with no answer: the sender cannot know it was delivered.

Which POST meets which is fixed by the seed, the key and how many POSTs with
that key came before (``oncely.fakes.faults``). ``/_deliveries`` then also
answers ``faults``: how many of each kind were met.

Each new effect is one JSON line in the mailbox: ``kind`` (``email`` or
``event``), ``idempotency_key``, ``id``, the email's fields or the event's
``type``/``data``/``timestamp`` (from its body), ``headers`` and raw ``body``,
then ``received_at``. A restart on the same mailbox remembers its keys.

Lean on purpose: it must never be the bottleneck of a benchmark, so no access
log, no locks (one event loop), and the mailbox is appended synchronously.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, NotRequired, TypedDict

import structlog
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from oncely.fakes.faults import RandomFaults

MESSAGES_PATH = "/v1/messages"
EVENTS_PATH = "/v1/events"

EffectKind = Literal["email", "event"]
_ID_PREFIX: dict[EffectKind, str] = {"email": "msg", "event": "evt"}
_IDEMPOTENCY_KEY = "Idempotency-Key"
_WEBHOOK_ID = "webhook-id"
_WEBHOOK_HEADERS = (_WEBHOOK_ID, "webhook-timestamp", "webhook-signature")
# A receiver's scripted failure in an event's data: [[fake:400]], [[fake:503*2]].
_REFUSAL = re.compile(r"\[\[fake:(400|503)(?:\*(\d+))?\]\]")

# Long enough for a delayed request to finish, short enough not to stall a
# test's teardown.
_SHUTDOWN_S = 1.0
# What ``--faults`` may name, in the order rates are drawn.
RANDOM_FAULTS = ("503", "timeout", "drop")
# How long a random ``timeout`` holds its request.
DEFAULT_HOLD_S = 30.0

log = structlog.get_logger(__name__)


class Deliveries(TypedDict):
    requests: int
    effects: int
    by_key: dict[str, int]
    faults: NotRequired[dict[str, int]]  # random faults met, when they are on


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
    effect_ids: dict[tuple[EffectKind, str], str] = field(default_factory=dict)
    faults: Faults = field(default_factory=Faults)
    failures_left: int = 0
    random: RandomFaults = field(default_factory=lambda: RandomFaults(RANDOM_FAULTS))
    hold_s: float = DEFAULT_HOLD_S
    random_met: dict[str, int] = field(default_factory=dict)
    # Each event's data as first received, by webhook-id: the call's answer.
    answers: dict[str, Any] = field(default_factory=dict)
    # Events' lines when there is no mailbox to read them back from.
    _events: list[dict[str, Any]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.mailbox is not None:
            self.mailbox.parent.mkdir(parents=True, exist_ok=True)
            self.effect_ids, self.answers = _recover_mailbox(self.mailbox)

    def deliveries(self) -> Deliveries:
        answer: Deliveries = {
            "requests": self.requests,
            "effects": len(self.effect_ids),
            "by_key": dict(self.by_key),
        }
        if self.random:
            answer["faults"] = dict(self.random_met)
        return answer

    def events(self) -> list[dict[str, Any]]:
        if self.mailbox is None:
            return list(self._events)
        if not self.mailbox.exists():
            return []
        lines = _parse_lines(self.mailbox.read_text(encoding="utf-8"))
        return [line for line in lines if line.get("kind") == "event"]

    def count_request(self, key: str) -> None:
        self.requests += 1
        if key:
            self.by_key[key] = self.by_key.get(key, 0) + 1

    def script(self, faults: Faults) -> None:
        self.faults, self.failures_left = faults, faults.fail_next

    def take_failure(self) -> bool:
        if self.failures_left == 0:
            return False
        self.failures_left -= 1
        return True

    def random_fault(self, key: str) -> str | None:
        """The random fault of this POST with ``key`` (already counted), if any."""
        kind = self.random.draw(key, self.by_key[key]) if key else None
        if kind is not None:
            self.random_met[kind] = self.random_met.get(kind, 0) + 1
        return kind

    def deliver(self, kind: EffectKind, key: str, fields: dict[str, Any]) -> tuple[str, bool]:
        """The effect id for ``key`` and whether this call created the effect;
        ``fields`` are the kind's own fields of its mailbox line."""
        # No await in here: concurrent requests with one key cannot both deliver.
        known = self.effect_ids.get((kind, key))
        if known is not None:
            return known, False
        effect_id = _new_id(kind)
        if kind == "event":
            self.answers[key] = fields.get("data")
        line = _mailbox_line(kind, key, effect_id, fields)
        if self.mailbox is not None:
            _append(self.mailbox, line)
        elif kind == "event":
            self._events.append(line)
        self.effect_ids[kind, key] = effect_id
        return effect_id, True

    def reset(self) -> None:
        self.requests, self.by_key, self.effect_ids, self._events = 0, {}, {}, []
        self.answers = {}
        self.random_met = {}
        self.script(Faults())
        if self.mailbox is not None:
            self.mailbox.write_text("")


def _new_id(kind: EffectKind) -> str:
    return f"{_ID_PREFIX[kind]}_{uuid.uuid4().hex}"


def _mailbox_line(
    kind: EffectKind, key: str, effect_id: str, fields: dict[str, Any]
) -> dict[str, Any]:
    return {
        "kind": kind,
        "idempotency_key": key,
        "id": effect_id,
        **fields,
        "received_at": datetime.now(UTC).isoformat(),
    }


def _append(mailbox: Path, line: dict[str, Any]) -> None:
    _append_raw(mailbox, json.dumps(line, ensure_ascii=False) + "\n")


def _append_raw(mailbox: Path, text: str) -> None:
    with mailbox.open("a", encoding="utf-8") as f:
        f.write(text)


def _parse_lines(text: str) -> Iterator[dict[str, Any]]:
    """The mailbox's lines; a line torn by a kill is no effect and is skipped."""
    for raw in text.splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if isinstance(line, dict):
            yield line


def _recover_mailbox(mailbox: Path) -> tuple[dict[tuple[EffectKind, str], str], dict[str, Any]]:
    """Keys already delivered (a real provider remembers them across
    restarts), and the events' data by key (their answers)."""
    if not mailbox.exists():
        return {}, {}
    text = mailbox.read_text(encoding="utf-8")
    if text and not text.endswith("\n"):
        _append_raw(mailbox, "\n")  # end a line torn by a kill, or the next one fuses with it
    known: dict[tuple[EffectKind, str], str] = {}
    answers: dict[str, Any] = {}
    for line in _parse_lines(text):
        # Lines written before events existed have no kind: they are emails.
        kind: EffectKind = "event" if line.get("kind") == "event" else "email"
        key = line.get("idempotency_key")
        if isinstance(key, str):
            known.setdefault((kind, key), line.get("id") or _new_id(kind))
            if kind == "event":
                answers.setdefault(key, line.get("data"))
    return known, answers


_STATE = web.AppKey("state", MailState)


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


async def _post_message(request: web.Request) -> web.Response:
    key = request.headers.get(_IDEMPOTENCY_KEY, "")
    body, failure, drop = await _admit(request, key)
    if failure is not None:
        return failure
    if not key:
        return _error(400, "Idempotency-Key header is required")
    try:
        message = _Message.model_validate_json(body)
    except ValidationError as exc:
        return _error(422, f"invalid message: {exc.errors(include_url=False)}")
    delivered = request.app[_STATE].deliver("email", key, message.model_dump())
    return _dropped(request) if drop else _delivered(delivered)


async def _post_event(request: web.Request) -> web.Response:
    key = request.headers.get(_WEBHOOK_ID, "")
    body, failure, drop = await _admit(request, key)
    if failure is not None:
        return failure
    if not key:
        return _error(400, "webhook-id header is required")
    fields = _event_fields(body, request)
    if fields is None:
        return _error(400, "the body must be a JSON object")
    state = request.app[_STATE]
    refusal = _refusal(fields.get("data"), state.by_key[key])
    if refusal is not None:
        return _error(refusal, f"scripted refusal ({refusal})")
    effect_id, created = state.deliver("event", key, fields)
    if drop:
        return _dropped(request)
    answer = {"ok": True, "id": effect_id, "data": state.answers.get(key)}
    return web.json_response(answer, status=201 if created else 200)


def _refusal(data: Any, attempt: int) -> int | None:
    """The status a directive in ``data``'s strings scripts for this
    request with its webhook-id (``attempt``: 1 for the first), if any."""
    for text in _strings(data):
        for match in _REFUSAL.finditer(text):
            status, times = int(match[1]), match[2]
            if times is None or attempt <= int(times):
                return status
    return None


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


async def _admit(request: web.Request, key: str) -> tuple[bytes, web.Response | None, bool]:
    """Count the request and play the scripted faults, else the random ones:
    its body, the failure to answer instead of delivering, if any, and
    whether to drop the connection once delivered."""
    state = request.app[_STATE]
    state.count_request(key)
    failing, faults = state.take_failure(), state.faults
    chance = None if failing else state.random_fault(key)
    # Read before the delay so a request the client gives up on still takes
    # effect, as at a real provider: the window a resend's same key covers.
    body = await request.read()
    if faults.delay_s:
        await asyncio.sleep(faults.delay_s)
    if chance == "timeout":
        await asyncio.sleep(state.hold_s)
    if failing:
        return body, _injected_failure(faults), False
    if chance == "503":
        return body, _error(503, "injected fault (random)"), False
    return body, None, chance == "drop"


def _dropped(request: web.Request) -> web.Response:
    """Close the connection with no answer (the effect already happened); the
    response returned is never written."""
    transport = request.transport
    if transport is not None:
        transport.abort()
    return web.Response(status=204)


def _event_fields(body: bytes, request: web.Request) -> dict[str, Any] | None:
    """An event's own mailbox fields, or None if its body is not a JSON object."""
    try:
        raw = body.decode("utf-8")
        event = json.loads(raw)
    except ValueError:  # UnicodeDecodeError is one
        return None
    if not isinstance(event, dict):
        return None
    return {
        "type": event.get("type"),
        "data": event.get("data"),
        "timestamp": event.get("timestamp"),
        "headers": {name: request.headers.get(name) for name in _WEBHOOK_HEADERS},
        "body": raw,
    }


def _delivered(outcome: tuple[str, bool]) -> web.Response:
    effect_id, created = outcome
    return web.json_response({"id": effect_id}, status=201 if created else 200)


def _injected_failure(faults: Faults) -> web.Response:
    headers = {} if faults.retry_after is None else {"Retry-After": str(faults.retry_after)}
    return _error(faults.status, "injected fault", headers)


async def _get_deliveries(request: web.Request) -> web.Response:
    return web.json_response(request.app[_STATE].deliveries())


async def _get_events(request: web.Request) -> web.Response:
    return web.json_response(request.app[_STATE].events())


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


def make_app(
    mailbox: Path | None = None,
    *,
    faults: Mapping[str, float] | None = None,
    seed: int = 0,
    hold_s: float = DEFAULT_HOLD_S,
) -> web.Application:
    app = web.Application()
    random = RandomFaults(RANDOM_FAULTS, dict(faults or {}), seed)
    app[_STATE] = MailState(mailbox, random=random, hold_s=hold_s)
    app.router.add_post(MESSAGES_PATH, _post_message)
    app.router.add_post(EVENTS_PATH, _post_event)
    app.router.add_get("/_deliveries", _get_deliveries)
    app.router.add_get("/_events", _get_events)
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


async def serve_fake_mail(
    host: str,
    port: int,
    mailbox: Path | None,
    *,
    faults: Mapping[str, float] | None = None,
    seed: int = 0,
    hold_s: float = DEFAULT_HOLD_S,
) -> None:
    """Serve until cancelled."""
    app = make_app(mailbox, faults=faults, seed=seed, hold_s=hold_s)
    runner, base_url = await _start(app, host, port)
    try:
        log.info(
            "fake_mail.listening",
            url=base_url + MESSAGES_PATH,
            events_url=base_url + EVENTS_PATH,
            mailbox=str(mailbox),
            faults=app[_STATE].random.describe(),
            seed=seed,
        )
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


class FakeMailServer:
    """The fake provider on 127.0.0.1 and a free port, for the span of an ``async with``."""

    def __init__(
        self,
        mailbox: Path | None = None,
        *,
        faults: Mapping[str, float] | None = None,
        seed: int = 0,
        hold_s: float = DEFAULT_HOLD_S,
    ) -> None:
        self.mailbox = mailbox
        self._app = make_app(mailbox, faults=faults, seed=seed, hold_s=hold_s)
        self._runner: web.AppRunner | None = None
        self.base_url = ""

    @property
    def url(self) -> str:
        return self.base_url + MESSAGES_PATH

    @property
    def events_url(self) -> str:
        return self.base_url + EVENTS_PATH

    @property
    def state(self) -> MailState:
        return self._app[_STATE]

    async def deliveries(self) -> Deliveries:
        return self.state.deliveries()

    async def events(self) -> list[dict[str, Any]]:
        """The events received, as ``GET /_events`` answers them."""
        return self.state.events()

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
