"""Schedules (docs/fanout.md, Schedules): exactly one job per tick across
the fleet, however many processes look; the latest missed tick once after
every process was down (or none); what ``oncely schedules list`` shows.
Several schedulers (as in several worker processes) share real PostgreSQL
and Redis; time is a clock the test moves."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest
from pydantic import BaseModel

from oncely import Workflow
from oncely.api.keys import Scope
from oncely.jobs.schedules import Scheduled, Scheduler, scheduled
from oncely.jobs.store import Jobs
from oncely.queue.stream import Stream
from oncely.timetable import Timetable
from tests import schedule_app

START = datetime(2026, 3, 1, 2, 0, 0, 300_000, tzinfo=UTC)


class Clock:
    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


@pytest.fixture
async def jobs(pool, redis) -> Jobs:
    found = Jobs(pool, {w.name: Stream(redis, w.keys) for w in schedule_app.app})
    for stream in found.streams.values():
        await stream.ensure_group()
    return found


def fleet(jobs: Jobs, clock: Clock, n: int = 3, **options) -> list[Scheduler]:
    return [Scheduler(jobs, scheduled(schedule_app.app), clock=clock, **options) for _ in range(n)]


async def scheduled_jobs(pool) -> list[tuple[str, str, dict]]:
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT job_id::text, tenant, payload FROM jobs WHERE kind = 'every_second'"
            " ORDER BY payload->>'at'"
        )
        return [(str(a), str(b), dict(c)) for a, b, c in await cur.fetchall()]


async def pass_of(schedulers: list[Scheduler]) -> int:
    started = await asyncio.gather(*(s.run_once() for s in schedulers))
    return sum(len(jobs) for jobs in started)


async def test_three_processes_start_one_job_per_tick(jobs, pool) -> None:
    clock = Clock(START)
    schedulers = fleet(jobs, clock)
    # The first look starts the schedule after the tick before now: no job.
    assert await pass_of(schedulers) == 0
    for second in range(1, 6):
        clock.now = START + timedelta(seconds=second)
        assert await pass_of(schedulers) == 1
        assert await pass_of(schedulers) == 0, "a tick already started is not started again"
    found = await scheduled_jobs(pool)
    ticks = [(START + timedelta(seconds=s)).replace(microsecond=0) for s in range(1, 6)]
    assert [p["at"] for _, _, p in found] == [t.isoformat() for t in ticks]
    assert {tenant for _, tenant, _ in found} == {"scheduler"}
    # Each is the job a POST with the tick's idempotency key would have made.
    key = f"schedule:every_second:{ticks[0].isoformat()}"
    assert found[0][0] == str(Scope("scheduler", "POST", "/v1/every-second", key).job_id)
    stream = jobs.streams["every_second"]
    assert await stream.redis.xlen(stream.stream) == 5


async def test_after_a_downtime_the_latest_tick_runs_once(jobs, pool) -> None:
    clock = Clock(START)
    assert await pass_of(fleet(jobs, clock)) == 0
    # Every process down for two minutes: 120 ticks missed.
    clock.now = START + timedelta(minutes=2)
    assert await pass_of(fleet(jobs, clock)) == 1
    assert [p["at"] for _, _, p in await scheduled_jobs(pool)] == [
        clock.now.replace(microsecond=0).isoformat()
    ]


async def test_catch_up_none_skips_what_was_missed(jobs, pool) -> None:
    nightly = Scheduled(
        "every_second",
        "/v1/every-second",
        Timetable("0 2 * * *"),
        schedule_app.every_second.scheduled_request,
    )
    clock = Clock(datetime(2026, 3, 1, 12, 0, tzinfo=UTC))

    def none_fleet() -> list[Scheduler]:
        return [Scheduler(jobs, [nightly], clock=clock, catch_up="none") for _ in range(3)]

    assert await pass_of(none_fleet()) == 0
    # Down from before 02:00 until noon: that night's tick is skipped.
    clock.now = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)
    assert await pass_of(none_fleet()) == 0
    assert await scheduled_jobs(pool) == []
    # The next night's tick, seen on time, runs.
    clock.now = datetime(2026, 3, 3, 2, 0, 1, tzinfo=UTC)
    assert await pass_of(none_fleet()) == 1
    assert [p["at"] for _, _, p in await scheduled_jobs(pool)] == ["2026-03-03T02:00:00+00:00"]


async def test_states_show_the_last_and_next_tick(jobs) -> None:
    clock = Clock(START)
    [scheduler] = fleet(jobs, clock, n=1)
    await scheduler.run_once()
    clock.now = START + timedelta(seconds=1)
    [started] = await scheduler.run_once()
    [state] = await scheduler.states()
    assert state.workflow == "every_second" and state.expression == "* * * * * *"
    assert state.last_tick == START.replace(microsecond=0) + timedelta(seconds=1)
    assert state.last_job_id == started.job_id
    assert state.next_tick == state.last_tick + timedelta(seconds=1)


def test_timetables_read_cron_in_their_zone() -> None:
    nightly = Timetable("0 2 * * *", "Europe/Paris")
    summer = datetime(2026, 7, 1, 12, 0, tzinfo=UTC)
    assert nightly.latest(summer) == datetime(2026, 7, 1, 0, 0, tzinfo=UTC)  # 02:00 CEST
    assert nightly.following(summer) == datetime(2026, 7, 2, 0, 0, tzinfo=UTC)
    on_the_tick = datetime(2026, 1, 1, 0, 10, tzinfo=UTC)
    assert Timetable("*/5 * * * *").latest(on_the_tick) == on_the_tick


class Empty(BaseModel):
    pass


async def _noop(request: Empty, ctx) -> Empty:
    return request


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"schedule": "every night"}, "not a cron expression"),
        ({"schedule": "0 2 * * *", "schedule_tz": "Mars/Base"}, "no such time zone"),
    ],
)
def test_a_bad_schedule_is_refused_when_declared(options, message) -> None:
    with pytest.raises(ValueError, match=message):
        Workflow(name="bad", route="/v1/bad", request=Empty, result=Empty, step=_noop, **options)


def test_a_schedule_request_that_does_not_validate_is_refused() -> None:
    with pytest.raises(ValueError, match="schedule_request is no valid request"):
        Workflow(
            name="bad",
            route="/v1/bad",
            request=schedule_app.Tick,
            result=schedule_app.Ticked,
            step=schedule_app.tick,
            schedule="0 2 * * *",
        )
