"""A workflow ticking every second, served by three real `oncely worker`
processes: one job per tick across them, every one done; all of them
stopped, then one started again: no tick gets a second job, and nothing
runs for the ticks of the downtime but the latest. `oncely schedules list`
shows it (docs/fanout.md, Schedules)."""

from __future__ import annotations

import asyncio
import json
import signal
from collections import Counter
from datetime import datetime

import pytest

from tests.helpers import scalar
from tests.processes import oncely, running, start, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

APP = "tests.schedule_app:app"


async def ticks(pool) -> list[str]:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT payload->>'at' FROM jobs WHERE kind = 'every_second'")
        return [str(r[0]) for r in await cur.fetchall()]


async def test_three_workers_start_one_job_per_tick_and_catch_up_once(
    redis_url, database_url, pool, tmp_path
):
    env = {
        "ONCELY_REDIS_URL": redis_url,
        "ONCELY_DATABASE_URL": database_url,
        "ONCELY_LOG_FORMAT": "json",
        "ONCELY_BLOCK_MS": "50",
    }
    workers = [start(["--app", APP, "worker"], env, tmp_path / f"w{n}.log") for n in range(3)]
    with running(*workers):

        async def six_ticks() -> bool:
            return len(await ticks(pool)) >= 6

        await wait_for(six_ticks, within_s=60, what="six ticks")
        for w in workers:
            w.send_signal(signal.SIGTERM)
        for w in workers:
            w.wait(30)
    before = await ticks(pool)
    assert max(Counter(before).values()) == 1, "a tick started twice"
    await asyncio.sleep(3)  # ticks pass with every process down

    restarted_at = datetime.now().astimezone()
    again = start(["--app", APP, "worker"], env, tmp_path / "again.log")
    with running(again):

        async def ticking_again() -> bool:
            return len(await ticks(pool)) >= len(before) + 2

        await wait_for(ticking_again, within_s=60, what="ticks after the restart")

        async def all_done() -> bool:
            left = await scalar(
                pool, "SELECT count(*) FROM jobs WHERE kind = 'every_second' AND status <> 'done'"
            )
            return bool(left == 0)

        await wait_for(all_done, within_s=60, what="every tick's job done")
        again.send_signal(signal.SIGTERM)
        again.wait(30)
    after = await ticks(pool)
    assert max(Counter(after).values()) == 1, "a tick started twice"
    last_before = datetime.fromisoformat(max(before))
    downtime = [t for t in after if last_before < datetime.fromisoformat(t) < restarted_at]
    assert len(downtime) <= 1, f"the missed ticks run once, the latest only: {downtime}"
    listed = oncely("--app", APP, "schedules", "list", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    [state] = json.loads(listed.stdout)
    assert state["workflow"] == "every_second" and state["schedule"] == "* * * * * *"
    assert state["last_tick"] == max(after)
