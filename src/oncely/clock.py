"""This process's clock against PostgreSQL's (docs/production.md, Clocks).

Decisions that several processes share (a lease's end, a due time, a
schedule's tick, a job's age) are taken in SQL on PostgreSQL's clock. A
host's own clock still shows where it leaves the process: a webhook's
``webhook-timestamp`` is the relay's clock, and receivers refuse one more
than a few minutes off theirs. So every long-running process measures how
far its clock is from PostgreSQL's (one ``SELECT clock_timestamp()``, half
its round trip added to the local reading) at start and every
``ClockWatch.every_s``: ``oncely_clock_offset_seconds`` says it, a warning
``clock.skewed`` when it is more than ``SKEW_WARN_S`` off, ``/readyz``
says it in its body (still 200: a process with a skewed clock still
works), and ``oncely status`` lists each process whose last report was off.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import structlog
from psycopg_pool import AsyncConnectionPool

from oncely import metrics, names
from oncely.redis_client import RedisClient
from oncely.sql.bounded import run_statement

log = structlog.get_logger("oncely.clock")

SKEW_WARN_S = 60.0
# A process's report older than this is gone from `oncely status` (and Redis).
REPORT_KEPT_S = 900.0


def local_now() -> datetime:
    """This process's wall clock: the one seam tests shift."""
    return datetime.now(UTC)


@dataclass(frozen=True)
class ClockOffset:
    """This process's clock minus PostgreSQL's (positive: ahead), give or
    take ``uncertainty_s`` (half the round trip that measured it)."""

    offset_s: float
    uncertainty_s: float = 0.0

    @property
    def skewed(self) -> bool:
        return abs(self.offset_s) - self.uncertainty_s > SKEW_WARN_S

    def warning(self, whose: str = "this process's clock") -> str:
        way = "ahead of" if self.offset_s > 0 else "behind"
        return (
            f"{whose} is {abs(self.offset_s):.0f} s {way} PostgreSQL's (more than "
            f"{SKEW_WARN_S:.0f} s): sync it (NTP, chrony); webhook timestamps come from "
            "the relay's clock (docs/production.md, Clocks)"
        )

    def readiness(self) -> dict[str, object]:
        """What a ``/readyz`` body adds for a skewed clock (nothing otherwise)."""
        if not self.skewed:
            return {}
        return {"clock_offset_s": round(self.offset_s, 1), "warnings": [self.warning()]}


async def measure(pool: AsyncConnectionPool, *, timeout_s: float) -> ClockOffset:
    """One reading (raises what the statement raises); the gauge set."""
    started = time.monotonic()
    local = local_now()
    result = await run_statement(pool, "SELECT clock_timestamp()", timeout_s=timeout_s)
    half_trip = (time.monotonic() - started) / 2
    server: datetime = result.rows[0][0]
    offset = (local + timedelta(seconds=half_trip) - server).total_seconds()
    metrics.CLOCK_OFFSET.set(offset)
    return ClockOffset(offset, half_trip)


def process_name(kind: str) -> str:
    """``<kind>@<host>:<pid>``: which process a report is from."""
    return f"{kind}@{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True)
class ProcessClock:
    """One process's last report: its name, its offset, and when
    (PostgreSQL's time, seconds since the epoch)."""

    process: str
    offset_s: float
    at: float


class ClockWatch:
    """A service: measures at start and every ``every_s``; warns
    (``clock.skewed``) when the clock is off, says once when it is back
    (``clock.synced``); reports each reading to Redis for ``oncely status``
    (``names.CLOCK_OFFSETS``), and takes its report away when stopped. A
    reading that fails (a server away) is skipped: other parts say so."""

    def __init__(
        self,
        pool: AsyncConnectionPool,
        redis: RedisClient,
        process: str,
        *,
        every_s: float = 300.0,
        timeout_s: float = 5.0,
    ) -> None:
        self.pool = pool
        self.redis = redis
        self.process = process
        self.every_s = every_s
        self.timeout_s = timeout_s
        self.last: ClockOffset | None = None
        self._stopping = asyncio.Event()

    async def run(self) -> None:
        try:
            while not self._stopping.is_set():
                await self.check()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), self.every_s)
        finally:
            with contextlib.suppress(Exception):
                await self.redis.hdel(names.CLOCK_OFFSETS, self.process)

    def stop(self) -> None:
        self._stopping.set()

    async def check(self) -> ClockOffset | None:
        """Measure, say, report; the reading (None: it could not be taken)."""
        try:
            reading = await measure(self.pool, timeout_s=self.timeout_s)
        except Exception as exc:  # the servers' own checks say why
            log.debug("clock.unmeasured", error=type(exc).__name__)
            return None
        self.note(reading)
        with contextlib.suppress(Exception):  # Redis away: the next round reports
            await self._report(reading)
        return reading

    def note(self, reading: ClockOffset) -> None:
        """A warning while skewed (each reading: every ``every_s``), one line
        when back in sync."""
        was = self.last
        self.last = reading
        if reading.skewed:
            log.warning(
                "clock.skewed",
                offset_s=round(reading.offset_s, 3),
                limit_s=SKEW_WARN_S,
                hint=reading.warning(),
            )
        elif was is not None and was.skewed:
            log.info("clock.synced", offset_s=round(reading.offset_s, 3))

    async def _report(self, reading: ClockOffset) -> None:
        at = (local_now() - timedelta(seconds=reading.offset_s)).timestamp()
        value = json.dumps({"offset_s": round(reading.offset_s, 3), "at": round(at, 3)})
        await self.redis.hset(names.CLOCK_OFFSETS, self.process, value)
        stale = [p.process for p in await read_reports(self.redis) if at - p.at > REPORT_KEPT_S]
        if stale:
            await self.redis.hdel(names.CLOCK_OFFSETS, *stale)


async def read_reports(redis: RedisClient) -> list[ProcessClock]:
    """Every process's last report, by name (unreadable ones left out)."""
    found = []
    raw = await redis.hgetall(names.CLOCK_OFFSETS)
    for process, value in sorted((str(k), str(v)) for k, v in raw.items()):
        with contextlib.suppress(ValueError, KeyError, TypeError):
            parsed = json.loads(value)
            found.append(ProcessClock(process, float(parsed["offset_s"]), float(parsed["at"])))
    return found


def recent(reports: list[ProcessClock], now: float) -> list[ProcessClock]:
    """Reports younger than ``REPORT_KEPT_S`` at ``now`` (PostgreSQL's time)."""
    return [r for r in reports if now - r.at <= REPORT_KEPT_S]
