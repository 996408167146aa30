"""The outbox relay: lease due rows, send each, record what happened.

Delivery is at-least-once and the effect exactly-once: the row is marked sent
only after the provider accepted it, and every resend (after a crash, a lost
lease or a timeout) carries the same dedupe key, which the provider dedupes
on. The residual window is a relay dying between the provider's answer and
the ``sent_at`` commit: the row is sent again once its lease expires, and only
the provider's idempotency makes that one effect.

A claim is a short lease (``RelayConfig.lease_s``) that the live relay
renews in steps while it holds the row (``renew_leases``), so a relay that
dies has its rows claimed by another within a lease and a poll, and a live
relay's slow send is never taken over; its own view of each lease ends no
later than the database's and cuts the send off then (docs/architecture.md,
Effects, says why this and not a heartbeat per relay).

Sends run outside any transaction. A relay wakes on ``NOTIFY oncely_outbox``
(sent by the transaction that wrote the row) and polls as a fallback, so a
missed notification costs at most one poll interval.

A *call that answers* (a row with a ``call_key``, docs/agents.md) is sent the
same way; its answer is written with the row's ``sent_at``, as the value of
the job's waiting checkpoint, in one statement, and the job resumed. One
that will never be answered (refused, an invalid answer, its attempts spent)
ends its wait with a ``CallFailed``; so does an answer too large to read
or that PostgreSQL cannot store: a 2xx is never sent again.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any
from uuid import UUID, uuid4

import psycopg
import structlog

from oncely import metrics, tracing
from oncely.batching import GroupCommit
from oncely.errors import CallFailed, PermanentError, TransientError
from oncely.journal import failure_value
from oncely.outbox.store import ClaimedRow, OutboxStore
from oncely.retry import backoff_s, classify, retry_after_s
from oncely.senders.base import Sender, SendResult
from oncely.services import Progress, supervised
from oncely.sql import query
from oncely.sql.connect import CountedConnection

log = structlog.get_logger("oncely.relay")

# Queues jobs whose call ended (their ids) at once; the workers' timers do
# it within a second otherwise.
Resume = Callable[[list[str]], Awaitable[object]]

# Bound once: a labels() lookup per row shows up in profiles.
_SENDS_SENT = metrics.OUTBOX_SENDS.labels(outcome="sent")
_SENDS_RETRY = metrics.OUTBOX_SENDS.labels(outcome="retry")
_SENDS_FAILED = metrics.OUTBOX_SENDS.labels(outcome="failed")
_SENDS_LEASE_LOST = metrics.OUTBOX_SENDS.labels(outcome="lease_lost")

# Shown in pg_stat_activity, so an operator (or a test) can find the listener.
LISTENER_APPLICATION_NAME = "oncely-relay-listener"

# A connection that died without a FIN (a NAT or a failover dropping it) never
# raises while we only wait for notifications; a ping this often finds it.
_LISTENER_PING_S = 30.0
_CONNECT_TIMEOUT_S = 10


@dataclass(frozen=True)
class RelayConfig:
    """How one relay process claims, sends and backs off.

    ``lease_s`` is how long a claim lasts unless renewed: the relay renews
    the rows it holds (waiting for a send slot, sending, recording) every
    third of it, so a relay that dies leaves its rows for at most
    ``lease_s`` (then the next claim, within ``poll_s``, takes them), and
    a renewal has half a lease to land. A send is renewed for at most
    ``send_timeout_s`` (the senders' own timeout, ``ONCELY_SENDER_TIMEOUT_S``):
    one that hangs past it keeps its row one lease more, then is cut off.
    """

    max_attempts: int = 10
    lease_s: float = 3.0
    send_timeout_s: float = 10.0
    batch: int = 100
    concurrency: int = 64
    poll_s: float = 1.0
    retention_s: float = 7 * 86400.0
    backoff_base_s: float = 1.0
    backoff_max_s: float = 300.0
    # A provider's Retry-After wins over our backoff; this only bounds a bogus one.
    retry_after_max_s: float = 3600.0
    cleanup_every_s: float = 60.0
    cleanup_batch: int = 1000
    listen_retry_s: float = 1.0


@dataclass
class _Hold:
    """One claimed row's lease as this relay sees it, on the event loop's
    monotonic clock: it ends ``lease_s`` after the start of the last
    statement that set ``locked_until`` (the claim, then each renewal), so
    never after the database's. While the row's send runs, ``window``
    cuts it off a sixth of a lease before the lease ends (``cutoff``), so
    its failure is recorded, with its backoff, while the row is still
    this claim's rather than racing the next claim; a renewal moves both."""

    claimed: float
    ends: float
    margin: float
    send_started: float | None = None
    window: asyncio.Timeout | None = None

    @classmethod
    def claimed_at(cls, started: float, lease_s: float) -> _Hold:
        return cls(started, started + lease_s, lease_s / 6)

    @property
    def cutoff(self) -> float:
        return self.ends - self.margin

    def elapsed(self) -> float:
        return _now() - self.claimed

    def remaining(self) -> float:
        return self.ends - _now()

    def extend(self, ends: float) -> None:
        """A renewal that started at ``ends - lease_s`` landed."""
        if ends > self.ends and self.remaining() > 0:
            self.ends = ends
            if self.window is not None and not self.window.expired():
                self.window.reschedule(self.cutoff)

    def lose(self) -> None:
        """The row is no longer this relay's: a send under way stops now."""
        self.ends = min(self.ends, _now())
        self.margin = 0.0
        if self.window is not None and not self.window.expired():
            self.window.reschedule(self.ends)


def _now() -> float:
    return asyncio.get_running_loop().time()


class Relay:
    """One relay process's loop. Any number run side by side on one database."""

    def __init__(
        self,
        store: OutboxStore,
        sender: Sender,
        config: RelayConfig,
        *,
        database_url: str | None = None,
        owner: UUID | None = None,
        rand: Callable[[], float] = random.random,
        resume: Resume | None = None,
        workflow_of: Mapping[str, str] | None = None,
    ) -> None:
        self.store = store
        self.sender = sender
        self.config = config
        # Without a database URL there is no LISTEN: the relay only polls.
        self.database_url = database_url
        # Fences every write after the claim; fresh per relay, never reused.
        self.owner = owner or uuid4()
        self.rand = rand
        self._resume = resume
        # Each call topic's workflow, for the calls' metric.
        self._workflow_of = dict(workflow_of or {})
        # Set while the listener's LISTEN is in place (tests wait for it).
        self.listening = asyncio.Event()
        # Ticks whenever the loop goes round or a send ends (``/healthz``).
        self.progress = Progress()
        self.stats: dict[str, int] = {
            "sent": 0,
            "failed": 0,
            "retried": 0,
            "lease_lost": 0,
            "renewals": 0,
            "woken_by_notify": 0,
            "polls": 0,
            "listens": 0,
        }
        self._slots = asyncio.Semaphore(config.concurrency)
        # Every row claimed and not yet recorded, renewed by ``renew_leases``.
        self._held: dict[int, _Hold] = {}
        self._sending = 0  # rows claimed whose send has not ended (or begun)
        self._stopping = asyncio.Event()
        self._wake = asyncio.Event()
        self._woken_by = ""
        self._slot_freed = asyncio.Event()
        # Sends finishing together are recorded in one claim-checked UPDATE.
        self._mark_sent: GroupCommit[tuple[ClaimedRow, str | None], tuple[int, int]] = GroupCommit(
            self._mark_sent_batch, key=lambda send: (send[0].id, send[0].attempts)
        )

    # -- the loop ---------------------------------------------------------

    async def run(self) -> None:
        """Relay until ``stop()``; the batch in flight then finishes before this
        returns. Lease renewal, the listener and retention run in the same
        task group: one that dies takes the relay down, logged
        (``oncely.services``)."""
        log.info("relay.started", owner=str(self.owner), batch=self.config.batch)
        side: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            ("outbox-renew", self._renew_forever),
            ("outbox-retention", self._clean_up_forever),
        ]
        if self.database_url is not None:
            url = self.database_url
            side.append(("outbox-listen", lambda: self._listen_forever(url)))
        try:
            async with asyncio.TaskGroup() as group:
                background = [group.create_task(supervised(n, loop, log)) for n, loop in side]
                await self._relay_continuously()
                for task in background:
                    task.cancel()
        finally:
            self.listening.clear()
            log.info("relay.stopped", owner=str(self.owner), **self.stats)

    def stop(self) -> None:
        self._stopping.set()
        self._slot_freed.set()
        self._wake_up("stop")

    async def _relay_continuously(self) -> None:
        """Claim rows as send slots free up, a quarter of them at a time, so a
        slow provider never leaves the relay idle between batches. Up to
        ``concurrency`` claimed rows wait for a slot, so a slot that frees
        finds its next row already claimed (within a lease's reach: at most
        one send ahead of it, as ``RelayConfig`` says). A slot frees when its
        send ends; recording the outcome (one batched commit for many sends)
        goes on outside it, up to ``concurrency`` rows more."""
        in_flight: set[asyncio.Task[None]] = set()
        wanted = max(1, self.config.concurrency // 4)

        def finished(task: asyncio.Task[None]) -> None:
            in_flight.discard(task)
            self._slot_freed.set()
            self.progress.tick()

        while not self._stopping.is_set():
            self.progress.tick()
            free = min(
                2 * self.config.concurrency - self._sending,
                3 * self.config.concurrency - len(in_flight),
            )
            if free < wanted:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            started = _now()
            rows = await self._claim(min(self.config.batch, free))
            if not rows:
                await self._wait_for_work()
                continue
            for row in rows:
                task = self._start(row, started)
                in_flight.add(task)
                task.add_done_callback(finished)
        if in_flight:
            await asyncio.wait(in_flight)

    async def _claim(self, limit: int) -> list[ClaimedRow]:
        try:
            return await self.store.claim(self.owner, limit, self.config.lease_s)
        except psycopg.Error as exc:  # PoolTimeout included
            # The database is away; the rows wait, and the next pass retries.
            log.error("outbox.relay_error", error=_describe(exc))
            return []

    async def run_once(self) -> int:
        """Claim one batch and send it, ``concurrency`` at a time, renewing
        the leases meanwhile; how many rows were claimed."""
        started = _now()
        rows = await self.store.claim(self.owner, self.config.batch, self.config.lease_s)
        if rows:
            renewing = asyncio.create_task(self._renew_forever())
            try:
                async with asyncio.TaskGroup() as sends:
                    for row in rows:
                        self._start(row, started, sends.create_task)
            finally:
                renewing.cancel()
                await asyncio.wait([renewing])
        return len(rows)

    async def _wait_for_work(self) -> None:
        """Until a NOTIFY, a listener (re)connect or ``stop()``; at most one poll interval."""
        try:
            async with asyncio.timeout(self.config.poll_s):
                await self._wake.wait()
        except TimeoutError:
            self.stats["polls"] += 1
        else:
            if self._woken_by == "notify":
                self.stats["woken_by_notify"] += 1
        self._wake.clear()

    def _wake_up(self, reason: str) -> None:
        self._woken_by = reason
        self._wake.set()

    # -- one row -------------------------------------------------------------

    def _start(
        self,
        row: ClaimedRow,
        claimed: float,
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]] = asyncio.create_task,
    ) -> asyncio.Task[None]:
        """The row's send and record, as a task; it holds a send slot until
        its send ends, and its lease is renewed until it is recorded.
        ``claimed``: when the claim statement started (loop time)."""
        self._sending += 1
        hold = _Hold.claimed_at(claimed, self.config.lease_s)
        self._held[row.id] = hold
        return spawn(self._relay(row, hold))

    async def _relay(self, row: ClaimedRow, hold: _Hold) -> None:
        try:
            async with self._slots:
                try:
                    outcome = await self._send(row, hold)
                finally:
                    self._sending -= 1
                    self._slot_freed.set()
            if isinstance(outcome, SendResult) and row.call_key is not None:
                await self._answered(row, outcome, hold)
            elif isinstance(outcome, SendResult):
                await self._sent(row, outcome, hold)
            elif outcome is not None:
                await self._failed(row, outcome)
        except psycopg.Error as exc:
            # The outcome was not recorded: the lease runs out and the row
            # is sent again under the same dedupe key, one effect.
            log.error("outbox.record_failed", outbox_id=row.id, error=_describe(exc))
        finally:
            if self._held.get(row.id) is hold:
                del self._held[row.id]

    async def _send(self, row: ClaimedRow, hold: _Hold) -> SendResult | Exception | None:
        """The provider's answer, or the failure to record; None: not sent,
        and nothing to record (the lease may be another relay's by now)."""
        if row.attempts > self.config.max_attempts:
            # Only expired leases get a row here (a failed send gives up at
            # max_attempts): relays kept dying or stalling on it. Stop rather
            # than let one row take relays down forever.
            return PermanentError(f"lease ran out mid-send {row.attempts - 1} times")
        if hold.cutoff <= _now():
            # Its renewals failed while it waited for a slot, or another
            # relay took it: that relay may be sending it by now.
            self._lease_lost(row, "lease ended before the send")
            return None
        # A send outliving the lease races another relay's resend of the row;
        # each renewal moves the window with the lease.
        window = asyncio.timeout_at(hold.cutoff)
        hold.send_started = _now()
        try:
            async with window:
                hold.window = window
                with tracing.span(
                    f"oncely.send {row.topic}",
                    parent=row.trace_context,
                    kind="client",
                    attributes={"oncely.outbox_id": row.id, "oncely.attempt": row.attempts},
                ):
                    return await self.sender.send(row.topic, row.payload, row.dedupe_key)
        except Exception as exc:
            if not window.expired():
                return exc
            ran_s = round(_now() - hold.send_started, 3)
            return TransientError(f"send cut off after {ran_s} s, at the end of its lease")
        finally:
            hold.window = None
            hold.send_started = None

    async def _sent(self, row: ClaimedRow, result: SendResult, hold: _Hold) -> None:
        if not await self._mark_sent((row, result.provider_message_id)):
            self._lease_lost(row, "sent, but another relay holds the row")
            return
        lag_s = row.age_s + hold.elapsed()
        self.stats["sent"] += 1
        _SENDS_SENT.inc()
        metrics.OUTBOX_LAG.observe(lag_s)
        log.info(
            "outbox.sent",
            outbox_id=row.id,
            topic=row.topic,
            attempts=row.attempts,
            lag_s=round(lag_s, 3),
        )

    async def _answered(self, row: ClaimedRow, result: SendResult, hold: _Hold) -> None:
        """A call's answer: stored with the row, its job resumed."""
        try:
            held, woken = await self.store.mark_answered(
                row, self.owner, result.provider_message_id, result.answer
            )
        except psycopg.DataError as exc:
            await self._unstorable(row, exc)
            return
        if not held:
            self._lease_lost(row, "answered, but another relay holds the row")
            return
        self.stats["sent"] += 1
        _SENDS_SENT.inc()
        self._count_call(row, "answered")
        log.info(
            "call.answered",
            outbox_id=row.id,
            topic=row.topic,
            attempts=row.attempts,
            lag_s=round(row.age_s + hold.elapsed(), 3),
        )
        await self._wake_job(woken)

    async def _unstorable(self, row: ClaimedRow, exc: psycopg.DataError) -> None:
        """An answer jsonb refused though its parse let it through: the
        receiver answered, so a resend would only bring it back. The call
        fails now; the database's message quotes the answer, so only its
        SQLSTATE is kept."""
        failed = CallFailed(
            f"{row.topic}: the receiver's answer cannot be stored (SQLSTATE {exc.sqlstate})",
            reason="invalid_answer",
        )
        await self._call_failed(row, failed, _describe(failed))

    async def _call_failed(self, row: ClaimedRow, exc: Exception, error: str) -> None:
        """A call that will never be answered: its wait ends with a CallFailed."""
        failed = _call_failure(row, exc)
        held, woken = await self.store.call_failed(row, self.owner, error, failure_value(failed))
        if not held:
            self._lease_lost(row, "call failed, and another relay holds the row")
            return
        self._gave_up(row, error)
        self._count_call(row, failed.reason)
        await self._wake_job(woken)

    async def _wake_job(self, job_id: str | None) -> None:
        """Queue the job whose call ended now; the workers' timers would
        within a second anyway, so a failure here is only logged."""
        if job_id is None or self._resume is None:
            return
        try:
            await self._resume([job_id])
        except Exception as exc:
            log.warning("call.resume_deferred", job_id=job_id, error=_describe(exc))

    def _count_call(self, row: ClaimedRow, outcome: str) -> None:
        workflow = self._workflow_of.get(row.topic, "")
        metrics.CALLS.labels(workflow=workflow, topic=row.topic, outcome=outcome).inc()

    async def _mark_sent_batch(
        self, sends: list[tuple[ClaimedRow, str | None]]
    ) -> set[tuple[int, int]]:
        return await self.store.mark_sent_many(self.owner, sends)

    async def _failed(self, row: ClaimedRow, exc: Exception) -> None:
        """Unclassified errors are permanent, as in the worker (docs/guarantees.md)."""
        error = _describe(exc)
        give_up = not classify(exc) or row.attempts >= self.config.max_attempts
        if give_up and row.call_key is not None:
            await self._call_failed(row, exc, error)
            return
        delay_s = 0.0 if give_up else self._retry_delay_s(row.attempts, exc)
        recorded = await self.store.mark_failed_attempt(
            row, self.owner, error, next_attempt_at_delay_s=delay_s, give_up=give_up
        )
        if not recorded:
            self._lease_lost(row, "send failed, and another relay holds the row")
        elif give_up:
            self._gave_up(row, error)
        else:
            self.stats["retried"] += 1
            _SENDS_RETRY.inc()
            log.warning(
                "outbox.send_failed",
                outbox_id=row.id,
                topic=row.topic,
                attempts=row.attempts,
                retry_in_s=round(delay_s, 3),
                error=error,
            )

    def _retry_delay_s(self, attempts: int, exc: Exception) -> float:
        hinted = retry_after_s(exc)
        if hinted is not None:
            return min(hinted, self.config.retry_after_max_s)
        return backoff_s(attempts, self.config.backoff_base_s, self.config.backoff_max_s, self.rand)

    def _gave_up(self, row: ClaimedRow, error: str) -> None:
        self.stats["failed"] += 1
        _SENDS_FAILED.inc()
        log.error(
            "outbox.gave_up", outbox_id=row.id, topic=row.topic, attempts=row.attempts, error=error
        )

    def _lease_lost(self, row: ClaimedRow, reason: str) -> None:
        self.stats["lease_lost"] += 1
        _SENDS_LEASE_LOST.inc()
        log.warning("outbox.lease_lost", outbox_id=row.id, topic=row.topic, reason=reason)

    # -- leases ------------------------------------------------------------------

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.lease_s / 3)
            await self.renew_leases()

    async def renew_leases(self) -> int:
        """Lease again, from now, every row this relay has held for a sixth
        of a lease or more (a quick send never costs a renewal), except a
        send running past ``send_timeout_s``; a row the renewal finds gone
        (another relay's now, or its lease ended) is lost, and its send
        stops. How many rows were renewed."""
        now = _now()
        renewing = [
            (row_id, hold) for row_id, hold in self._held.items() if self._renewable(hold, now)
        ]
        if not renewing:
            return 0
        lease_s = self.config.lease_s
        self.stats["renewals"] += 1
        try:
            renewed = await self.store.renew(
                self.owner, [row_id for row_id, _ in renewing], lease_s, timeout_s=lease_s
            )
        except psycopg.Error as exc:  # StatementTimeout and PoolTimeout included
            # The leases run on as they were: a send whose lease ends is cut off.
            log.warning("outbox.renew_failed", rows=len(renewing), error=_describe(exc))
            return 0
        for row_id, hold in renewing:
            if row_id in renewed:
                hold.extend(now + lease_s)
            elif self._held.get(row_id) is hold and hold.remaining() > 0:
                # Another relay's now, or sent and about to be recorded: the
                # record (claim-checked) tells which.
                log.info("outbox.renewal_refused", outbox_id=row_id)
                hold.lose()
        return len(renewed)

    def _renewable(self, hold: _Hold, now: float) -> bool:
        held_s = self.config.lease_s - (hold.ends - now)
        if hold.ends <= now or held_s < self.config.lease_s / 6:
            return False
        started = hold.send_started
        return started is None or now - started < self.config.send_timeout_s

    # -- wake-ups ---------------------------------------------------------------

    async def _listen_forever(self, database_url: str) -> None:
        while True:
            try:
                await self._listen(database_url)
            except (psycopg.Error, OSError) as exc:  # TimeoutError is an OSError
                self.listening.clear()
                log.warning(
                    "outbox.listener_lost",
                    error=_describe(exc),
                    retry_in_s=self.config.listen_retry_s,
                )
            await asyncio.sleep(self.config.listen_retry_s)

    async def _listen(self, database_url: str) -> None:
        """LISTEN on a dedicated autocommit connection and wake the loop per NOTIFY."""
        async with await CountedConnection.connect(
            database_url,
            autocommit=True,
            application_name=LISTENER_APPLICATION_NAME,
            connect_timeout=_CONNECT_TIMEOUT_S,
        ) as conn:
            await conn.execute(query("outbox_listen"))
            self.listening.set()
            self.stats["listens"] += 1
            # A NOTIFY sent while nobody listened is gone: one pass covers it.
            self._wake_up("listen")
            while True:
                async for _ in conn.notifies(timeout=_LISTENER_PING_S):
                    self._wake_up("notify")
                async with asyncio.timeout(_LISTENER_PING_S):
                    await conn.execute(query("outbox_listener_ping"))

    # -- retention ---------------------------------------------------------------

    async def _clean_up_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.cleanup_every_s)
            try:
                await self.clean_up()
            except psycopg.Error as exc:
                log.warning("outbox.cleanup_failed", error=_describe(exc))

    async def clean_up(self) -> int:
        """Delete rows sent longer than ``retention_s`` ago; how many went."""
        deleted = await self.store.delete_sent_before(
            self.config.retention_s, self.config.cleanup_batch
        )
        if deleted:
            log.info("outbox.cleaned_up", deleted=deleted)
        return deleted


def _call_failure(row: ClaimedRow, exc: Exception) -> CallFailed:
    """Why a call ended without an answer, as the step gets it."""
    if isinstance(exc, CallFailed):
        return exc
    status = getattr(exc, "status", None)
    if classify(exc):
        message = f"{row.topic}: no answer after {row.attempts} attempts ({_describe(exc)})"
        return CallFailed(message, status=status, reason="attempts")
    if isinstance(status, int) and 400 <= status < 500:
        return CallFailed(
            f"{row.topic}: the receiver refused it ({status})", status=status, reason="refused"
        )
    return CallFailed(
        f"{row.topic}: could not be sent ({_describe(exc)})", status=status, reason="undeliverable"
    )


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]
