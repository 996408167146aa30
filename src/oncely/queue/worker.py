"""The stream worker: claim, run, acknowledge, renew, dead-letter.

Delivery is at-least-once: an entry stays pending until its handler's
effects are committed, and any worker reclaims entries whose owner went
quiet for ``claim_idle_ms``. Owners renew their leases, so a slow but live
handler is never stolen; ``claim_idle_ms`` is only the crash-recovery time.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import psycopg
import redis.exceptions
import structlog

from oncely import metrics
from oncely.batching import GroupCommit
from oncely.errors import DeadlineExceeded, PermanentError, ResumeLater, TransientError
from oncely.jobs.records import DeliveryReport
from oncely.logs import frames
from oncely.queue.stream import Entry, JobMessage, Stream, Waiting
from oncely.retry import backoff_s, classify, resume_s
from oncely.services import Progress, supervised

log = structlog.get_logger("oncely.worker")

# What a handler returns is only reported; any normal return acknowledges.
Handler = Callable[[JobMessage, "Delivery"], Awaitable[str]]
T = TypeVar("T")

_TRANSIENT = (
    TransientError,
    DeadlineExceeded,
    TimeoutError,
    ConnectionError,
    psycopg.OperationalError,
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
)


_MIN_PAUSE_S = 0.1
_ERROR_CHARS = 2000
# Failures of a connection rather than of the work: retried within a second.
_CONNECTION_LOST = (
    ConnectionError,
    psycopg.OperationalError,
    redis.exceptions.ConnectionError,
)
_FORGET_CONSUMER_AFTER_MS = 3_600_000
_MAX_PAUSE_S = 5.0
# A store not answering, for now: settling a delivery is tried again.
_STORE_AWAY = (
    psycopg.OperationalError,
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
)
# How long cancelled handlers get to end at shutdown, after the grace period.
_CANCELLED_WAIT_S = 5.0
# Jobs let out at once when the cooldown they waited for ends come back
# spread over this long, not in one burst (docs/model-routing.md).
_RELEASE_SPREAD_S = 2.0
# A job let out to probe a cooling model has this long to reach it before
# the workers let out another.
_PROBE_GAP_S = 3.0


def consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


@dataclass
class Delivery:
    entry_id: str
    fields: dict[str, str]
    # This entry's deliveries, from XPENDING: it survives crashes.
    count: int
    lease_lost: bool = False
    consumer: str = ""
    started_at: float = field(default_factory=time.time)
    # Model calls the handler made in this delivery (it reports them, also
    # when it fails).
    model_calls: int = 0
    # The job was cancelled while this delivery ran: its handler was stopped.
    job_cancelled: bool = False
    # The handler's time bound, which a cancel of its job cuts short.
    bound: asyncio.Timeout | None = None
    # The job's run this delivery serves (its generation), once the handler
    # loaded it: a failure marks only that run dead.
    generation: int | None = None

    @property
    def job_id(self) -> str:
        return self.fields.get("job_id", "")

    @property
    def number(self) -> int:
        """The job's delivery number: deliveries of its earlier (deferred)
        messages plus this entry's. A delivery killed mid-job leaves a gap."""
        return int(self.fields.get("delivered", "0")) + self.count

    def report(self, outcome: str, error: str | None = None) -> DeliveryReport:
        return DeliveryReport(
            self.job_id,
            self.number,
            self.consumer,
            self.started_at,
            outcome,
            None if error is None else error[:_ERROR_CHARS],
            self.model_calls,
        )


class _HandlerCancelled(TransientError):
    """The handler outlived its bound and was cancelled."""


@dataclass(frozen=True)
class WorkerConfig:
    """How one worker reads, runs, redelivers and gives up (docs/settings.md)."""

    # Handlers in flight at once.
    concurrency: int = 64
    # Crash-recovery time: entries idle this long are reclaimed (live owners renew).
    claim_idle_ms: int = 30_000
    # Deliveries of one entry that never reported back (crash loops); then dead.
    max_deliveries: int = 5
    block_ms: int = 1000
    shutdown_grace_s: float = 25.0
    trim_every_s: float = 30.0
    # A handler still running after this is cancelled and its job redelivered
    # (the delivery's budget plus a grace); None: no bound.
    handler_timeout_s: float | None = 70.0
    # Redelivery after a transient failure: full-jitter exponential backoff.
    redelivery_base_s: float = 15.0
    redelivery_max_s: float = 900.0
    # Transient failures dead-letter a job only once it is this old.
    job_max_age_s: float = 86_400.0
    # How often due redeliveries are moved back into the stream.
    promote_every_s: float = 1.0


class Worker:
    def __init__(
        self,
        stream: Stream,
        handler: Handler,
        config: WorkerConfig,
        *,
        workflow: str,
        consumer: str | None = None,
        on_dead: Callable[[str, str, int | None], Awaitable[None]] | None = None,
        on_failed: Callable[[list[DeliveryReport]], Awaitable[None]] | None = None,
        is_cancelled: Callable[[str], Awaitable[bool]] | None = None,
        cooling: Callable[[str], Awaitable[Mapping[str, bool]]] | None = None,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.stream = stream
        # The workflow this worker runs: a label on its metrics and logs.
        self.workflow = workflow
        self.log = log.bind(workflow=workflow)
        # Called with (job id, reason) after a message was dead-lettered.
        self.on_dead = on_dead
        # Called with the failed deliveries this worker settled (redelivered,
        # dead-lettered, cancelled), for their jobs' histories; the successful
        # ones are the handler's to record, with the result.
        self.on_failed = on_failed
        # Asked (job id) before a delivery stopped for its job's cancel is
        # acknowledged: whether the job really is cancelled (PostgreSQL).
        self.is_cancelled = is_cancelled
        # Asked (a model) for the scopes cooling it, each True when its probe
        # may go now (``Cooldown.scopes``): jobs waiting for the model are
        # let out by it. None: nothing cools, let them all out.
        self.cooling = cooling
        # The backoff's jitter source (tests make it deterministic).
        self.rand = rand
        # Ticks whenever the loop goes round or a handler ends (``/healthz``).
        self.progress = Progress()
        self._job_seconds = metrics.JOB_SECONDS.labels(workflow=workflow)
        self.handler = handler
        self.config = config
        self.consumer = consumer or consumer_name()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._deliveries: dict[str, Delivery] = {}
        self._cursor = "0-0"
        self._next_claim = 0.0
        self._stopping = asyncio.Event()
        # Set once in-flight handlers are drained: the background loops end.
        self._halted = asyncio.Event()
        self._slot_free = asyncio.Event()
        self._ack: GroupCommit[Delivery, str] = GroupCommit(
            self._ack_batch, key=lambda d: d.entry_id
        )
        self._running_jobs: dict[str, asyncio.Event] = {}
        self.stats: dict[str, int] = {
            "acked": 0,
            "dead": 0,
            "transient": 0,
            "lost": 0,
            "settle_retries": 0,
        }

    # -- the loop -------------------------------------------------------

    async def run(self) -> None:
        """Run until ``stop()``; then drain in-flight handlers within the grace period.

        The background tasks (lease renewal, redelivery, trimming) run in one
        task group with the loop: if one dies, it is logged with its traceback
        and ``run`` raises, so the process exits and a supervisor restarts it.
        A dead renewal task must never go unnoticed (it means double model
        calls)."""
        await self._wait_for_redis()
        self.log.info("worker.started", consumer=self.consumer, concurrency=self.config.concurrency)
        try:
            async with asyncio.TaskGroup() as group:
                background = [
                    group.create_task(supervised(name, loop, self.log))
                    for name, loop in (
                        ("renew-leases", self._renew_forever),
                        ("redeliver", self._promote_forever),
                        ("trim", self._trim_forever),
                    )
                ]
                await self._loop()
                await self._drain()
                self._halted.set()
                for task in background:
                    task.cancel()
        finally:
            await self._ack.drain()
            with contextlib.suppress(redis.exceptions.RedisError):
                await self.stream.forget_consumers(idle_ms=0, only=self.consumer)
            self.log.info("worker.stopped", consumer=self.consumer, **self.stats)

    async def _loop(self) -> None:
        pause = _MIN_PAUSE_S
        while not self._stopping.is_set():
            self.progress.tick()
            await self._wait_for_slot()
            if self._stopping.is_set():
                return
            try:
                await self.run_once()
                pause = _MIN_PAUSE_S
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
                # Redis restarting or failing over: in-flight handlers go on,
                # and the loop comes back when it answers again.
                self.log.warning("worker.redis_unavailable", error=_describe(exc), retry_in_s=pause)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), pause)
                pause = min(pause * 2, _MAX_PAUSE_S)
            except redis.exceptions.ResponseError as exc:
                if not _is_nogroup(exc):
                    raise
                # Redis lost its data (a restart without persistence, a
                # FLUSHALL): the group is gone with the stream. Make it again;
                # the reconciler brings the lost jobs back.
                self.log.warning("worker.group_recreated", error=_describe(exc))
                self._cursor = "0-0"
                await self.stream.ensure_group()

    async def _wait_for_redis(self) -> None:
        """Make the group, waiting (with backoff) while Redis does not answer:
        a worker started during an outage waits for it like a running one."""
        pause = _MIN_PAUSE_S
        while True:
            try:
                await self.stream.ensure_group()
                return
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
                if self._stopping.is_set():
                    raise
                self.log.warning("worker.redis_unavailable", error=_describe(exc), retry_in_s=pause)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), pause)
                pause = min(pause * 2, _MAX_PAUSE_S)

    def stop(self) -> None:
        self._stopping.set()
        self._slot_free.set()

    async def run_once(self) -> int:
        """Claim idle entries, or else read new ones; start their handlers.
        Returns how many deliveries were started."""
        free = self.config.concurrency - len(self._tasks)
        if free <= 0:
            return 0
        batch = await self._claim_idle(free)
        if not batch:
            block = 0 if self._stopping.is_set() else self.config.block_ms
            entries = await self.stream.read_new(self.consumer, free, block)
            batch = [
                Delivery(entry_id, fields, 1, consumer=self.consumer)
                for entry_id, fields in entries
            ]
            metrics.DELIVERIES.labels(workflow=self.workflow, kind="new").inc(len(batch))
        for delivery in batch:
            self._start(delivery)
        return len(batch)

    async def wait_idle(self) -> None:
        """Wait until every started handler has finished and been acknowledged."""
        while self._tasks:
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        await self._ack.drain()

    # -- claiming -------------------------------------------------------

    async def _claim_idle(self, free: int) -> list[Delivery]:
        """XAUTOCLAIM, keeping the cursor between calls; a full pass ends at
        0-0 and the next one waits for the claim interval."""
        now = time.monotonic()
        if self._cursor == "0-0" and now < self._next_claim:
            return []
        cursor, entries, deleted = await self.stream.claim_idle(
            self.consumer, self.config.claim_idle_ms, self._cursor, free
        )
        self._cursor = cursor
        if cursor == "0-0":
            self._next_claim = now + min(self.config.claim_idle_ms, 1000) / 2000
        if deleted:
            await self._record_lost(deleted)
        if not entries:
            return []
        entries = await self._live(entries)
        counts = await self.stream.delivery_counts(self.consumer, [e for e, _ in entries])
        metrics.DELIVERIES.labels(workflow=self.workflow, kind="reclaimed").inc(len(entries))
        return await self._admit(entries, counts)

    async def _live(self, entries: list[Entry]) -> list[Entry]:
        """The reclaimed entries still current. A job that waited and resumed
        has a newer message; an older one left pending by a worker that died
        before acknowledging it is superseded, and running it would run the
        job twice at once."""
        dropped = await self.stream.drop_superseded(self.consumer, entries)
        for entry_id, fields in entries:
            if entry_id in dropped:
                self.log.info(
                    "job.superseded_entry_dropped", job_id=fields.get("job_id"), entry_id=entry_id
                )
        return [(entry_id, fields) for entry_id, fields in entries if entry_id not in dropped]

    async def _admit(self, entries: list[Entry], counts: dict[str, int]) -> list[Delivery]:
        batch = []
        for entry_id, fields in entries:
            delivery = Delivery(entry_id, fields, counts.get(entry_id, 2), consumer=self.consumer)
            if delivery.count > self.config.max_deliveries:
                last = fields.get("last_error") or "no handler reported back"
                error = f"delivered {delivery.count - 1} times, never finished; last error: {last}"
                await self._dead_letter(delivery, "max_deliveries", error)
            else:
                batch.append(delivery)
        return batch

    async def _record_lost(self, ids: list[str]) -> None:
        await self.stream.ack_lost(ids)
        self.stats["lost"] += len(ids)
        metrics.DEAD_LETTERS.labels(workflow=self.workflow, reason="trimmed").inc(len(ids))
        for entry_id in ids:
            self.log.error("stream.entry_lost", entry_id=entry_id, reason="trimmed while pending")

    # -- running handlers ------------------------------------------------

    def _start(self, delivery: Delivery) -> None:
        self._deliveries[delivery.entry_id] = delivery
        task = asyncio.create_task(self._handle(delivery))
        self._tasks[delivery.entry_id] = task
        metrics.HANDLERS_IN_FLIGHT.labels(workflow=self.workflow).inc()
        task.add_done_callback(lambda _: self._finished(delivery.entry_id))

    def _finished(self, entry_id: str) -> None:
        self.progress.tick()
        self._tasks.pop(entry_id, None)
        self._deliveries.pop(entry_id, None)
        metrics.HANDLERS_IN_FLIGHT.labels(workflow=self.workflow).dec()
        self._slot_free.set()

    async def _handle(self, delivery: Delivery) -> None:
        started = time.monotonic()
        try:
            await self._process(delivery)
            self._job_seconds.observe(time.monotonic() - started)
        except Exception as exc:
            # Acknowledging, deferring or dead-lettering failed (Redis or the
            # job row unavailable). Committed effects stay committed; the entry
            # stays pending and a later delivery finds them (pre-check) and
            # settles it. Logged, never silent.
            self.log.warning(
                "job.settle_failed",
                job_id=delivery.job_id,
                error=_describe(exc),
                exc_info=not isinstance(exc, redis.exceptions.RedisError | psycopg.Error),
            )

    async def _process(self, delivery: Delivery) -> None:
        try:
            message = JobMessage.from_fields(delivery.fields)
        except (KeyError, ValueError) as exc:
            error = repr(exc)
            await self._settle(delivery, lambda: self._dead_letter(delivery, "malformed", error))
            return
        try:
            outcome = await self._run_handler(message, delivery)
        except Exception as exc:
            failure = exc
            await self._settle(delivery, lambda: self._failed(delivery, failure))
            return
        if await self._settle(delivery, lambda: self._acknowledge(delivery)):
            metrics.JOBS.labels(workflow=self.workflow, outcome=outcome).inc()
            self.log.info(
                "job.acked", job_id=delivery.job_id, count=delivery.count, outcome=outcome
            )

    async def _settle(self, delivery: Delivery, settle: Callable[[], Awaitable[T]]) -> T:
        """Acknowledge, defer or dead-letter ``delivery`` (``settle``). While
        Redis or PostgreSQL does not answer (a restart, a failover), it is
        tried again, its lease renewed meanwhile, and settles as soon as the
        store answers, rather than wait out ``claim_idle_ms`` for another
        worker to reclaim it. Given up (the entry stays pending, as when the
        process dies) once another worker took the lease, or when the
        shutdown's grace cuts it off."""
        pause = _MIN_PAUSE_S
        while True:
            try:
                return await settle()
            except _STORE_AWAY as exc:
                if delivery.lease_lost:
                    raise
                self.stats["settle_retries"] += 1
                self.log.warning(
                    "job.settle_retrying",
                    job_id=delivery.job_id,
                    error=_describe(exc),
                    retry_in_s=pause,
                )
            await asyncio.sleep(pause)
            pause = min(pause * 2, _MAX_PAUSE_S)

    async def _run_handler(self, message: JobMessage, delivery: Delivery) -> str:
        """Two deliveries of one job in this process run one after the other,
        so the second finds the first's result instead of paying a model call."""
        while (running := self._running_jobs.get(message.job_id)) is not None:
            await running.wait()
        done = self._running_jobs[message.job_id] = asyncio.Event()
        try:
            async with asyncio.timeout(self.config.handler_timeout_s) as delivery.bound:
                return await self.handler(message, delivery)
        except TimeoutError as exc:
            if delivery.job_cancelled and await self._really_cancelled(delivery):
                # Its job was cancelled (``renew_leases``): nothing more to do.
                await self._report([delivery], "cancelled", "the job was cancelled")
                return "cancelled"
            raise _HandlerCancelled(
                f"handler still running after {self.config.handler_timeout_s} s: cancelled"
                if not delivery.job_cancelled
                else "stopped for a cancel its job no longer has: redelivered"
            ) from exc
        finally:
            # Past its handler, a delivery's bound is over: nothing reschedules it.
            delivery.bound = None
            del self._running_jobs[message.job_id]
            done.set()

    async def _really_cancelled(self, delivery: Delivery) -> bool:
        """Whether the record (PostgreSQL) says the job is cancelled: Redis
        only announced it, and may remember a cancel a rewind undid."""
        if self.is_cancelled is None:
            return True
        try:
            if await self.is_cancelled(delivery.job_id):
                return True
            # A cancel the record does not have (a rewind undid it): forgotten,
            # so that it stops no other delivery.
            await self.stream.forget_cancel(delivery.job_id)
        except Exception as exc:  # the record unreadable: run it again later
            self.log.warning("job.cancel_unconfirmed", job_id=delivery.job_id, error=_describe(exc))
        return False

    async def _failed(self, delivery: Delivery, exc: Exception) -> None:
        """Transient (including a spent deadline): redelivered after a backoff,
        with a fresh budget. Anything else, unknown errors included, is
        permanent (docs/guarantees.md): dead-letter it now."""
        if not isinstance(exc, PermanentError) and (isinstance(exc, _TRANSIENT) or classify(exc)):
            await self._defer(delivery, exc)
            return
        shown = None
        if not isinstance(exc, PermanentError | TransientError):
            # A bug in the workflow's code, most likely: its type and where,
            # never its message (it may hold the request). The message is in
            # the job's record (`oncely jobs show`).
            shown = type(exc).__name__
            self.log.warning(
                "job.unclassified_error",
                job_id=delivery.job_id,
                error_type=shown,
                frames=frames(exc),
            )
        # A stable reason of its own (``nondeterministic``, ``agent-limit``),
        # else ``permanent``.
        reason = getattr(exc, "dead_reason", None)
        await self._dead_letter(
            delivery, reason if isinstance(reason, str) else "permanent", _describe(exc), shown
        )

    async def _defer(self, delivery: Delivery, exc: BaseException) -> None:
        """Out of the stream until a backoff has passed, counted per job across
        deliveries; past ``job_max_age_s`` the job is dead instead, with the
        error. A failure on a connection (a server restart) comes back within
        a second the first time: the next try likely finds a fresh one. A
        job that could not go on (``ResumeLater``: its models are cooling
        down, or its batch line is not answered yet) failed nothing: it
        comes back when they may answer again, its backoff does not grow,
        and its age never kills it (a batch may take the provider's whole
        day; docs/lanes.md)."""
        if delivery.lease_lost:
            return
        error = _describe(exc)
        failures = int(delivery.fields.get("failures", "0"))
        if not isinstance(exc, ResumeLater):
            failures += 1
        accepted_at = float(delivery.fields.get("accepted_at") or delivery.fields["enqueued_at"])
        age_s = time.time() - accepted_at
        if age_s > self.config.job_max_age_s and not isinstance(exc, ResumeLater):
            await self._dead_letter(delivery, "max_age", f"{age_s:.0f} s old; last error: {error}")
            return
        c = self.config
        if isinstance(exc, ResumeLater):
            delay_s = resume_s(
                exc.resume_in_s, failures + 1, c.redelivery_base_s, c.redelivery_max_s, self.rand
            )
        else:
            delay_s = backoff_s(failures, c.redelivery_base_s, c.redelivery_max_s, self.rand)
        if failures == 1 and isinstance(exc, _CONNECTION_LOST):
            delay_s = min(delay_s, 1.0)
        fields = {
            **delivery.fields,
            "failures": str(failures),
            "delivered": str(delivery.number),
            "accepted_at": f"{accepted_at:.6f}",
            "last_error": error[:_ERROR_CHARS],
        }
        waiting = None
        if isinstance(exc, ResumeLater) and exc.models:
            waiting = Waiting(exc.models, exc.scope)
        if not await self.stream.defer(
            self.consumer, delivery.entry_id, delivery.job_id, delay_s, fields, waiting_on=waiting
        ):
            return  # another worker holds the entry now
        outcome = "cancelled" if isinstance(exc, _HandlerCancelled) else "retry"
        await self._report([delivery], outcome, error)
        self.stats["transient"] += 1
        metrics.JOBS.labels(workflow=self.workflow, outcome="transient").inc()
        self.log.warning(
            "job.deferred",
            job_id=delivery.job_id,
            failures=failures,
            retry_in_s=round(delay_s, 3),
            error=error,
        )

    async def _dead_letter(
        self, delivery: Delivery, reason: str, error: str, shown: str | None = None
    ) -> None:
        """Dead-letter the job with ``error`` in its record; the log has
        ``shown`` instead when given."""
        if delivery.lease_lost:
            return
        # The job row first: a crash between the two leaves a pending entry
        # that is dead-lettered again, never a queued job with no message.
        if self.on_dead is not None and delivery.job_id:
            await self.on_dead(delivery.job_id, f"{reason}: {error}", delivery.generation)
        fields = {
            **delivery.fields,
            "original_id": delivery.entry_id,
            "reason": reason,
            "deliveries": str(delivery.count),
            "last_error": error[:_ERROR_CHARS],
            "dead_at": f"{time.time():.3f}",
        }
        if await self.stream.dead_letter(self.consumer, delivery.entry_id, delivery.job_id, fields):
            self.stats["dead"] += 1
            metrics.DEAD_LETTERS.labels(workflow=self.workflow, reason=reason).inc()
            self.log.error(
                "job.dead_lettered", job_id=delivery.job_id, reason=reason, error=shown or error
            )
            await self._report([delivery], "dead", f"{reason}: {error}")

    async def _report(self, deliveries: list[Delivery], outcome: str, error: str) -> None:
        """Failed deliveries into their jobs' histories, once Redis has settled
        them. A history that cannot be written is logged: it never keeps an
        entry from being settled."""
        reports = [d.report(outcome, error) for d in deliveries if d.job_id and not d.lease_lost]
        if self.on_failed is None or not reports:
            return
        try:
            await self.on_failed(reports)
        except Exception as exc:
            self.log.warning(
                "job.delivery_not_recorded",
                jobs=len(reports),
                outcome=outcome,
                error=_describe(exc),
            )

    # -- acknowledging, batched -------------------------------------------

    async def _acknowledge(self, delivery: Delivery) -> bool:
        if delivery.lease_lost:
            self.log.warning("job.not_acked_lease_lost", job_id=delivery.job_id)
            return False
        acked = await self._ack(delivery)
        self.stats["acked" if acked else "lost"] += 1
        return acked

    async def _ack_batch(self, deliveries: list[Delivery]) -> set[str]:
        """One Lua call for every acknowledgement queued since the last one."""
        return await self.stream.ack(self.consumer, [(d.entry_id, d.job_id) for d in deliveries])

    # -- leases ---------------------------------------------------------------

    async def _every(self, interval_s: float) -> AsyncIterator[None]:
        """Every ``interval_s`` until the worker has drained. The loop ends on
        that even if its cancellation was lost: redis-py can swallow a
        cancellation that arrives while a command is in flight, and shutdown
        must not wait on a loop that never heard it."""
        while not self._halted.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._halted.wait(), interval_s)
            if self._halted.is_set():
                return
            yield

    async def _renew_forever(self) -> None:
        interval = max(self.config.claim_idle_ms / 3000, 0.05)
        async for _ in self._every(interval):
            try:
                await self.renew_leases()
            except redis.exceptions.RedisError as exc:
                # Redis away: nobody can reclaim our entries either. The next
                # round renews them; a lost lease is detected then.
                self.log.warning("worker.renew_failed", error=_describe(exc))

    async def renew_leases(self) -> None:
        """Reset the idle time of our in-flight entries; mark the ones another
        worker took over, whose results this worker must not acknowledge;
        stop the handlers of jobs that were cancelled (their model calls
        with them)."""
        items = [(d.entry_id, d.job_id) for d in self._deliveries.values() if not d.lease_lost]
        if not items:
            return
        renewed, cancelled = await self.stream.renew(self.consumer, items)
        for entry_id, _ in items:
            delivery = self._deliveries.get(entry_id)
            if entry_id not in renewed and delivery is not None:
                delivery.lease_lost = True
                metrics.LEASES_LOST.labels(workflow=self.workflow).inc()
                self.log.warning("worker.lease_lost", job_id=delivery.job_id, entry_id=entry_id)
        for delivery in list(self._deliveries.values()):
            # Heard once: its bound may have expired since (the handler is
            # stopping), and an expired bound cannot be moved again.
            heard = delivery.job_cancelled
            if delivery.job_id in cancelled and delivery.bound is not None and not heard:
                delivery.job_cancelled = True
                delivery.bound.reschedule(asyncio.get_running_loop().time())
                self.log.info("job.cancel_heard", job_id=delivery.job_id)

    # -- redelivery ----------------------------------------------------------------

    async def _promote_forever(self) -> None:
        """Put jobs whose backoff has passed back into the stream, and let
        out those waiting for a model's cooldown that may go on. Every
        worker does it; the Lua calls are atomic, so a job moves once."""
        async for _ in self._every(self.config.promote_every_s):
            try:
                await self.redeliver()
            except redis.exceptions.RedisError as exc:
                self.log.warning("worker.redeliver_failed", error=_describe(exc))

    async def redeliver(self) -> None:
        """One round: the due jobs back into the stream, and the jobs
        waiting for a model's cooldown that may go on with them."""
        _, waited_for = await self.stream.promote()
        if waited_for and await self._release(waited_for):
            await self.stream.promote()

    async def _release(self, models: list[str]) -> int:
        """The jobs waiting for these models' cooldowns let out: all of a
        scope that no longer cools, one per scope whose probe may go
        (docs/model-routing.md, "The cooldown"). How many."""
        released = 0
        for model in models:
            cooling = await self.cooling(model) if self.cooling is not None else {}
            count = await self.stream.release_waiting(
                model, cooling, spread_s=_RELEASE_SPREAD_S, probe_gap_s=_PROBE_GAP_S
            )
            if count:
                self.log.info("job.released", model=model, jobs=count, cooling=bool(cooling))
            released += count
        return released

    # -- trimming and shutdown --------------------------------------------------

    async def _trim_forever(self) -> None:
        async for _ in self._every(self.config.trim_every_s):
            try:
                await self.stream.trim()
                await self.stream.forget_consumers(idle_ms=_FORGET_CONSUMER_AFTER_MS)
            except redis.exceptions.RedisError as exc:
                self.log.warning("worker.trim_failed", error=_describe(exc))

    async def _wait_for_slot(self) -> None:
        """Wait for a free slot, then read at once: the read takes every
        slot free by the time it goes, so bursts still read in batches, and
        no slot idles waiting for others. Waiting for a sixteenth of the
        slots instead saved no measurable CPU per job (bench/README.md,
        Worker)."""
        while len(self._tasks) >= self.config.concurrency and not self._stopping.is_set():
            self._slot_free.clear()
            await self._slot_free.wait()

    async def _drain(self) -> None:
        """Let in-flight handlers finish within the grace period; the rest stay
        pending for other workers."""
        if not self._tasks:
            return
        self.log.info("worker.draining", in_flight=len(self._tasks))
        grace_s = self.config.shutdown_grace_s
        _, late = await asyncio.wait(list(self._tasks.values()), timeout=grace_s)
        # Handlers still running (not merely settling): their deliveries end here.
        cut = [
            d
            for entry_id, d in self._deliveries.items()
            if self._tasks.get(entry_id) in late and d.job_id in self._running_jobs
        ]
        for task in late:
            task.cancel()
        if late:
            # Bounded: a handler whose cancellation was lost (``_every``) ends
            # on its own deadline, not the shutdown's; its entry stays pending.
            _, deaf = await asyncio.wait(late, timeout=_CANCELLED_WAIT_S)
            if deaf:
                self.log.warning("worker.handlers_ignored_cancellation", count=len(deaf))
            self.log.warning("worker.left_pending_on_shutdown", count=len(late))
            await self._report(cut, "cancelled", f"worker stopped after a {grace_s:g} s grace")


def _is_nogroup(exc: redis.exceptions.ResponseError) -> bool:
    """The stream or its group is gone: NOGROUP, or (Redis 7.0) a blocked
    XREADGROUP woken with UNBLOCKED when its key was deleted."""
    return str(exc).startswith(("NOGROUP", "UNBLOCKED"))


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]
