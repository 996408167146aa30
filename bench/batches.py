"""What the batch lane costs PostgreSQL (docs/lanes.md): N calls on the
batch lane, each its job's, through the real model seam and ``Batcher``
against the fake model's Batches API over HTTP, in three phases:

- ``intent``: every call's first look (its line read, then stored) until
  it waits (``ResumeLater``);
- ``batch``: the batcher's passes until every line is answered: gathered
  (``ONCELY_BATCH_MAX_CALLS`` a batch), created, recorded, polled, settled;
- ``resume``: every call's look that finds its answer.

Statements are counted where ``oncely.llm.batches`` runs them (every
``batch_lines`` statement); the checkpoint and ledger writes a job makes on
any lane are not in the count.

    PYTHONPATH=src .venv/bin/python bench/batches.py --database-url postgresql://…/db \\
        [--calls 10000] [--max-calls 10000]

Needs a migrated oncely database it may write ``batch_lines`` rows to (the
rows it wrote are deleted at the end).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from typing import Any

from psycopg_pool import AsyncConnectionPool

import oncely.llm.batches as batches_module
from oncely.errors import ResumeLater
from oncely.fakes.llm import FakeLLMServer
from oncely.llm.batches import Batcher, BatchLines, OpenAIBatches
from oncely.llm.model import Model, ModelRoute
from oncely.llm.openai_compat import OpenAICompatible
from oncely.retry import Deadline, RetryPolicy
from oncely.usage.calls import CallSite

MODEL = "gpt-fake"
_counted = {"statements": 0}
# Where oncely.llm.batches runs its statements, wrapped to count them.
_run_statement = vars(batches_module)["run_statement"]


async def _counting(*args: Any, **kwargs: Any) -> Any:
    _counted["statements"] += 1
    return await _run_statement(*args, **kwargs)


def _model(llm: OpenAICompatible, lines: BatchLines, job_id: str) -> Model:
    return Model(
        llm,
        policy=RetryPolicy(),
        deadline=Deadline.after(600),
        workflow="bench",
        model_name=MODEL,
        route=ModelRoute(lane="batch", batches=lines),
        site=CallSite("bench", job_id, "bench"),
    )


async def _looks(
    llm: OpenAICompatible, lines: BatchLines, jobs: list[str], concurrency: int
) -> tuple[int, int]:
    """Each job's look: how many waited, how many were answered."""
    sem = asyncio.Semaphore(concurrency)
    waited = answered = 0

    async def look(job_id: str) -> None:
        nonlocal waited, answered
        async with sem:
            try:
                await _model(llm, lines, job_id).complete(f"Ticket {job_id}. Classify it.")
            except ResumeLater:
                waited += 1
            else:
                answered += 1

    await asyncio.gather(*(look(j) for j in jobs))
    return waited, answered


async def run(args: argparse.Namespace) -> dict[str, Any]:
    vars(batches_module)["run_statement"] = _counting
    report: dict[str, Any] = {"calls": args.calls, "max_calls_per_batch": args.max_calls}
    jobs = [str(uuid.uuid4()) for _ in range(args.calls)]
    async with (
        AsyncConnectionPool(
            args.database_url, min_size=1, max_size=10, open=False, kwargs={"autocommit": True}
        ) as pool,
        FakeLLMServer(batch_delay_s=0.0) as fake,
        OpenAICompatible.connect(fake.url, "bench", MODEL) as llm,
    ):
        await pool.open(wait=True)
        lines = BatchLines(pool, poll_s=0.05, statement_timeout_s=60)
        api = OpenAIBatches.connect(fake.url, "bench")
        batcher = Batcher(lines, {"chat": api}, gather_s=0, max_calls=args.max_calls, lease_s=600)
        try:
            phases: dict[str, dict[str, float]] = {}

            async def phase(name: str, work: Any) -> Any:
                before, started = _counted["statements"], time.perf_counter()
                result = await work
                took = time.perf_counter() - started
                statements = _counted["statements"] - before
                phases[name] = {
                    "statements": statements,
                    "statements_per_call": round(statements / args.calls, 3),
                    "seconds": round(took, 2),
                }
                return result

            waited, _ = await phase("intent", _looks(llm, lines, jobs, args.concurrency))
            assert waited == args.calls

            async def settle() -> int:
                passes = 0
                while True:
                    passes += 1
                    await batcher.tick()
                    rows = await lines.batches(limit=1000)
                    if sum(r.answered for r in rows) >= args.calls:
                        return passes

            report["batcher_passes"] = await phase("batch", settle())
            _, answered = await phase("resume", _looks(llm, lines, jobs, args.concurrency))
            assert answered == args.calls
            stats = fake.batches.stats()
            report["batches_created"] = stats["created"]
            report["lines_submitted_twice"] = sum(1 for n in stats["lines"].values() if n > 1)
            report["phases"] = phases
            total = sum(p["statements"] for p in phases.values())
            report["statements_per_call"] = round(total / args.calls, 3)
        finally:
            await api.aclose()
            async with pool.connection() as conn:
                await conn.execute(
                    "DELETE FROM batch_lines WHERE workflow = 'bench' AND tenant = 'bench'"
                )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--max-calls", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=50)
    print(json.dumps(asyncio.run(run(parser.parse_args())), indent=2))


if __name__ == "__main__":
    main()
