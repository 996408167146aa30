"""Ten thousand items as the children of one map against the same ten
thousand jobs posted one by one: what does fan-out cost in jobs/s and in
PostgreSQL statements per item?

Side by side on the same items, round-robin, each a real ``oncely worker``
process (``--app bench.maps_app:app``, both workflows) on the fake model,
one model call per item either way:

- ``map``: one ``batches`` job, as the API leaves it; its first delivery
  writes every child row in one statement and queues the first
  ``concurrency``; each child's end is counted in its map and releases the
  next; the last one queues the parent, which stores every result. Timed
  to the parent done.
- ``posted``: the same items as ``items`` jobs, rows and stream entries
  written beforehand as the API leaves them. Timed to the last done.

The map's concurrency is the worker's slots (64), so that neither side
waits on the other's limit. Reported per contender: jobs/s (items per
second), CPU per item, and PostgreSQL statements per item
(``pg_stat_statements``, as in ``bench.steps``). Every run ends with its
invariants: every item done once, one model call per item, nothing held,
the map's counts equal to its children's (done = items), the parent done.
"""

from __future__ import annotations

import argparse
import subprocess
import uuid
from typing import Any

from psycopg.types.json import Jsonb

from bench import maps_app
from bench.harness import jobs
from bench.harness.drain import JobsTrial as Trial
from bench.harness.fakes import API_KEY, FakeModel
from bench.harness.measure import Headline, Noise, ratio, ratio_json, say, summary
from bench.harness.processes import clean_env
from bench.harness.report import Context, main, parser
from bench.harness.servers import count, fresh_state
from bench.steps import Bench as StepsBench
from bench.steps import count_statements
from oncely.queue.stream import JobMessage, Stream
from oncely.sql import query
from oncely.workflow import Workflow

APP = "bench.maps_app:app"
SHOWN = ("jobs", "jobs_per_s", "cpu_ms_per_job", "statements_per_job", "machine_busy_cores")
OURS, THEIRS = "map", "posted"
SLOTS = 64


def text(i: int) -> str:
    return f"Item {i} of the batch is summarised here. Its second sentence. A third one."


class Bench(StepsBench):
    """``bench.steps``' course over the two shapes of the same items."""

    shown = SHOWN

    async def load(self, trial: Trial) -> None:  # type: ignore[override]
        await fresh_state(self.redis, self.db)
        await self.fake.reset()
        self.counted = {}
        texts = [text(i) for i in range(trial.items)]
        workflow: Workflow[Any, Any]
        if trial.kind == OURS:
            payloads = [{"texts": texts, "concurrency": SLOTS}]
            workflow = maps_app.batches
        else:
            payloads = [{"text": t} for t in texts]
            workflow = maps_app.items
        messages = [JobMessage.new(str(uuid.uuid4()), "bench", p) for p in payloads]
        async with self.db.cursor() as cur:
            rows = [(m.job_id, m.tenant, workflow.name, Jsonb(m.payload)) for m in messages]
            await cur.executemany(query("insert_job"), rows)
        for w in (maps_app.batches, maps_app.items):
            await Stream(self.redis, w.keys).ensure_group()
        stream = Stream(self.redis, workflow.keys)
        for m in messages:
            await stream.enqueue(m)
        await self.db.execute("ANALYZE jobs")
        self.workflow = workflow
        if self.statements is not None:
            await self.statements.reset(self.db)

    def spawn(self, trial: Trial) -> subprocess.Popen[bytes]:  # type: ignore[override]
        s = self.ctx.servers
        env = clean_env(
            app=APP,
            redis_url=s.redis_url,
            database_url=self.statements.worker_url if self.statements else s.database_url,
            llm_base_url=self.fake.url,
            llm_api_key=API_KEY,
            worker_concurrency=str(SLOTS),
            log_level="WARNING",
        )
        return self.ctx.children.python(trial.name, ["-m", "oncely", "worker"], env)

    async def drained(self, proc: subprocess.Popen[bytes], trial: Trial, within_s: float) -> None:  # type: ignore[override]
        # The map's parent ends after its last child: one more job done.
        extra = 1 if trial.kind == OURS else 0
        await jobs.all_done(self.db, proc, trial.items + extra, within_s)

    async def checks(self, trial: Trial) -> dict[str, Any]:  # type: ignore[override]
        n = trial.items
        statements = await self._statements(trial)
        calls = await self.fake.calls()
        db = self.db
        c: dict[str, Any] = {
            "jobs": n,
            "items_done": await count(
                db, "SELECT count(*) FROM jobs WHERE kind = 'items' AND status = 'done'"
            ),
            "held": await count(db, "SELECT count(*) FROM jobs WHERE status = 'held'"),
            "model_calls": int(calls["total"]),
            "parent_done": await count(
                db, "SELECT count(*) FROM jobs WHERE kind = 'batches' AND status = 'done'"
            ),
            "map_done": await count(db, "SELECT coalesce(sum(done), 0) FROM job_maps"),
            "statements": statements,
        }
        mapped = trial.kind == OURS
        c["ok"] = (
            c["items_done"] == n
            and c["model_calls"] == n
            and c["held"] == 0
            and (not mapped or (c["parent_done"] == 1 and c["map_done"] == n))
        )
        return c

    async def _statements(self, trial: Trial) -> dict[str, int] | None:
        if self.statements is None:
            return None
        counted = await self.statements.read(self.db)
        n = trial.items
        calls = sum(c.calls for c in counted)
        self.counted = {
            "statements_per_job": round(calls / n, 3),
            "pg_exec_ms_per_job": round(sum(c.exec_ms for c in counted) / n, 3),
        } | {f"statements_per_job.{c.name}": round(c.calls / n, 3) for c in counted}
        return {c.name: c.calls for c in counted}


async def bench_main(ctx: Context) -> tuple[list[Headline], dict[str, Any], bool]:
    statements, counted_by = await count_statements(ctx)
    if statements is None:
        say(f"statements not counted: {counted_by}")
    model = FakeModel.start(ctx.children)
    bench = Bench(ctx, model, statements)
    await bench.open()
    n = 200 if ctx.smoke else 10_000
    try:
        trials: list[Any] = [Trial(OURS, n), Trial(THEIRS, n)]
        runs = await bench.run_rounds(trials, "maps ")
    finally:
        await bench.close()
    ok = all(r.ok for rs in runs.values() for r in rs)
    ours, theirs = runs[OURS], runs[THEIRS]
    headline = [
        Headline.of(
            f"maps: {n} children of one map / {n} jobs posted, jobs/s",
            ratio(ours, theirs, "jobs_per_s"),
        ),
        Headline.of(
            "maps: statements per item, map / posted", ratio(ours, theirs, "statements_per_job")
        ),
    ]
    detail = {
        "statements_counted_by": counted_by,
        "items": n,
        "map_concurrency": SLOTS,
        "results": {key: summary(rs) for key, rs in runs.items()},
        "ratios": {
            f"{OURS}_vs_{THEIRS}": {
                "throughput": ratio_json(ours, theirs, "jobs_per_s"),
                "cpu_per_job": ratio_json(ours, theirs, "cpu_ms_per_job"),
                "statements_per_job": ratio_json(ours, theirs, "statements_per_job"),
            }
        },
    }
    return headline, detail, ok


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("maps", __doc__ or "", rounds=3, noise=Noise(0.3, 30.0, 2, 90.0))
    return p.parse_args(argv)


if __name__ == "__main__":
    main("maps", "children of one map vs the same jobs posted", parse_args(), bench_main)
