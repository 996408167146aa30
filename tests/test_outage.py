"""A model provider outage: jobs back off and wait, none dies, and all finish
within one backoff period after the provider returns."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from oncely.queue.worker import Worker, WorkerConfig
from tests.helpers import count, pending, submit
from tests.processes import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.soak]

OUTAGE_S = 20.0
BASE_S, MAX_S = 0.5, 2.0


async def test_an_outage_dead_letters_nothing_and_drains_within_a_backoff_period(
    pool, stream, jobs, summary_job, fake_llm
):
    # Backoff settings scaled down from 15 s / 900 s; deterministic jitter
    # (the ceiling), so the redeliveries per job can be counted exactly.
    config = WorkerConfig(
        block_ms=20,
        claim_idle_ms=60_000,
        max_deliveries=2,  # crash loops only: reported failures never count
        redelivery_base_s=BASE_S,
        redelivery_max_s=MAX_S,
        promote_every_s=0.05,
    )
    worker = Worker(
        stream, summary_job, config, workflow="summaries", on_dead=jobs.mark_dead,
        rand=lambda: 1.0,
    )  # fmt: skip
    fake_llm.model.outage = "503"
    ids = [await submit(pool, stream, f"Outage job {i}. It waits.") for i in range(20)]
    running = asyncio.create_task(worker.run())
    try:
        await asyncio.sleep(OUTAGE_S)
        during = {p.excerpt: p.count for p in fake_llm.stats().prompts}
        fake_llm.model.outage = None

        async def all_done() -> bool:
            done = await count(pool, "SELECT count(*) FROM jobs WHERE status = 'done'")
            return done == len(ids)

        # A generous deadline; the capped backoff itself is proven by the
        # deliveries counted during the outage, below.
        await wait_for(all_done, within_s=MAX_S + 60, what="every job done after recovery")
    finally:
        worker.stop()
        await running
    assert await count(pool, "SELECT count(*) FROM jobs WHERE status = 'dead'") == 0
    assert await stream.redis.xlen(stream.dead) == 0
    assert await pending(stream) == 0
    # Redeliveries follow the schedule 0.5, 1, 2, 2, … s: over a 20 s outage
    # that is about 11 deliveries of llm_max_attempts calls each, per job.
    # Never more (the backoff holds); at least half of them (the capped
    # backoff keeps trying, however slowly a busy machine serves them).
    attempts = summary_job.config.policy.max_attempts
    deliveries = _deliveries_within(OUTAGE_S)
    for excerpt, calls in during.items():
        assert attempts * (deliveries // 2) <= calls <= attempts * (deliveries + 1), excerpt
    total: Any = fake_llm.stats().total
    assert total < len(ids) * attempts * (deliveries + 2)


def _deliveries_within(seconds: float) -> int:
    """Deliveries of a job failing from t=0 with delays BASE*2^(n-1), capped at MAX."""
    elapsed, n = 0.0, 0
    while elapsed <= seconds:
        n += 1
        elapsed += min(MAX_S, BASE_S * 2 ** (n - 1))
    return n
