"""Stream messages and enqueueing.

Every XADD also records ``job_id -> entry id`` in the stream's index hash, in
the same Lua call (one round trip). Acknowledging removes the entry from the
index, so the reconciler can tell a job still waiting in the stream from one
whose message was lost with Redis' data.

A transient failure takes the entry out of the stream into the workflow's
delayed set until its backoff has passed (``defer``); ``promote_due`` puts it
back. Both are single Lua calls on the server's clock, and the index says
``delayed`` meanwhile, so a job is always in exactly one of: the stream, the
delayed set, the dead letters, or done. A job delayed because every model
of its route cools down also waits in each model's waiting set, from which
``release_waiting`` lets it out before its due time (docs/model-routing.md,
"The cooldown").
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import RedisError, ResponseError

from oncely import tracing
from oncely.names import WorkflowKeys
from oncely.queue import scripts
from oncely.redis_client import RedisClient, ScriptCall

DEAD_STREAM_MAXLEN = 100_000
# How long a cancel stays announced to running deliveries (they hear of it
# at their next lease renewal, seconds later).
CANCEL_MEMORY_MS = 86_400_000
# The index's value for a job waiting in the delayed set (see scripts.DEFER).
DELAYED = "delayed"

Entry = tuple[str, dict[str, str]]

# KEYS[1] stream, KEYS[2] index; ARGV: group, job_id. 1 when a worker holds
# the job's entry (delivered, not yet acknowledged).
_HELD = """
local entry = redis.call('HGET', KEYS[2], ARGV[2])
if not entry or entry == 'delayed' then return 0 end
return #redis.call('XPENDING', KEYS[1], ARGV[1], entry, entry, 1)
"""

# KEYS[1] stream, KEYS[2] index; ARGV: job_id, tenant, payload, enqueued_at,
# then traceparent (may be empty: not added), then any extra field/value pairs.
_ENQUEUE = """
local fields = {'job_id', ARGV[1], 'tenant', ARGV[2], 'payload', ARGV[3], 'enqueued_at', ARGV[4]}
if ARGV[5] ~= '' then
  fields[#fields + 1] = 'traceparent'
  fields[#fields + 1] = ARGV[5]
end
for i = 6, #ARGV do fields[#fields + 1] = ARGV[i] end
local id = redis.call('XADD', KEYS[1], '*', unpack(fields))
redis.call('HSET', KEYS[2], ARGV[1], id)
return id
"""
# The same, unless the index already names an entry (or the delayed set) for
# the job: an enqueue whose reply was lost may have landed, and dispatching
# it again would only make a second delivery.
_ENQUEUE_UNLESS_INDEXED = (
    "local known = redis.call('HGET', KEYS[2], ARGV[1])\n"
    "if known then return known end\n" + _ENQUEUE
)


@dataclass(frozen=True)
class JobMessage:
    job_id: str
    tenant: str
    payload: dict[str, Any]
    enqueued_at: float
    # W3C trace context of whoever enqueued it (the POST's span), if traced.
    traceparent: str | None = None

    @classmethod
    def new(cls, job_id: str, tenant: str, payload: dict[str, Any]) -> JobMessage:
        return cls(job_id, tenant, payload, time.time(), tracing.traceparent())

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> JobMessage:
        return cls(
            job_id=fields["job_id"],
            tenant=fields["tenant"],
            payload=json.loads(fields["payload"]),
            enqueued_at=float(fields["enqueued_at"]),
            traceparent=fields.get("traceparent"),
        )


@dataclass(frozen=True)
class DeadLetter:
    """A dead entry: the original message fields plus why and when it died."""

    dead_id: str
    job_id: str
    reason: str
    deliveries: int
    last_error: str
    original_id: str
    dead_at: float
    fields: dict[str, str]

    @classmethod
    def from_entry(cls, dead_id: str, fields: dict[str, str]) -> DeadLetter:
        return cls(
            dead_id=dead_id,
            job_id=fields.get("job_id", ""),
            reason=fields.get("reason", ""),
            deliveries=int(fields.get("deliveries", "0")),
            last_error=fields.get("last_error", ""),
            original_id=fields.get("original_id", ""),
            dead_at=float(fields.get("dead_at", "0")),
            fields=fields,
        )

    def message(self) -> JobMessage:
        return JobMessage.from_fields(self.fields)


@dataclass(frozen=True)
class Waiting:
    """What a delayed job waits for besides its due time: any of ``models``
    to stop cooling for ``scope`` (its tenant's, as the cooldown names it),
    or to want a probe (docs/model-routing.md, "The cooldown")."""

    models: tuple[str, ...]
    scope: str


@dataclass(frozen=True)
class Consumer:
    name: str
    pending: int
    idle_ms: int


@dataclass(frozen=True)
class Whereabouts:
    """Where a job's message is in Redis now, for operators: ``state`` is
    ``waiting`` (in the stream, not read yet), ``in_flight`` (read and
    pending), ``delayed`` (waiting out a redelivery backoff), ``missing``
    (indexed but gone from the stream) or ``none`` (no message: the job
    finished or died, or its message is still to be restored)."""

    state: str
    entry_id: str | None = None
    # In flight: the consumer holding it, since when, and this entry's
    # deliveries so far (XPENDING: deliveries that never reported included).
    consumer: str | None = None
    idle_ms: int = 0
    entry_deliveries: int = 0
    # Delayed: when it goes back into the stream (unix seconds).
    due_at: float | None = None
    fields: dict[str, str] = field(default_factory=dict)

    @property
    def delivery(self) -> int | None:
        """The job's delivery number running now (in flight) or next."""
        if self.state not in ("waiting", "in_flight", "delayed"):
            return None
        return int(self.fields.get("delivered", "0")) + max(self.entry_deliveries, 1)


@dataclass(frozen=True)
class StreamStats:
    length: int
    pending: int
    # Since the oldest unacknowledged entry was added (0 when none).
    oldest_pending_age_s: float
    # Jobs waiting out a redelivery backoff.
    delayed: int
    dead_letters: int
    consumers: list[Consumer]


class Stream:
    """One workflow's job stream: ``stream`` with its ``dead`` letters,
    ``index`` and consumer ``group``. The only code that talks to them."""

    def __init__(self, redis: RedisClient, keys: WorkflowKeys) -> None:
        self.redis = redis
        self.keys = keys
        self.stream = keys.stream
        self.dead = keys.dead
        self.index = keys.index
        self.group = keys.group
        self._enqueue = redis.register_script(_ENQUEUE)
        self._enqueue_unless_indexed = redis.register_script(_ENQUEUE_UNLESS_INDEXED)
        self._ack = redis.register_script(scripts.ACK)
        self._dead_letter = redis.register_script(scripts.DEAD_LETTER)
        self._renew = redis.register_script(scripts.RENEW)
        self._defer = redis.register_script(scripts.DEFER)
        self._promote = redis.register_script(scripts.PROMOTE)
        self._release = redis.register_script(scripts.RELEASE)
        self._announce_cancel = redis.register_script(scripts.ANNOUNCE_CANCEL)
        self._drop_superseded = redis.register_script(scripts.DROP_SUPERSEDED)
        self._delay_keys = [
            keys.stream,
            keys.index,
            keys.delayed,
            keys.delayed_messages,
            keys.cooling,
        ]
        self._held = redis.register_script(_HELD)

    async def enqueue(self, message: JobMessage, extra: Mapping[str, str] | None = None) -> str:
        """XADD the message (with ``extra`` fields, if any) and index it;
        return the entry id."""
        call = self.enqueue_call(message, extra)
        return str(await self._enqueue(keys=call.keys, args=call.args))

    async def enqueue_unless_indexed(self, message: JobMessage) -> str:
        """``enqueue``, unless the index already knows the job (an enqueue
        whose reply was lost and that landed): the entry id either way."""
        call = self.enqueue_call(message)
        return str(await self._enqueue_unless_indexed(keys=call.keys, args=call.args))

    def enqueue_call(
        self,
        message: JobMessage,
        extra: Mapping[str, str] | None = None,
        on_error: Callable[[RedisError], None] | None = None,
    ) -> ScriptCall:
        """``enqueue`` as a call to send with other writes in one round trip
        (``redis_client.call_together``)."""
        args = [
            message.job_id,
            message.tenant,
            json.dumps(message.payload, separators=(",", ":")),
            f"{message.enqueued_at:.6f}",
            message.traceparent or "",
        ]
        for name, value in (extra or {}).items():
            args += [name, value]
        return ScriptCall(self._enqueue, [self.stream, self.index], args, on_error)

    async def ensure_group(self) -> None:
        """Create the consumer group (and the stream) unless it exists."""
        try:
            await self.redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def read_new(self, consumer: str, count: int, block_ms: int) -> list[Entry]:
        # RESP2 reply: [[stream, [(id, fields), ...]]]
        reply: Any = await self.redis.xreadgroup(
            self.group, consumer, {self.stream: ">"}, count=count, block=block_ms
        )
        if not reply:
            return []
        return [(str(entry_id), dict(fields)) for entry_id, fields in reply[0][1]]

    async def claim_idle(
        self, consumer: str, min_idle_ms: int, cursor: str, count: int
    ) -> tuple[str, list[Entry], list[str]]:
        """XAUTOCLAIM: (next cursor, claimed entries, ids of entries that were
        deleted while pending). Redis 6.2 answers two elements and reports a
        deleted entry as one with no fields; 7.0+ adds a third element."""
        reply: Any = await self.redis.xautoclaim(
            self.stream, self.group, consumer, min_idle_ms, start_id=cursor, count=count
        )
        next_cursor, claimed = str(reply[0]), reply[1]
        deleted = [str(i) for i in reply[2]] if len(reply) > 2 else []
        entries: list[Entry] = []
        for entry_id, fields in claimed:
            if fields:
                entries.append((entry_id, fields))
            else:
                deleted.append(entry_id)
        return next_cursor, entries, deleted

    async def drop_superseded(self, consumer: str, entries: list[Entry]) -> set[str]:
        """Acknowledge, without running them, claimed entries of jobs that
        were enqueued again since (scripts.DROP_SUPERSEDED); their ids."""
        args: list[str] = [self.group, consumer]
        for entry_id, fields in entries:
            args += [entry_id, fields.get("job_id", "")]
        dropped = await self._drop_superseded(keys=[self.stream, self.index], args=args)
        return {str(i) for i in dropped}

    async def delivery_counts(self, consumer: str, ids: list[str]) -> dict[str, int]:
        """Delivery count of each id, from one XPENDING range call."""
        if not ids:
            return {}
        ordered = sorted(ids, key=_id_key)
        rows: Any = await self.redis.xpending_range(
            self.stream,
            self.group,
            min=ordered[0],
            max=ordered[-1],
            count=len(ids) * 4 + 100,
            consumername=consumer,
        )
        wanted = set(ids)
        return {
            str(r["message_id"]): int(r["times_delivered"])
            for r in rows
            if str(r["message_id"]) in wanted
        }

    async def ack(self, consumer: str, items: list[tuple[str, str]]) -> set[str]:
        """Acknowledge (entry id, job id) pairs this consumer still owns."""
        if not items:
            return set()
        args: list[str] = [self.group, consumer]
        for entry_id, job_id in items:
            args += [entry_id, job_id]
        acked = await self._ack(keys=[self.stream, self.index], args=args)
        return {str(i) for i in acked}

    async def ack_lost(self, ids: list[str]) -> None:
        """Entries trimmed while pending: nothing left to deliver."""
        if ids:
            await self.redis.xack(self.stream, self.group, *ids)

    async def dead_letter(
        self, consumer: str, entry_id: str, job_id: str, fields: dict[str, str]
    ) -> bool:
        args: list[str | int] = [self.group, consumer, entry_id, job_id, DEAD_STREAM_MAXLEN]
        for k, v in fields.items():
            args += [k, v]
        keys = [self.stream, self.dead, self.index]
        return bool(await self._dead_letter(keys=keys, args=args))

    async def defer(
        self,
        consumer: str,
        entry_id: str,
        job_id: str,
        delay_s: float,
        fields: dict[str, str],
        *,
        waiting_on: Waiting | None = None,
    ) -> bool:
        """Take the entry out of the stream until ``delay_s`` from now (server
        clock), waiting for models' cooldowns meanwhile if ``waiting_on``
        says so; False if this consumer no longer owns it."""
        args: list[str | int] = [
            self.group,
            consumer,
            entry_id,
            job_id,
            max(0, int(delay_s * 1000)),
            json.dumps(fields, separators=(",", ":")),
        ]
        keys = list(self._delay_keys)
        if waiting_on is not None and waiting_on.models:
            args += [f"{waiting_on.scope} {job_id}", *waiting_on.models]
            keys += [self.keys.waiting_on(model) for model in waiting_on.models]
        return bool(await self._defer(keys=keys, args=args))

    async def promote_due(self, limit: int = 500) -> int:
        """Put jobs whose backoff has passed back into the stream; how many."""
        moved, _ = await self.promote(limit)
        return moved

    async def promote(self, limit: int = 500) -> tuple[int, list[str]]:
        """``promote_due``, and the models that delayed jobs wait for, in
        the same round trip."""
        reply = await self._promote(keys=self._delay_keys, args=[limit])
        return int(reply[0]), [_text(model) for model in reply[1:]]

    async def release_waiting(
        self, model: str, cooling: Mapping[str, bool], *, spread_s: float, probe_gap_s: float
    ) -> int:
        """Let out the delayed jobs waiting for ``model``: all of them whose
        scope it no longer cools (``cooling``: each scope cooling it, True
        when its probe may go now; "*" the fleet's), due at once, spread over
        ``spread_s``; and per scope whose probe may go, one, at most once per
        ``probe_gap_s``. How many (scripts.RELEASE)."""
        args: list[str | int] = [model, _ms(spread_s), _ms(probe_gap_s)]
        for scope, ready in cooling.items():
            args += [scope, int(ready)]
        keys = [self.keys.delayed, self.keys.cooling, self.keys.waiting_on(model)]
        return int(await self._release(keys=keys, args=args))

    async def delayed_jobs(self, job_ids: list[str]) -> list[bool]:
        """Whether each job waits in the delayed set, in one round trip."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.zscore(self.keys.delayed, job_id)
            return [score is not None for score in await pipe.execute()]

    async def renew(self, consumer: str, items: list[tuple[str, str]]) -> tuple[set[str], set[str]]:
        """Renew the leases of (entry id, job id) pairs this consumer still
        owns: the entry ids renewed, and the job ids among them cancelled."""
        if not items:
            return set(), set()
        args: list[str] = [self.group, consumer]
        for entry_id, job_id in items:
            args += [entry_id, job_id]
        renewed, cancelled = await self._renew(keys=[self.stream, self.keys.cancelled], args=args)
        return {str(i) for i in renewed}, {str(j) for j in cancelled}

    async def forget_cancel(self, job_id: str) -> None:
        """The job runs again (an operator's rewind or replay): its old cancel
        is no longer news."""
        await self.redis.zrem(self.keys.cancelled, job_id)

    async def announce_cancel(self, job_id: str) -> None:
        """Tell the workers running ``job_id`` (at their next lease renewal)
        that it was cancelled. PostgreSQL is the record; this only hurries."""
        await self._announce_cancel(keys=[self.keys.cancelled], args=[job_id, CANCEL_MEMORY_MS])

    async def forget_consumers(self, idle_ms: int, only: str | None = None) -> list[str]:
        """Delete consumers with nothing pending that have been idle for ``idle_ms``
        (or just ``only``): every process adds one, and a consumer's name
        otherwise stays in the group forever."""
        consumers: Any = await self.redis.xinfo_consumers(self.stream, self.group)
        gone = []
        for c in consumers:
            name = str(c["name"])
            if int(c["pending"]) or (only is not None and name != only):
                continue
            if only is not None or int(c["idle"]) >= idle_ms:
                await self.redis.xgroup_delconsumer(self.stream, self.group, name)
                gone.append(name)
        return gone

    async def trim(self) -> str | None:
        """Trim below both the oldest pending entry and the group's last-delivered
        id: never a pending or undelivered entry. Returns the MINID used."""
        groups: Any = await self.redis.xinfo_groups(self.stream)
        group = next((g for g in groups if g["name"] == self.group), None)
        if group is None:
            return None
        floor = str(group["last-delivered-id"])
        pending: Any = await self.redis.xpending(self.stream, self.group)
        if pending["pending"]:
            floor = min(floor, str(pending["min"]), key=_id_key)
        await self.redis.xtrim(self.stream, minid=floor, approximate=False)
        return floor

    # -- dead letters and status, for operators ----------------------------------

    async def dead_letters(self, limit: int = 100) -> list[DeadLetter]:
        """Newest first."""
        entries: Any = await self.redis.xrevrange(self.dead, count=limit)
        return [DeadLetter.from_entry(str(i), dict(f)) for i, f in entries]

    async def dead_letter_by_id(self, dead_id: str) -> DeadLetter | None:
        try:
            entries: Any = await self.redis.xrange(self.dead, min=dead_id, max=dead_id)
        except ResponseError:  # not a stream id at all
            return None
        return DeadLetter.from_entry(str(entries[0][0]), dict(entries[0][1])) if entries else None

    async def forget_dead_letters(self, job_ids: set[str], batch: int = 1000) -> int:
        """Delete the dead entries of these jobs (replayed); how many."""
        doomed: list[str] = []
        cursor = "-"
        while True:
            entries: Any = await self.redis.xrange(self.dead, min=cursor, count=batch)
            doomed += [str(i) for i, f in entries if f.get("job_id") in job_ids]
            if len(entries) < batch:
                break
            cursor = "(" + str(entries[-1][0])
        for start in range(0, len(doomed), batch):
            await self.redis.xdel(self.dead, *doomed[start : start + batch])
        return len(doomed)

    async def stats(self) -> StreamStats:
        await self.ensure_group()
        pending: Any = await self.redis.xpending(self.stream, self.group)
        consumers: Any = await self.redis.xinfo_consumers(self.stream, self.group)
        oldest = str(pending["min"]) if pending["pending"] else None
        return StreamStats(
            length=int(await self.redis.xlen(self.stream)),
            pending=int(pending["pending"]),
            oldest_pending_age_s=0.0 if oldest is None else _age_s(oldest),
            delayed=int(await self.redis.zcard(self.keys.delayed)),
            dead_letters=int(await self.redis.xlen(self.dead)),
            consumers=[
                Consumer(str(c["name"]), int(c["pending"]), int(c["idle"])) for c in consumers
            ],
        )

    async def held(self, job_id: str) -> bool:
        """Whether a worker holds the job now: its entry was delivered and is
        not acknowledged (the job is ``running``: docs/streaming.md)."""
        return bool(await self._held(keys=[self.stream, self.index], args=[self.group, job_id]))

    async def whereabouts(self, job_id: str) -> Whereabouts:
        """Where the job's message is now (a few round trips; for operators)."""
        found: Any = await self.redis.hget(self.index, job_id)
        if found is None:
            return Whereabouts("none")
        if found == DELAYED:
            due: Any = await self.redis.zscore(self.keys.delayed, job_id)
            raw: Any = await self.redis.hget(self.keys.delayed_messages, job_id)
            fields = {k: str(v) for k, v in json.loads(raw).items()} if raw else {}
            due_at = None if due is None else float(due) / 1000
            return Whereabouts("delayed", due_at=due_at, fields=fields)
        entry_id = str(found)
        entries: Any = await self.redis.xrange(self.stream, min=entry_id, max=entry_id)
        if not entries:
            return Whereabouts("missing", entry_id)
        fields = dict(entries[0][1])
        rows: Any = await self.redis.xpending_range(
            self.stream, self.group, min=entry_id, max=entry_id, count=1
        )
        if not rows:
            return Whereabouts("waiting", entry_id, fields=fields)
        return Whereabouts(
            "in_flight",
            entry_id,
            consumer=str(rows[0]["consumer"]),
            idle_ms=int(rows[0]["time_since_delivered"]),
            entry_deliveries=int(rows[0]["times_delivered"]),
            fields=fields,
        )

    async def erase_tenant(self, tenant: str, batch: int = 1000) -> int:
        """Delete every message of ``tenant``: waiting or pending in the
        stream, delayed, or dead. For erasure; how many went."""
        erased = 0
        for key in (self.stream, self.dead):
            doomed: list[tuple[str, str]] = []
            cursor = "-"
            while True:
                entries: Any = await self.redis.xrange(key, min=cursor, count=batch)
                doomed += [
                    (str(i), f.get("job_id", "")) for i, f in entries if f.get("tenant") == tenant
                ]
                if len(entries) < batch:
                    break
                cursor = "(" + str(entries[-1][0])
            for entry_id, job_id in doomed:
                async with self.redis.pipeline(transaction=True) as pipe:
                    pipe.xdel(key, entry_id)
                    if key == self.stream:
                        pipe.xack(self.stream, self.group, entry_id)
                        pipe.hdel(self.index, job_id)
                    await pipe.execute()
            erased += len(doomed)
        async for job_id, raw in self.redis.hscan_iter(self.keys.delayed_messages):
            if json.loads(raw).get("tenant") == tenant:
                async with self.redis.pipeline(transaction=True) as pipe:
                    pipe.zrem(self.keys.delayed, job_id)
                    pipe.hdel(self.keys.delayed_messages, job_id)
                    pipe.hdel(self.index, job_id)
                    await pipe.execute()
                erased += 1
        return erased

    async def take_reconcile_turn(self, ttl_ms: int) -> bool:
        """True for the one process (fleet-wide) that reconciles for ``ttl_ms``."""
        return bool(await self.redis.set(self.keys.reconcile_lock, "1", nx=True, px=ttl_ms))

    async def index_entries(self, job_ids: list[str]) -> list[str | None]:
        """The indexed entry id of each job (None: no message was indexed;
        ``"delayed"``: waiting in the delayed set)."""
        found: list[Any] = await self.redis.hmget(self.index, job_ids)
        return [None if f is None else str(f) for f in found]

    async def entries_exist(self, entry_ids: list[str]) -> list[bool]:
        """Whether each entry is still in the stream, in one round trip."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for entry_id in entry_ids:
                pipe.xrange(self.stream, min=entry_id, max=entry_id)
            return [bool(found) for found in await pipe.execute()]


def _age_s(entry_id: str) -> float:
    """Seconds since an entry id's millisecond timestamp."""
    return max(0.0, time.time() - _id_key(entry_id)[0] / 1000)


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _ms(seconds: float) -> int:
    return max(0, round(seconds * 1000))
