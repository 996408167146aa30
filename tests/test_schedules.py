"""Schedules (docs/fanout.md, Schedules): exactly one job per tick across
the fleet, however many processes look; the latest missed tick once after
every process was down (or none); what ``oncely schedules list`` shows.
Several schedulers (as in several worker processes) share real PostgreSQL
and Redis; time is a clock the test moves."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from pydantic import BaseModel

from oncely import Workflow
from oncely.identity import Scope
from oncely.jobs.schedules import Scheduled, Scheduler, scheduled
from oncely.jobs.store import Jobs
from oncely.queue.stream import Stream
from oncely.timetable import Timetable
from tests import schedule_app
from tests.helpers import rows

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


def fleet(jobs: Jobs, clock: Callable[[], datetime], n: int = 3, **options) -> list[Scheduler]:
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


async def test_a_nightly_schedule_runs_once_per_local_day_across_both_dst_nights(
    jobs, pool
) -> None:
    """``0 2 * * *`` in Europe/Paris through 2026: the night clocks go
    forward, 02:00 does not exist and the job runs at the jump (03:00
    CEST); the night they go back, 02:00 occurs twice and the job runs
    once, at the first. One job per local day, every day."""
    paris = ZoneInfo("Europe/Paris")
    nightly = Scheduled(
        "every_second",
        "/v1/every-second",
        Timetable("0 2 * * *", "Europe/Paris"),
        schedule_app.every_second.scheduled_request,
    )
    clock = Clock(datetime(2026, 3, 28, 12, 0, tzinfo=UTC))
    schedulers = [Scheduler(jobs, [nightly], clock=clock) for _ in range(2)]
    await pass_of(schedulers)
    nights = [datetime(2026, 3, 29, tzinfo=UTC), datetime(2026, 10, 25, tzinfo=UTC)]
    while clock.now < datetime(2026, 10, 27, 12, 0, tzinfo=UTC):
        # Every ten minutes through the two nights, once a day between them.
        close = any(abs(clock.now - night) <= timedelta(days=1) for night in nights)
        clock.now += timedelta(minutes=10) if close else timedelta(days=1)
        await pass_of(schedulers)
    ticks = [datetime.fromisoformat(p["at"]) for _, _, p in await scheduled_jobs(pool)]
    local_days = [t.astimezone(paris).date() for t in ticks]
    assert len(local_days) == len(set(local_days)) == 213, "one job per local day"
    assert local_days[0].isoformat() == "2026-03-29"
    assert local_days[-1].isoformat() == "2026-10-27"
    assert datetime(2026, 3, 29, 1, 0, tzinfo=UTC) in ticks, "03:00 CEST, when clocks jump"
    assert datetime(2026, 10, 25, 0, 0, tzinfo=UTC) in ticks, "02:00 CEST, the first 02:00"
    assert datetime(2026, 10, 25, 1, 0, tzinfo=UTC) not in ticks, "02:00 CET is a repeat"
    assert {t.astimezone(paris).hour for t in ticks} == {2, 3}
    assert [t for t in ticks if t.astimezone(paris).hour == 3] == [
        datetime(2026, 3, 29, 1, 0, tzinfo=UTC)
    ]


def test_an_hourly_timetable_keeps_both_passes_of_the_repeated_hour() -> None:
    """A wildcard hour runs by elapsed time, as cron's do: the night clocks
    go back, ``0 * * * *`` in Paris ticks every real hour (02:00 twice);
    the night they go forward, 02:00 is the same moment as 03:00."""
    hourly = Timetable("0 * * * *", "Europe/Paris")
    back, tick = [], datetime(2026, 10, 24, 22, 30, tzinfo=UTC)
    for _ in range(4):
        tick = hourly.following(tick)
        back.append(tick.hour)
    assert back == [23, 0, 1, 2]  # 01:00 CEST, 02:00 CEST, 02:00 CET, 03:00 CET
    forward, tick = [], datetime(2026, 3, 28, 23, 30, tzinfo=UTC)
    for _ in range(3):
        tick = hourly.following(tick)
        forward.append(tick.hour)
    assert forward == [0, 1, 2]  # 01:00 CET, 03:00 CEST, 04:00 CEST


async def test_a_process_whose_clock_runs_ahead_starts_no_tick_early(jobs, pool) -> None:
    """One process's clock a minute ahead: it claims no tick PostgreSQL's
    clock has not reached, and moves the schedule past none, so a process
    with the right time goes on starting every next tick."""

    def ahead() -> datetime:
        return datetime.now(UTC) + timedelta(seconds=60)

    [skewed] = fleet(jobs, ahead, n=1)
    [right] = fleet(jobs, lambda: datetime.now(UTC), n=1)
    first = await started_by(skewed)
    assert first <= await database_now(pool), "no tick ahead of PostgreSQL's clock"
    [(last_tick,)] = await rows(pool, "SELECT last_tick FROM schedules")
    assert last_tick <= await database_now(pool)
    second = await started_by(right)
    assert first < second <= await database_now(pool)
    ticks = [datetime.fromisoformat(p["at"]) for _, _, p in await scheduled_jobs(pool)]
    assert ticks == [first, second]


async def started_by(scheduler: Scheduler) -> datetime:
    """The tick of the first job ``scheduler`` starts (real time, ticking
    every second)."""
    deadline = asyncio.get_running_loop().time() + 30
    while asyncio.get_running_loop().time() < deadline:
        for job in await scheduler.run_once():
            return datetime.fromisoformat(job.payload["at"])
        await asyncio.sleep(0.05)
    raise AssertionError("no tick started in 30 s")


async def database_now(pool) -> datetime:
    [(now,)] = await rows(pool, "SELECT now()")
    return now


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
    # Which field and why ("at" has no default and none was given).
    with pytest.raises(
        ValueError, match=r"schedule_request is no valid request \(at: Field required\)"
    ):
        Workflow(
            name="bad",
            route="/v1/bad",
            request=schedule_app.Tick,
            result=schedule_app.Ticked,
            step=schedule_app.tick,
            schedule="0 2 * * *",
        )
