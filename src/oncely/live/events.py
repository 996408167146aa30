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
# What ends a job's stream.
FINISHED = frozenset({"done", "dead", "cancelled"})

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

    async def after(self, workflow: str, job_id: str, after: str | None) -> list[JobEvent]:
        """The job's events after ``after`` (all of them when None)."""
        key = names.job_events(workflow, job_id)
        start = "-" if after is None else f"({after}"
        entries: Any = await self.redis.xrange(key, min=start, max="+")
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

    async def last_id(self, workflow: str, job_id: str) -> str | None:
        """The id of the job's latest event (None: none kept)."""
        found: Any = await self.redis.xrevrange(names.job_events(workflow, job_id), count=1)
        return _text(found[0][0]) if found else None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


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

    def tokens(self, step: str | None, attempt: int, *, reset: bool) -> TokenStream:
        """A streamed model call's tokens, coalesced (``TokenStream``)."""
        return TokenStream(self, step, attempt, reset=reset)


# At most one token event per streamed call this often (seconds).
TOKEN_EVERY_S = 0.05


class TokenStream:
    """A streamed model call's text as ``token`` events: deltas gathered and
    sent at most every ``TOKEN_EVERY_S`` (and what is left at the end). With
    ``reset`` (an attempt after the first, or a redelivery), its first delta
    sends a ``reset`` first: the client drops what that step streamed before."""

    def __init__(self, job: LiveJob, step: str | None, attempt: int, *, reset: bool) -> None:
        self.job = job
        self.step = step
        self.attempt = attempt
        # This attempt may start over what another streamed for the step.
        self.reset = reset
        self._held: list[str] = []
        self._sent_at = 0.0
        self._started = False

    def feed(self, delta: str) -> None:
        if not self._started:
            self._started = True
            if self.reset:
                self._publish("reset", {"step": self.step, "attempt": self.attempt})
        self._held.append(delta)
        now = time.monotonic()
        if now - self._sent_at >= TOKEN_EVERY_S:
            self.flush(now)

    def flush(self, now: float | None = None) -> None:
        if not self._held:
            return
        text, self._held = "".join(self._held), []
        self._sent_at = time.monotonic() if now is None else now
        self._publish("token", {"step": self.step, "text": text})

    def _publish(self, kind: EventType, data: Any) -> None:
        self.job.events.publish(self.job.workflow, self.job.job_id, kind, data)
