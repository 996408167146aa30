"""A process's clock against PostgreSQL's (docs/production.md, "Clocks"):
more than a minute off, ``/readyz`` (the API's and the metrics port's) says
so while staying ready, the process warns, and ``oncely status`` names the
process. The process's notion of the time is shifted through its one seam,
``oncely.clock.local_now``."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import timedelta

import httpx
import pytest
from psycopg_pool import AsyncConnectionPool
from structlog.testing import capture_logs

from oncely import clock, names
from oncely.cli.ops import show_status
from oncely.health import HealthConfig, HealthServer
from oncely.redis_client import RedisClient
from oncely.settings import Settings
from oncely.usage.ledger import Ledger
from tests.processes import free_port, wait_for

real_now = clock.local_now


def shift(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    monkeypatch.setattr(clock, "local_now", lambda: real_now() + timedelta(seconds=seconds))


async def test_a_clock_in_sync_is_measured_near_zero(pool: AsyncConnectionPool) -> None:
    reading = await clock.measure(pool, timeout_s=5)
    assert abs(reading.offset_s) < 5
    assert not reading.skewed
    assert reading.readiness() == {}


@pytest.mark.parametrize(("seconds", "way"), [(120, "ahead of"), (-90, "behind")])
async def test_a_clock_more_than_a_minute_off_is_skewed(
    pool: AsyncConnectionPool, monkeypatch: pytest.MonkeyPatch, seconds: float, way: str
) -> None:
    shift(monkeypatch, seconds)
    reading = await clock.measure(pool, timeout_s=5)
    assert reading.offset_s == pytest.approx(seconds, abs=5)
    assert reading.skewed
    assert f"{abs(seconds)} s {way} PostgreSQL's" in reading.warning()


def test_half_a_minute_off_or_an_uncertain_reading_is_not_skewed() -> None:
    assert not clock.ClockOffset(30.0).skewed
    # 61 s measured over a 4 s round trip: it may be 59 s.
    assert not clock.ClockOffset(61.0, uncertainty_s=2.0).skewed
    assert clock.ClockOffset(-61.0).skewed


async def test_the_apis_readyz_stays_ready_and_says_the_clock_is_off(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    shift(monkeypatch, 150)
    ready = await client.get("/readyz")
    assert ready.status_code == 200
    body = ready.json()
    assert (body["ready"], body["redis"], body["postgres"]) == (True, True, True)
    assert body["clock_offset_s"] == pytest.approx(150, abs=5)
    assert "NTP" in body["warnings"][0]


async def test_the_metrics_ports_readyz_says_the_clock_is_off(
    redis: RedisClient, pool: AsyncConnectionPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    server = HealthServer(HealthConfig(port=port), redis=redis, pool=pool, streams=[], loops=[])
    running = asyncio.create_task(server.run())
    url = f"http://127.0.0.1:{port}/readyz"
    try:

        async def answers() -> bool:
            try:
                async with httpx.AsyncClient() as c:
                    return (await c.get(url)).status_code == 200
            except httpx.TransportError:
                return False

        await wait_for(answers, what="the health server")
        async with httpx.AsyncClient() as c:
            in_sync = (await c.get(url)).json()
            shift(monkeypatch, -200)
            skewed = await c.get(url)
    finally:
        server.stop()
        await running
    assert in_sync == {"ready": True, "redis": True, "postgres": True}
    assert skewed.status_code == 200
    assert skewed.json()["clock_offset_s"] == pytest.approx(-200, abs=5)
    assert "behind PostgreSQL's" in skewed.json()["warnings"][0]


async def test_a_process_warns_reports_and_says_when_back_in_sync(
    redis: RedisClient, pool: AsyncConnectionPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    watch = clock.ClockWatch(pool, redis, "relay@host-b:42")
    shift(monkeypatch, 95)
    with capture_logs() as logs:
        await watch.check()
        monkeypatch.setattr(clock, "local_now", real_now)
        await watch.check()
    events = [(e["event"], e["log_level"]) for e in logs]
    assert events == [("clock.skewed", "warning"), ("clock.synced", "info")]
    assert logs[0]["offset_s"] == pytest.approx(95, abs=5)
    (report,) = await clock.read_reports(redis)
    assert report.process == "relay@host-b:42"
    assert abs(report.offset_s) < 5, "the latest reading replaces the earlier one"


async def test_a_stopped_process_takes_its_report_away(
    redis: RedisClient, pool: AsyncConnectionPool
) -> None:
    watch = clock.ClockWatch(pool, redis, "worker@host-a:7")
    running = asyncio.create_task(watch.run())

    async def reported() -> bool:
        return bool(await redis.hexists(names.CLOCK_OFFSETS, "worker@host-a:7"))

    await wait_for(reported, what="the process's report")
    watch.stop()
    await running
    assert not await reported()


async def test_oncely_status_names_the_process_whose_clock_is_off(
    settings: Settings,
    redis: RedisClient,
    pool: AsyncConnectionPool,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    shift(monkeypatch, 130)
    await clock.ClockWatch(pool, redis, "relay@host-b:42").check()
    await redis.hset(names.CLOCK_OFFSETS, "relay@gone:1", json.dumps({"offset_s": 500, "at": 0}))
    monkeypatch.setattr(clock, "local_now", real_now)
    await clock.ClockWatch(pool, redis, "worker@host-a:7").check()

    await show_status(settings, as_json=True)
    out = capsys.readouterr().out  # after any log lines (structlog's default: stdout)
    clocks = json.loads(out[out.index("{\n") :])["clocks"]
    assert abs(clocks["offset_s"]) < 5
    assert set(clocks["processes"]) == {"relay@host-b:42", "worker@host-a:7"}, "stale ones left"
    (warning,) = clocks["warnings"]
    assert "the clock of relay@host-b:42 is 130 s ahead of PostgreSQL's" in warning

    await show_status(settings, as_json=False)
    text = capsys.readouterr().out
    assert "relay@host-b:42 is 130 s ahead" in text
    assert "worker@host-a:7" not in text


async def test_oncely_status_says_when_every_clock_is_in_sync(
    settings: Settings, capsys: pytest.CaptureFixture[str], redis: RedisClient
) -> None:
    await show_status(settings, as_json=False)
    assert "clocks: this machine's and 0 running processes' within 60 s" in capsys.readouterr().out


async def test_the_ledger_prunes_by_postgresqls_clock(
    pool: AsyncConnectionPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows past the retention by the server's ``now()``, whatever the
    pruning process's clock says: two days fast, it would prune both."""
    fast = time.time() + 2 * 86400
    monkeypatch.setattr(time, "time", lambda: fast)
    shift(monkeypatch, 2 * 86400)
    async with pool.connection() as conn:
        for age in ("2 days", "1 hour"):
            await conn.execute(
                "INSERT INTO model_calls (job_id, workflow, tenant, step, model, attempt,"
                " outcome, latency_ms, created_at) VALUES (gen_random_uuid(), 'w', 't', 's',"
                f" 'm', 1, 'ok', 5, now() - interval '{age}')"
            )
    assert await Ledger(pool, retention_s=86400.0).prune() == 1
    async with pool.connection() as conn:
        left = await (await conn.execute("SELECT now() - created_at FROM model_calls")).fetchall()
    assert [row[0] < timedelta(days=1) for row in left] == [True]
