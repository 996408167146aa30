"""``bench.agents``' contenders in one process, with no servers: what each
agent costs in CPU and in Python calls per job, apart from the worker, the
model's HTTP and PostgreSQL.

Each job is ``oncely.testing.run_step`` of the contender's workflow
(``bench.agents_app``) on the same case, the model scripted with the same
four turns (two function tools, the call tool, the answer) and the call's
receiver answering, stopped right after the call's checkpoint and run again
over what it stored: the run to the call and the replay after the call's
answer, as the worker runs such a job (the job waits for the call, then
starts again from the top). Reported per contender, against ``agent``
(``oncely.Agent``):

- CPU per job: the median of interleaved batches (each contender's batch in
  turn, so a busy machine slows all alike);
- Python function calls per job (``cProfile``'s count: the same on any
  machine, so a change to an adapter shows even when the CPU is noisy).

``python -m bench.agents_alone`` (``--batches``, ``--batch``, ``--only``).
docs/performance.md (Agent frameworks) has the latest numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import statistics
import time
from collections.abc import Sequence
from typing import Any

from oncely.testing import StepRun, ToolCalls, run_step
from oncely.workflow import Workflow

CONTENDERS = ("agent", "pydantic_ai", "openai_agents", "langgraph")
TURNS = 4


def _workflows() -> dict[str, tuple[Workflow[Any, Any], str]]:
    from bench import agents_app as app

    return {
        "agent": (app.agent, app.TOPIC),
        "pydantic_ai": (app.with_pai, app.TOPIC_PAI),
        "openai_agents": (app.with_oaa, app.TOPIC_OAA),
        "langgraph": (app.with_lg, app.TOPIC_LG),
    }


class Jobs:
    """One contender's jobs, each to the call and again from the top."""

    def __init__(self, workflow: Workflow[Any, Any], topic: str) -> None:
        self.workflow = workflow
        self.topic = topic
        self.crash_after: str | None = None

    async def ready(self) -> None:
        """The call's key, from a first job run whole."""
        run = await self.one(0)
        self.crash_after = next(k for k in run.steps if k.endswith("/call"))
        run = await self.one(0)
        if run.model_calls != TURNS or not run.replayed:
            raise RuntimeError(
                f"{self.workflow.name}: {run.model_calls} model calls (not {TURNS}),"
                f" {run.replayed} checkpoints replayed after the call"
            )

    async def one(self, i: int) -> StepRun[Any]:
        sku = f"SKU-{i:05d}"
        turns = [
            ToolCalls(("lookup", {"sku": sku})),
            ToolCalls(("check", {"sku": sku})),
            ToolCalls(("refund", {"sku": sku, "cents": 1200})),
            "Refunded.",
        ]
        # Each in a task of its own, as the worker runs each job.
        return await asyncio.create_task(
            run_step(
                self.workflow,
                {"text": f"{sku} The item arrived broken; please refund it."},
                answers=turns,
                calls={self.topic: {"id": f"refund-{i}"}},
                crash_after=self.crash_after,
            )
        )

    async def batch(self, n: int) -> float:
        """CPU ms per job over ``n`` jobs."""
        started = time.process_time()
        for i in range(n):
            await self.one(i)
        return (time.process_time() - started) * 1000 / n

    async def calls(self, n: int) -> float:
        """Python function calls per job over ``n`` jobs."""
        profiler = cProfile.Profile()
        profiler.enable()
        try:
            for i in range(n):
                await self.one(i)
        finally:
            profiler.disable()
        return pstats.Stats(profiler).total_calls / n  # type: ignore[attr-defined,no-any-return]


async def measure(kinds: Sequence[str], batches: int, batch: int) -> dict[str, Any]:
    found = _workflows()
    jobs = {kind: Jobs(*found[kind]) for kind in kinds}
    for each in jobs.values():
        await each.ready()
        await each.batch(3)  # warm: a framework's first run builds what it caches
    cpu: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(batches):
        for kind, each in jobs.items():
            cpu[kind].append(await each.batch(batch))
    calls = {kind: await each.calls(batch) for kind, each in jobs.items()}
    results: dict[str, Any] = {}
    for kind in kinds:
        results[kind] = {
            "cpu_ms_per_job": round(statistics.median(cpu[kind]), 2),
            "cpu_ms_per_job_batches": [round(x, 2) for x in cpu[kind]],
            "python_calls_per_job": round(calls[kind]),
        }
    ours = results.get("agent")
    if ours is not None:
        for row in results.values():
            row["cpu_vs_agent"] = round(row["cpu_ms_per_job"] / ours["cpu_ms_per_job"], 2)
            row["calls_vs_agent"] = round(
                row["python_calls_per_job"] / ours["python_calls_per_job"], 2
            )
    return {"batches": batches, "jobs_per_batch": batch, "results": results}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.agents_alone", description=__doc__)
    p.add_argument("--batches", type=int, default=10, help="batches per contender (10)")
    p.add_argument("--batch", type=int, default=20, help="jobs per batch (20)")
    p.add_argument("--only", help=f"comma-separated, of {', '.join(CONTENDERS)} (agent always)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    kinds = list(CONTENDERS)
    if args.only:
        kinds = ["agent", *(k for k in args.only.split(",") if k != "agent")]
        unknown = sorted(set(kinds) - set(CONTENDERS))
        if unknown:
            raise SystemExit(f"unknown contender {unknown[0]!r}: one of {', '.join(CONTENDERS)}")
    report = asyncio.run(measure(kinds, args.batches, args.batch))
    for kind, row in report["results"].items():
        print(
            f"{kind:14} {row['cpu_ms_per_job']:7.2f} ms CPU/job ({row['cpu_vs_agent']:.2f} ×)"
            f"  {row['python_calls_per_job']:6d} calls/job ({row['calls_vs_agent']:.2f} ×)"
        )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
