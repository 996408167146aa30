"""Maps: a parent job's children (``ctx.map``, docs/fanout.md).

Only this module runs SQL on the ``job_maps`` table and on the jobs' map
columns (``sql/children.sql``).

A map starts inside its parent's wait transaction (``start``, called by
``Checkpoints.start_wait``): the map's row and every child, the first
``concurrency`` of them queued and the rest ``held``; the parent waits
holding nothing. Each child's end (done, dead, cancelled), as the jobs'
transitions tell it (``on_end``, ``oncely.jobs.transitions``), is counted in
its map (``settle``), in one statement that also releases the held
children it leaves room for (``sql/children.sql`` says why that is safe
under concurrent ends); once every child has ended the map ends: the
children's results in item order become the parent's checkpoint and the
parent is queued again. Nothing polls on that path; a child's end wakes
its parent.

What could be lost between a child's end and its count, or between the
last count and the map's end (the process died in between), the repair
pass finds (``repair``, every worker's timers). A released child
or a resumed parent whose enqueue failed is a queued row without a
message, which the reconciler restores, as for the intake.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
import structlog
from psycopg.types.json import Jsonb

from oncely.batching import GroupCommit
from oncely.identity import child_id
from oncely.jobs.records import JobSpec
from oncely.jobs.store import Jobs
from oncely.jobs.transitions import Ended
from oncely.journal import MapStart
from oncely.redis_client import call_together
from oncely.sql import query
from oncely.sql.bounded import StatementResult, run_statement, run_transaction
from oncely.usage.totals import summed
from oncely.views import tenant_error

log = structlog.get_logger("oncely.children")

# Children enqueued per round trip.
_ENQUEUE_BATCH = 500
# How long a child's end may stay uncounted before the repair pass counts it.
REPAIR_AFTER_S = 10.0


@dataclass(frozen=True)
class MapCounts:
    """What a map's children count now (GET's ``waiting.children``)."""

    key: str
    workflow: str
    total: int
    running: int
    held: int
    done: int
    dead: int
    cancelled: int
    finished: bool

    def to_json(self) -> dict[str, int]:
        return {
            "total": self.total,
            "done": self.done,
            "dead": self.dead,
            "cancelled": self.cancelled,
            "running": self.running,
            "queued": self.held,
        }


class Children:
    def __init__(self, jobs: Jobs) -> None:
        self.jobs = jobs
        # Ends reported together are counted in one statement (oncely.batching).
        self._ending: GroupCommit[str, str] = GroupCommit(self._settle_batch, key=str)

    async def _run(self, name: str, params: Any) -> StatementResult:
        return await run_statement(
            self.jobs.pool, query(name), params, timeout_s=self.jobs.statement_timeout_s
        )

    async def start(
        self,
        conn: psycopg.AsyncConnection[Any],
        parent: JobSpec,
        key: str,
        spec: MapStart,
    ) -> tuple[list[JobSpec], bool]:
        """Within the parent's wait transaction: the map's row and its
        children. Answers the children queued (to enqueue after the
        commit) and whether a run before had started this map (then its
        counts are read again after the commit: ``recount``)."""
        params = {
            "job_id": parent.job_id,
            "key": key,
            "kind": spec.workflow,
            "tenant": parent.tenant,
            "total": len(spec.items),
            "concurrency": spec.concurrency,
        }
        cur = await conn.execute(query("create_map"), params)
        if await cur.fetchone() is None:
            return [], True
        children = [
            {"job_id": child_id(parent.job_id, key, n), "position": n, "payload": item}
            for n, item in enumerate(spec.items)
        ]
        cur = await conn.execute(query("insert_children"), {**params, "children": Jsonb(children)})
        return [_spec(row) for row in await cur.fetchall()], False

    async def enqueue(self, jobs: Sequence[JobSpec]) -> None:
        """Enqueue queued rows, in batches; a failure is logged and left to
        the reconciler (the rows are the record)."""
        for start in range(0, len(jobs), _ENQUEUE_BATCH):
            batch = jobs[start : start + _ENQUEUE_BATCH]
            redis = self.jobs.streams[batch[0].kind].redis
            await call_together(redis, [self.jobs.enqueue_call(j) for j in batch])

    async def settle(self, job_ids: Iterable[str]) -> None:
        """Count these jobs' ends in their maps (those that are children
        that ended and were not counted yet), in one statement that also
        releases the held children their ends leave room for; enqueue
        those, and end the maps none of whose children is left."""
        ids = list(job_ids)
        if ids:
            await self._advanced(await self._run("count_ended_children", {"job_ids": ids}))

    async def ended(self, job_ids: Iterable[str]) -> None:
        """``settle``, for a process that has just ended these jobs: a
        failure is logged, not raised (the job's own outcome is stored;
        the repair pass counts what this could not)."""
        try:
            for job_id in job_ids:
                await self._ending(job_id)
        except Exception as exc:  # the repair pass counts it (module doc)
            log.warning("children.not_counted", error=f"{type(exc).__name__}: {exc}")

    async def on_end(self, end: Ended) -> None:
        """A job's end as ``Jobs.transitions`` tells it: a map child's is
        counted in its map (``ended``). The composition root subscribes
        it (``Transitions.when_ended``)."""
        if end.child:
            await self.ended([end.job_id])

    async def _settle_batch(self, job_ids: list[str]) -> set[str]:
        await self.settle(job_ids)
        return set(job_ids)

    async def recount(self, parent_id: str, key: str) -> None:
        """Read a map's counts again from its children, then go on as after
        a child's end (a rewound parent's map, whose children may all have
        ended already)."""
        await self._advanced(await self._run("recount_map", {"parent_id": parent_id, "key": key}))

    async def repair(self, *, age_s: float = REPAIR_AFTER_S, limit: int = 500) -> int:
        """Count the children whose end was never counted, and end the maps
        whose last count was not followed by their end (their process died
        first); how many of either."""
        params = {"age_s": age_s, "limit": limit}
        rows = (await self._run("uncounted_children", params)).rows
        if rows:
            log.info("children.repaired", children=len(rows))
            await self.settle(str(row[0]) for row in rows)
        maps = (await self._run("unended_maps", params)).rows
        for parent_id, key in maps:
            log.info("children.map_repaired", parent_id=str(parent_id))
            await self.enqueue(await self._end(str(parent_id), key))
        return len(rows) + len(maps)

    async def cancel(self, parent_id: str) -> list[tuple[str, str, str]]:
        """A cancelled parent's unfinished children cancelled: each one's
        id, the status it had and its workflow."""
        rows = (await self._run("cancel_children", {"parent_id": parent_id})).rows
        return [(str(job_id), status, kind) for job_id, status, kind in rows]

    async def counts(self, parent_id: str) -> list[MapCounts]:
        """The parent's maps, oldest first, with what their children count."""
        rows = (await self._run("map_counts", {"parent_id": parent_id})).rows
        found = []
        for key, workflow, total, released, done, dead, cancelled, ended in rows:
            running = max(released - done - dead - cancelled, 0)
            held = total - released
            found.append(
                MapCounts(
                    key, workflow, total, running, held, done, dead, cancelled, ended is not None
                )
            )
        return found

    async def _advanced(self, result: StatementResult) -> None:
        """What a count answered: the children it released, to enqueue, and
        the maps it left with no child, to end."""
        released, ended = result.rows[0] if result.rows else ([], [])
        # Held children let go (held → queued), then parents whose map ended
        # (waiting → queued): each change told (oncely.jobs.transitions).
        await self._queued([JobSpec(str(j), t, k, p) for j, t, k, p in released])
        for parent_id, key in ended:
            await self._queued(await self._end(str(parent_id), key))

    async def _queued(self, jobs: Sequence[JobSpec]) -> None:
        await self.enqueue(jobs)
        for job in jobs:
            self.jobs.transitions.changed(job.kind, job.job_id, "queued")

    async def _end(self, parent_id: str, key: str) -> list[JobSpec]:
        """The map's results and its children's usage to its parent, once
        (the map's row locked); the parent, to enqueue, if it waits."""
        params = {"parent_id": parent_id, "key": key}

        async def work(conn: psycopg.AsyncConnection[Any]) -> list[JobSpec]:
            cur = await conn.execute(query("lock_unfinished_map"), params)
            if await cur.fetchone() is None:
                return []  # another process ended it
            cur = await conn.execute(query("map_children"), params)
            results, usages = [], []
            for job_id, status, error, result, usage in await cur.fetchall():
                # The stable reason, as the child's tenant sees it (never the detail).
                reason = tenant_error(error) if status == "dead" else None
                results.append(
                    {"job_id": str(job_id), "status": status, "result": result, "error": reason}
                )
                usages.append(usage)
            usage = summed(usages)
            cur = await conn.execute(
                query("end_map"),
                {
                    **params,
                    "results": Jsonb(results),
                    "usage": Jsonb(usage),
                    # The map itself spent nothing; its children, this.
                    "checkpoint_usage": Jsonb(summed([{"children": usage}])),
                },
            )
            return [_spec(row) for row in await cur.fetchall()]

        found: list[JobSpec] = await run_transaction(
            self.jobs.pool, work, timeout_s=self.jobs.statement_timeout_s
        )
        return found


def _spec(row: Sequence[Any]) -> JobSpec:
    job_id, tenant, kind, payload = row
    return JobSpec(str(job_id), tenant, kind, payload)
