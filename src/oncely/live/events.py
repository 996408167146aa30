"""Each job's live events, in Redis (docs/streaming.md).

A job's events are one Redis stream (``names.job_events``), under its
workflow's hash tag: ``status`` on every change, ``step`` when a checkpoint
is stored, ``token`` for a streamed model call, ``progress`` from
``ctx.progress``, ``reset`` when an attempt starts over a step that may
have streamed already. The entry ids are the events' ids: increasing per
job, so a client resumes after the last one it saw. Each stream is bounded
(``maxlen``, approximately) and expires ``ttl_s`` after its last event.

It is a view, never the record: publishing never fails or delays a job. A
process queues its events and one task sends them, many in one round trip
(a pipeline of one small script each), in the order they were published; a
process killed with events queued loses them, and a reader then starts from
a snapshot of PostgreSQL (``oncely.api.streaming``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import structlog
from redis.exceptions import RedisError

from oncely import names
from oncely.redis_client import RedisClient, ScriptCall, call_together

log = structlog.get_logger(__name__)

EventType = Literal["status", "step", "token", "progress", "reset"]
# Each part of an entry id is an unsigned 64-bit integer in Redis.
_MAX_ID_PART = 2**64 - 1

# KEYS: the jobs' events, one key per event (of one workflow: one slot).
# ARGV: maxlen, ttl ms, then each event's type and data (JSON).
_PUBLISH = """
for i, key in ipairs(KEYS) do
  redis.call('XADD', key, 'MAXLEN', '~', ARGV[1], '*',
             'type', ARGV[1 + 2 * i], 'data', ARGV[2 + 2 * i])
  redis.call('PEXPIRE', key, ARGV[2])
end
return #KEYS
"""


@dataclass(frozen=True)
class LiveConfig:
    """ONCELY_STREAM_*: how many events a job keeps (``maxlen``, about) and
    how long after its last one (``ttl_s``)."""

    maxlen: int = 10_000
    ttl_s: float = 3600.0


@dataclass(frozen=True)
class JobEvent:
    """One event as a reader gets it: its id (the entry's), type and data."""

    id: str
    type: str
    data: Any

    @classmethod
    def of(cls, entry_id: str | bytes, fields: Mapping[Any, Any]) -> JobEvent:
        decoded = {_text(k): _text(v) for k, v in fields.items()}
        return cls(
            _text(entry_id), decoded.get("type", ""), json.loads(decoded.get("data", "null"))
        )


@dataclass
class JobEvents:
    """Publishing and reading jobs' events (module docstring)."""

    redis: RedisClient
    config: LiveConfig = field(default_factory=LiveConfig)
    _queue: list[tuple[str, str, str, str]] = field(default_factory=list, init=False)
    _sender: asyncio.Task[None] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._publish = self.redis.register_script(_PUBLISH)

    # -- publishing -----------------------------------------------------------------

    def publish(self, workflow: str, job_id: str, kind: EventType, data: Any) -> None:
        """Queue an event; sent soon, in order, never raising."""
        payload = json.dumps(data, separators=(",", ":"), default=str)
        self._queue.append((workflow, names.job_events(workflow, job_id), kind, payload))
        if self._sender is None or self._sender.done():
            self._sender = asyncio.ensure_future(self._send_queued())

    def status_changed(
        self, workflow: str, job_id: str, status: str, extra: Mapping[str, Any]
    ) -> None:
        """A job's status change as ``oncely.jobs.transitions`` tells it: its
        ``status`` event."""
        self.publish(workflow, job_id, "status", {"status": status, **extra})

    async def drain(self) -> None:
        """Until every event queued so far was sent (or given up)."""
        while self._sender is not None and not self._sender.done():
            await asyncio.shield(self._sender)

    async def _send_queued(self) -> None:
        while self._queue:
            batch, self._queue = self._queue, []
            try:
                await call_together(self.redis, self._calls(batch))
            except RedisError as exc:
                # A view: the readers fall back on PostgreSQL.
                log.info("live.events_lost", events=len(batch), error=type(exc).__name__)

    def _calls(self, batch: list[tuple[str, str, str, str]]) -> list[ScriptCall]:
        """One script call per workflow (its keys share a slot), in order."""
        ttl_ms = max(1, round(self.config.ttl_s * 1000))
        by_workflow: dict[str, tuple[list[str], list[Any]]] = {}
        for workflow, key, kind, payload in batch:
            keys, args = by_workflow.setdefault(workflow, ([], [self.config.maxlen, ttl_ms]))
            keys.append(key)
            args += [kind, payload]

        def lost(exc: RedisError) -> None:
            log.info("live.events_lost", error=type(exc).__name__)

        return [ScriptCall(self._publish, k, a, lost) for k, a in by_workflow.values()]

    # -- reading --------------------------------------------------------------------

    async def after(
        self, workflow: str, job_id: str, after: str | None, count: int | None = None
    ) -> list[JobEvent]:
        """The job's events after ``after`` (from the first when None), at
        most ``count`` of them (all when None)."""
        key = names.job_events(workflow, job_id)
        start = "-" if after is None else f"({after}"
        entries: Any = await self.redis.xrange(key, min=start, max="+", count=count)
        return [JobEvent.of(entry_id, fields) for entry_id, fields in entries]

    async def follow(self, workflow: str, job_id: str, after: str, block_ms: int) -> list[JobEvent]:
        """Events after ``after``, waiting up to ``block_ms`` for the first."""
        key = names.job_events(workflow, job_id)
        found: Any = await self.redis.xread({key: after}, block=block_ms)
        return [
            JobEvent.of(entry_id, fields)
            for _, entries in found or ()
            for entry_id, fields in entries
        ]

    async def latest(self, workflow: str, job_id: str, count: int) -> list[JobEvent]:
        """The job's last ``count`` events, the latest first."""
        key = names.job_events(workflow, job_id)
        entries: Any = await self.redis.xrevrange(key, count=count)
        return [JobEvent.of(entry_id, fields) for entry_id, fields in entries]

    async def last_id(self, workflow: str, job_id: str) -> str | None:
        """The id of the job's latest event (None: none kept)."""
        found: Any = await self.redis.xrevrange(names.job_events(workflow, job_id), count=1)
        return _text(found[0][0]) if found else None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def event_id(text: str) -> str | None:
    """``text`` as the id of an event a client may resume after (``ms-seq``,
    or ``ms`` for ``ms-0``), None when it is not one. What a client sends
    reaches Redis as an id: anything else (``$``, ``+``, ``-5``, 2**64)
    would make Redis refuse the read, or mean something else than "after
    this event"."""
    ms, dash, seq = text.partition("-")
    parts = (ms, seq) if dash else (ms, "0")
    if not all(_id_part(p) for p in parts):
        return None
    return f"{int(parts[0])}-{int(parts[1])}"


def _id_part(text: str) -> bool:
    # 20 digits at most before int(): a longer one is no id, and Python
    # refuses to read over 4,300 digits at all.
    return 0 < len(text) <= 20 and text.isascii() and text.isdigit() and int(text) <= _MAX_ID_PART


@dataclass(frozen=True)
class LiveJob:
    """One job's events as its delivery publishes them (no I/O: queued)."""

    events: JobEvents
    workflow: str
    job_id: str

    def status(self, status: str, **extra: Any) -> None:
        self.events.publish(self.workflow, self.job_id, "status", {"status": status, **extra})

    def step(self, key: str, kind: str, status: str, usage: Any = None) -> None:
        data: dict[str, Any] = {"key": key, "kind": kind, "status": status}
        if usage:
            data["usage"] = usage
        self.events.publish(self.workflow, self.job_id, "step", data)

    def progress(self, data: Any, step: str | None = None) -> None:
        self.events.publish(self.workflow, self.job_id, "progress", {"data": data, "step": step})

    def tokens(
        self, step: str | None, attempt: int, *, reset: bool, delivery: int = 1
    ) -> TokenStream:
        """A streamed model call's tokens, coalesced (``TokenStream``)."""
        return TokenStream(self, step, attempt, reset=reset, delivery=delivery)

    async def streamed_to(self, step: str | None, response: str) -> int | None:
        """How far the text of the background response kept as ``response``
        (its intent's key) reached the view for ``step``: the provider's
        number (``seq``) of the last piece the step's last ``token`` event
        carried; None when that event is a ``reset`` or another response's
        token, or none is kept (Redis not answering included: the view is
        then started over). Events queued by this process are sent first."""
        try:
            await self.events.drain()
            found = await self.events.latest(self.workflow, self.job_id, _RESUME_SCAN)
        except RedisError:
            return None
        for event in found:
            data = event.data if isinstance(event.data, dict) else {}
            if event.type in ("token", "reset") and data.get("step") == step:
                number = data.get("seq") if data.get("response") == response else None
                return number if type(number) is int else None
        return None


# At most one token event per streamed call this often (seconds).
TOKEN_EVERY_S = 0.05
# How many of a job's latest events a re-attached call looks through for
# where its text reached the view.
_RESUME_SCAN = 500


class TokenStream:
    """A streamed model call's text as ``token`` events: deltas gathered and
    sent at most every ``TOKEN_EVERY_S`` (and what is left at the end). With
    ``reset`` (an attempt after the first, or a redelivery), its first delta
    sends a ``reset`` first: the client drops what that step streamed before.
    A background response's pieces are numbered by the provider (``mark``):
    each token event carries its last piece's number as ``seq``, and the key
    of the intent that keeps the response as ``response``, so a delivery
    that re-attaches to it goes on from there (``LiveJob.streamed_to``)."""

    def __init__(
        self, job: LiveJob, step: str | None, attempt: int, *, reset: bool, delivery: int = 1
    ) -> None:
        self.job = job
        self.step = step
        # The call's attempt in its delivery (fallbacks included), and the delivery.
        self.attempt = attempt
        self.delivery = delivery
        # This attempt may start over what another streamed for the step.
        self.reset = reset
        self._held: list[str] = []
        self._sent_at = 0.0
        self._started = False
        self._sequence: int | None = None
        # The key of the intent keeping the background response streamed.
        self.response: str | None = None

    def mark(self, sequence: int) -> None:
        """The provider's number of the piece fed next."""
        self._sequence = sequence

    def feed(self, delta: str) -> None:
        if not self._started:
            self._started = True
            if self.reset:
                data = {"step": self.step, "attempt": self.attempt, "delivery": self.delivery}
                self._publish("reset", data)
        self._held.append(delta)
        now = time.monotonic()
        if now - self._sent_at >= TOKEN_EVERY_S:
            self.flush(now)

    def flush(self, now: float | None = None) -> None:
        if not self._held:
            return
        text, self._held = "".join(self._held), []
        self._sent_at = time.monotonic() if now is None else now
        data: dict[str, Any] = {"step": self.step, "text": text}
        if self._sequence is not None:
            data.update(seq=self._sequence, response=self.response)
        self._publish("token", data)

    def _publish(self, kind: EventType, data: Any) -> None:
        self.job.events.publish(self.job.workflow, self.job.job_id, kind, data)
