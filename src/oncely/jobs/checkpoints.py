"""The ``checkpoints`` and ``job_events`` tables, and a job's waiting state.

Only this module runs SQL on those two tables (``sql/checkpoints.sql``).
A run's last checkpoints are not rows: they ride in the result's own
statement (``Jobs.finish``, ``finish_job``) and are kept in the result's
row (``results.steps``), so that a step with one model call writes no
statement more than the result. The job's waiting state
(``waiting``, ``cancelled``, ``wait_until``, ``waiting_for``,
``resumed_at``, ``generation``) moves here too, with the checkpoints that
decide it.

Every way a waiting job resumes (an event, its time, an operator's rewind)
sets its row back to ``queued`` first and then enqueues it through
``Jobs.restore``: a crash between the two leaves a queued row without a
message, which the reconciler restores (counting its age from
``resumed_at``), as for the intake.

Writes for a running job lock its row and check it still runs in the
delivery's generation, in the same statement or transaction: nothing is
written for a job that is done, dead or cancelled, nor by a delivery of an
earlier run. A wait and an event race on the same row: each takes the lock
first in its own transaction, so the second sees the first's rows.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Literal

import psycopg
import structlog
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool
from redis.exceptions import RedisError

from oncely import metrics, tracing
from oncely.batching import GroupRead, each_at_fault
from oncely.errors import NotInApp
from oncely.jobs.children import Children
from oncely.jobs.records import DeliveryReport, JobSpec
from oncely.jobs.rows import (
    checkpoint_rows,
    delivery_params,
    effect_rows,
    raced,
    writes_params,
)
from oncely.jobs.store import Jobs
from oncely.jobs.transitions import Ended
from oncely.journal import Checkpoint, RunStopped, Wait, Writes
from oncely.redis_client import call_together
from oncely.sql import query
from oncely.sql.bounded import StatementResult, run_statement, run_transaction
from oncely.statuses import CANCELLABLE, FINISHED

log = structlog.get_logger("oncely.checkpoints")

# A batch's errors that are one run's own fault (a key another delivery
# took, a value PostgreSQL refuses): that run alone gets them.
_RUN_FAULTS = (psycopg.errors.UniqueViolation, psycopg.errors.DataError)


@dataclass(frozen=True)
class JobRun:
    """What a delivery of a job resumes from."""

    job_id: str
    # queued (running), waiting, done, dead, cancelled, withdrawn.
    status: str
    generation: int
    checkpoints: tuple[Checkpoint, ...]
    # The parent job, for a map's child.
    parent: str | None = None


@dataclass(frozen=True, eq=False)
class _RunWrite:
    """One run's checkpoints and effects to write (``Checkpoints.write``),
    in a batch of them."""

    job_id: str
    generation: int
    workflow: str
    trace_context: str | None
    checkpoints: list[dict[str, Any]]
    effects: list[dict[str, Any]]


def _batch(runs: Sequence[_RunWrite]) -> list[dict[str, Any]]:
    """``write_checkpoints``' one parameter: each run, ``n`` its place."""
    return [
        {
            "n": n,
            "job_id": r.job_id,
            "generation": r.generation,
            "workflow": r.workflow,
            "trace_context": r.trace_context,
            "checkpoints": r.checkpoints,
            "effects": r.effects,
        }
        for n, r in enumerate(runs)
    ]


@dataclass(frozen=True)
class EventOutcome:
    """What sending an event came to.

    - ``received``: stored (``resumed``: the job waited for it, and was queued);
    - ``duplicate``: the same event was already stored;
    - ``conflict``: another event of that name was stored before;
    - ``finished``: the job is done, dead or cancelled (``status``);
    - ``missing``: no such job for this tenant and workflow.
    """

    outcome: Literal["received", "duplicate", "conflict", "finished", "missing"]
    status: str | None = None
    resumed: JobSpec | None = None


@dataclass(frozen=True)
class Cancelled:
    """What cancelling found: the job's ``status`` before (``queued`` and
    ``waiting`` ones are cancelled now), and its workflow."""

    status: str
    kind: str

    @property
    def finished(self) -> bool:
        """Done or dead: it ran to its end, and was not cancelled."""
        return self.status in ("done", "dead")


@dataclass(frozen=True)
class Rewound:
    """What a rewind did: ``status`` the job had; ``deleted`` the keys of the
    checkpoints deleted (empty: nothing changed); the job, queued again."""

    status: str
    deleted: tuple[str, ...] = ()
    job: JobSpec | None = None


class Checkpoints:
    def __init__(self, jobs: Jobs) -> None:
        self.jobs = jobs
        self.pool: AsyncConnectionPool = jobs.pool
        # The children of maps: started with their parent's wait.
        self.children = Children(jobs)
        # Loads asked while one query runs share the next one.
        self._runs: GroupRead[str, str, JobRun] = GroupRead(self._load_runs, key=str)
        # Checkpoint writes asked while one statement runs share the next one.
        self._writes: GroupRead[_RunWrite, int, bool | Exception] = GroupRead(
            self._write_runs, key=id
        )

    async def _run(self, name: str, params: Any = None) -> StatementResult:
        return await run_statement(
            self.pool, query(name), params, timeout_s=self.jobs.statement_timeout_s
        )

    # -- a delivery's run ------------------------------------------------------

    async def run_of(self, job_id: str) -> JobRun | None:
        """The job's status, generation and checkpoints (None: no such job)."""
        return await self._runs.read(job_id)

    async def _load_runs(self, job_ids: list[str]) -> dict[str, JobRun]:
        rows = (await self._run("job_runs", (job_ids,))).rows
        found: dict[str, tuple[str, int, str | None, list[Checkpoint]]] = {}
        for job_id, status, generation, parent, *checkpoint in rows:
            parent_id = None if parent is None else str(parent)
            entry = found.setdefault(str(job_id), (status, generation, parent_id, []))
            if checkpoint[0] is not None:
                entry[3].append(_checkpoint(checkpoint))
        return {
            job_id: JobRun(
                job_id, status, generation, tuple(sorted(c, key=attrgetter("ordinal"))), parent
            )
            for job_id, (status, generation, parent, c) in found.items()
        }

    async def write(self, workflow: str, job_id: str, generation: int, writes: Writes) -> None:
        """Store a run's checkpoints and the effects emitted before them, in
        one statement with the writes of other runs asked meanwhile
        (``GroupRead``: a lone write waits for nothing). ``Replay`` when a
        key or ordinal is taken; ``RunStopped`` when the job no longer runs
        in this generation."""
        row = _RunWrite(
            job_id,
            generation,
            workflow,
            tracing.traceparent(),
            checkpoint_rows(writes),
            effect_rows(writes),
        )
        outcome = await self._writes.read(row)
        if isinstance(outcome, psycopg.errors.UniqueViolation):
            raise raced(outcome) from outcome
        if isinstance(outcome, Exception):
            raise outcome
        if not outcome:
            raise RunStopped(job_id)

    async def _write_runs(self, runs: list[_RunWrite]) -> dict[int, bool | Exception]:
        """Each run's outcome by ``id``: written, not running (False), or
        the error to raise. A key taken, or a value refused, fails the
        statement for all: only the run at fault gets the error (a run
        that lost its race replays)."""
        return await each_at_fault(self._write_batch, runs, _RUN_FAULTS)

    async def _write_batch(self, runs: list[_RunWrite]) -> dict[int, bool]:
        rows = (await self._run("write_checkpoints", {"writes": Jsonb(_batch(runs))})).rows
        written = {n for (n,) in rows}
        return {id(run): n in written for n, run in enumerate(runs)}

    async def start_wait(
        self,
        workflow: str,
        job_id: str,
        generation: int,
        writes: Writes,
        wait: Wait,
        delivery: DeliveryReport | None = None,
    ) -> Checkpoint | None:
        """Store ``writes`` and the wait in one statement (a map's: one
        transaction, its children started in it): the wait's
        checkpoint, done, if its event had arrived; None when the job now
        waits. ``RunStopped``/``Replay`` as ``write``."""
        params = _wait_params(workflow, job_id, generation, writes, wait, delivery)
        # A map's children queued by this wait, and whether a run before had
        # started them.
        released: list[JobSpec] = []
        started_before = False
        try:
            if wait.children is not None:
                row, released, started_before = await self._start_map_wait(
                    workflow, job_id, wait, params
                )
            else:
                rows = (await self._run("start_wait", params)).rows
                row = rows[0] if rows else None
        except psycopg.errors.UniqueViolation as exc:
            raise raced(exc) from exc
        if row is None:
            raise RunStopped(job_id)
        status, value = row
        if status == "waiting":
            # A map's first children go now; one a run before started may
            # have ended meanwhile, every child of it (oncely.jobs.children).
            await self.children.enqueue(released)
            if started_before:
                await self.children.recount(job_id, wait.key)
            return None
        return Checkpoint(wait.key, wait.ordinal, wait.kind, "done", json.loads(value))

    async def _start_map_wait(
        self, workflow: str, job_id: str, wait: Wait, params: dict[str, Any]
    ) -> tuple[tuple[Any, ...] | None, list[JobSpec], bool]:
        """A map's wait: in one transaction, the job's row locked, its
        children started, then the wait. The wait's row (None: the job no
        longer runs), the children to enqueue once it is stored, and whether
        a run before had started them."""
        assert wait.children is not None
        children = wait.children

        async def work(
            conn: psycopg.AsyncConnection[Any],
        ) -> tuple[tuple[Any, ...] | None, list[JobSpec], bool]:
            cur = await conn.execute(query("lock_running_job"), params)
            if (running := await cur.fetchone()) is None:
                return None, [], False
            parent = JobSpec(job_id, running[1], workflow, {})
            released, before = await self.children.start(conn, parent, wait.key, children)
            cur = await conn.execute(query("start_wait"), params)
            return await cur.fetchone(), released, before

        return await run_transaction(self.pool, work, timeout_s=self.jobs.statement_timeout_s)

    async def flag_diverged(self, job_id: str, keys: Sequence[str]) -> None:
        """Flag the model turns a replay asked with another request (GET's
        ``steps[].diverged``). A view only: a failure is logged, not raised."""
        try:
            await self._run("flag_diverged", {"job_id": job_id, "keys": list(keys)})
        except (psycopg.Error, TimeoutError) as exc:
            log.warning("checkpoints.divergence_not_flagged", job_id=job_id, error=repr(exc))

    # -- events, timers, cancels, rewinds ----------------------------------------

    async def receive_event(
        self,
        kind: str,
        job_id: uuid.UUID,
        tenant: str,
        event: str,
        payload: Any,
        fingerprint: str,
        *,
        awaited: bool = False,
    ) -> EventOutcome:
        """Store ``event`` for the job; if the job waits for it, end the wait
        and queue the job again (the caller enqueues ``resumed``). With
        ``awaited`` (a decision on an approval), an event the job does not
        wait for now is ``missing``, not kept."""
        params = {
            "job_id": job_id,
            "tenant": tenant,
            "kind": kind,
            "event": event,
            "payload": Jsonb(payload),
            "fingerprint": fingerprint,
        }

        async def work(conn: psycopg.AsyncConnection[Any]) -> EventOutcome:
            cur = await conn.execute(query("lock_job_for_event"), params)
            found = await cur.fetchone()
            if found is None:
                return EventOutcome("missing")
            status, waiting_for = found
            cur = await conn.execute(query("event_fingerprint"), params)
            stored = await cur.fetchone()
            if stored is not None:
                same = stored[0] == fingerprint
                return EventOutcome("duplicate" if same else "conflict", status)
            if status in FINISHED:
                return EventOutcome("finished", status)
            resume = status == "waiting" and waiting_for == event
            if awaited and not resume:
                return EventOutcome("missing")
            cur = await conn.execute(query("receive_event"), {**params, "resume": resume})
            row = await cur.fetchone()
            resumed = None if row is None else JobSpec(str(row[0]), row[1], row[2], row[3])
            return EventOutcome("received", status, resumed)

        outcome = await run_transaction(self.pool, work, timeout_s=self.jobs.statement_timeout_s)
        if outcome.resumed is not None:
            self.jobs.transitions.changed(kind, outcome.resumed.job_id, "queued")
        return outcome

    async def waiting_detail(
        self, kind: str, job_id: uuid.UUID, tenant: str
    ) -> tuple[str | None, dict[str, Any] | None]:
        """What the tenant's job waits on now: its wake-up's name and detail
        (both None when it does not wait)."""
        params = {"job_id": job_id, "tenant": tenant, "kind": kind}
        rows = (await self._run("job_waiting_detail", params)).rows
        return (rows[0][0], rows[0][1]) if rows else (None, None)

    async def resume_due(self, limit: int = 500, ids: list[str] | None = None) -> list[JobSpec]:
        """Queue waiting jobs whose time has come (of ``ids`` only, when
        given: the jobs whose call just ended), and enqueue them; the jobs.
        An enqueue that fails is logged and left to the reconciler. Only
        the workflows this process serves (``Jobs.streams``): another
        process's timers resume the others. A call that timed out counts
        in ``oncely_calls_total``."""
        params = {"limit": limit, "kinds": list(self.jobs.streams), "ids": ids}
        rows = (await self._run("resume_due_jobs", params)).rows
        resumed = []
        for job_id, tenant, kind, data, timed_out in rows:
            resumed.append(JobSpec(str(job_id), tenant, kind, data))
            self.jobs.transitions.changed(kind, str(job_id), "queued")
            for key in timed_out or ():
                topic = key.rpartition("/")[2].partition("#")[0]
                metrics.CALLS.labels(workflow=kind, topic=topic, outcome="timeout").inc()
        if resumed:
            # One round trip; each failure logged (the reconciler restores it).
            redis = self.jobs.streams[resumed[0].kind].redis
            await call_together(redis, [self.jobs.enqueue_call(j) for j in resumed])
        return resumed

    async def cancel(
        self, job_id: uuid.UUID, *, tenant: str | None = None, kind: str | None = None
    ) -> Cancelled | None:
        """Cancel a queued (running) or waiting job: from now on nothing is
        written for it. A running delivery hears of it through Redis
        (``Stream.announce_cancel``) to stop at once; it would stop at its
        next checkpoint anyway. None: no such job."""
        params = {"job_id": job_id, "tenant": tenant, "kind": kind}
        rows = (await self._run("cancel_job", params)).rows
        if not rows:
            return None
        status, kind_of, parent = rows[0]
        found = Cancelled(status=status, kind=kind_of)
        if found.status not in CANCELLABLE:
            return found
        await self._announce_cancel(str(job_id), found.kind)
        # Its end told: its stream, and its count in its map if it is a child.
        end = Ended(found.kind, str(job_id), "cancelled", child=parent is not None)
        await self.jobs.transitions.ended(end)
        # Its unfinished children go with it (their map ends with it: no
        # count to follow).
        for child, was, child_kind in await self.children.cancel(str(job_id)):
            if was == "queued":
                await self._announce_cancel(child, child_kind)
            self.jobs.transitions.changed(child_kind, child, "cancelled")
        return found

    async def _announce_cancel(self, job_id: str, kind: str) -> None:
        """A running delivery of the job stops at once (it would at its next
        checkpoint anyway: PostgreSQL is the record)."""
        stream = self.jobs.streams.get(kind)
        if stream is None:
            return
        try:
            await stream.announce_cancel(job_id)
        except RedisError as exc:
            log.warning("jobs.cancel_not_announced", job_id=job_id, error=repr(exc))

    async def rewind(self, job_id: uuid.UUID, key: str) -> Rewound | None:
        """Run a dead or cancelled job again from checkpoint ``key``: the
        checkpoints from its ordinal on are deleted, the job queued in a new
        generation and enqueued. None: no such job. Effects emitted again
        keep their dedupe keys, so one already sent is not sent again."""

        async def work(conn: psycopg.AsyncConnection[Any]) -> Rewound | None:
            cur = await conn.execute(query("lock_finished_job"), {"job_id": job_id})
            found = await cur.fetchone()
            if found is None:
                return None
            status, tenant, kind, payload = found
            if status not in ("dead", "cancelled"):
                return Rewound(status)
            if kind not in self.jobs.streams:
                raise NotInApp(kind)  # before anything is deleted
            cur = await conn.execute(query("rewind_job"), {"job_id": job_id, "key": key})
            deleted = tuple(str(row[0]) for row in await cur.fetchall())
            job = JobSpec(str(job_id), tenant, kind, payload) if deleted else None
            return Rewound(status, deleted, job)

        rewound = await run_transaction(self.pool, work, timeout_s=self.jobs.statement_timeout_s)
        if rewound is not None and rewound.job is not None:
            stream = self.jobs.streams.get(rewound.job.kind)
            if stream is not None:
                # Its old cancel must not stop the new run (workers confirm it anyway).
                await stream.forget_cancel(rewound.job.job_id)
            self.jobs.transitions.changed(rewound.job.kind, rewound.job.job_id, "queued")
            await self.jobs.restore(rewound.job)
        return rewound

    # -- readers -----------------------------------------------------------------

    async def of_job(self, job_id: uuid.UUID, *, values: bool = True) -> list[Checkpoint]:
        """The job's checkpoints in the order its run reached them; their
        values only with ``values`` (operators)."""
        rows = (await self._run("job_checkpoints", {"job_id": job_id, "values": values})).rows
        return [_checkpoint(row) for row in rows]

    async def events(self, job_id: str) -> dict[str, Any]:
        """The events the job received, by name."""
        rows = (await self._run("job_events", {"job_id": job_id})).rows
        return {name: payload for name, payload in rows}

    async def is_cancelled(self, job_id: str) -> bool:
        """Whether the job is cancelled now (a fresh read, not batched)."""
        rows = (await self._run("job_status", {"job_id": job_id})).rows
        return bool(rows) and rows[0][0] == "cancelled"

    async def waiting_counts(self) -> dict[str, int]:
        """Waiting jobs by workflow."""
        rows = (await self._run("waiting_jobs_by_kind")).rows
        return {kind: int(n) for kind, n in rows}


def _checkpoint(row: Sequence[Any]) -> Checkpoint:
    """A checkpoint row, its JSON text decoded."""
    key, ordinal, kind, status, value, *rest = row
    return Checkpoint(
        key, ordinal, kind, status, None if value is None else json.loads(value), *rest
    )


def _wait_params(
    workflow: str,
    job_id: str,
    generation: int,
    writes: Writes,
    wait: Wait,
    delivery: DeliveryReport | None,
) -> dict[str, Any]:
    """The parameters of ``start_wait`` (sql/checkpoints.sql)."""
    call = wait.call
    return {
        "job_id": job_id,
        "generation": generation,
        "workflow": workflow,
        "trace_context": tracing.traceparent(),
        "key": wait.key,
        "ordinal": wait.ordinal,
        "kind": wait.kind,
        "event": wait.event,
        "seconds": wait.seconds,
        "waiting_for": wait.wakes_on,
        "detail": None if wait.detail is None else Jsonb(wait.detail),
        "call_topic": call.topic if call is not None else None,
        "call_dedupe_key": call.dedupe_key if call is not None else None,
        "call_payload": Jsonb(call.payload) if call is not None else None,
        "request": wait.request,
        **writes_params(writes),
        **delivery_params(delivery),
    }
