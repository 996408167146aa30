"""A background task that dies stops its process, non-zero and logged."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.processes import start, tail

pytestmark = pytest.mark.slow


async def test_a_dead_lease_renewal_task_stops_the_worker_non_zero_with_a_traceback(
    redis_url, database_url, redis, tmp_path
):
    env = {
        "ONCELY_REDIS_URL": redis_url,
        "ONCELY_DATABASE_URL": database_url,
        "ONCELY_LOG_FORMAT": "json",
        "ONCELY_CLAIM_IDLE_MS": "300",  # renewal runs every 0.1 s
    }
    log = tmp_path / "worker.log"
    proc = start(["--app", "tests.crashing_app:app", "worker"], env, log)
    try:
        code = await asyncio.to_thread(proc.wait, 30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code != 0, tail(log)
    events = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    failed = [e for e in events if e["event"] == "process.task_failed"]
    assert failed, tail(log)
    assert {e["task"] for e in failed} == {"renew-leases"}
    assert all("lease renewal broke" in e["exception"] for e in failed)
    assert all("Traceback" in e["exception"] for e in failed)
