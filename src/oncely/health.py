"""``/metrics``, ``/healthz`` and ``/readyz`` for the worker and the relay
(``ONCELY_METRICS_PORT``), on a small aiohttp server beside the process's loop.

- ``/healthz``: the process's loop made progress within ``stale_after_s``
  (a wedged loop answers 503, so an orchestrator restarts it).
- ``/readyz``: Redis and PostgreSQL answer (each bounded by ``timeout_s``);
  the relay's also says how it learns of new outbox rows (``wake_up``:
  ``notify``, or ``poll`` behind a transaction pooler with no direct URL).
  PostgreSQL's answer is its clock: a process more than a minute off it
  stays ready, its body saying so (``clock_offset_s``, ``warnings``;
  ``oncely.clock``).
- ``/metrics``: Prometheus text; the backlog gauges (streams, delayed and
  dead jobs, outbox) are read from the servers at most every
  ``backlog_every_s``, so a scraper cannot turn into load.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from psycopg_pool import AsyncConnectionPool

from oncely import clock, metrics, redis_client
from oncely.jobs.checkpoints import Checkpoints
from oncely.jobs.store import Jobs
from oncely.outbox.store import OutboxStore
from oncely.queue.stream import Stream
from oncely.redis_client import RedisClient
from oncely.services import Progress

log = structlog.get_logger("oncely.health")


@dataclass(frozen=True)
class HealthConfig:
    port: int
    host: str = "0.0.0.0"  # scraped from outside the container
    stale_after_s: float = 60.0
    timeout_s: float = 2.0
    backlog_every_s: float = 5.0
    # The relay's wake-up, "notify" or "poll" (None: not a relay).
    wake_up: str | None = None


class HealthServer:
    def __init__(
        self,
        config: HealthConfig,
        *,
        redis: RedisClient,
        pool: AsyncConnectionPool,
        streams: Sequence[Stream],
        loops: Sequence[Progress],
    ) -> None:
        self.config = config
        self.redis = redis
        self.pool = pool
        self.streams = streams
        self.loops = loops
        self._backlog_at = -config.backlog_every_s
        self._stopping = asyncio.Event()

    async def run(self) -> None:
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.config.host, self.config.port).start()
            log.info("health.listening", port=self.config.port)
            await self._stopping.wait()
        finally:
            await runner.cleanup()

    def stop(self) -> None:
        self._stopping.set()

    async def _healthz(self, _: web.Request) -> web.Response:
        stalest = max((p.age_s() for p in self.loops), default=0.0)
        alive = stalest < self.config.stale_after_s
        body = {"alive": alive, "last_progress_s": round(stalest, 3)}
        return web.json_response(body, status=200 if alive else 503)

    async def _readyz(self, _: web.Request) -> web.Response:
        reading = await self._clock()
        checks = {
            "redis": await self._answers(self._ping_redis),
            "postgres": reading is not None,
        }
        ready = all(checks.values())
        body: dict[str, object] = {"ready": ready, **checks}
        if self.config.wake_up is not None:
            body["wake_up"] = self.config.wake_up
        if reading is not None:
            body.update(reading.readiness())
        return web.json_response(body, status=200 if ready else 503)

    async def _clock(self) -> clock.ClockOffset | None:
        """PostgreSQL's clock against ours (None: it did not answer in time)."""
        try:
            async with asyncio.timeout(self.config.timeout_s):
                return await clock.measure(self.pool, timeout_s=self.config.timeout_s)
        except Exception:
            return None

    async def _metrics(self, _: web.Request) -> web.Response:
        if time.monotonic() - self._backlog_at >= self.config.backlog_every_s:
            self._backlog_at = time.monotonic()
            try:
                async with asyncio.timeout(self.config.timeout_s):
                    await self._read_backlog()
            except Exception as exc:  # a scrape must answer even with a server away
                log.warning("health.backlog_unavailable", error=f"{type(exc).__name__}: {exc}")
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _read_backlog(self) -> None:
        for stream in self.streams:
            s = await stream.stats()
            name = stream.keys.workflow
            metrics.STREAM_LENGTH.labels(workflow=name).set(s.length)
            metrics.STREAM_PENDING.labels(workflow=name).set(s.pending)
            metrics.STREAM_OLDEST_PENDING_AGE.labels(workflow=name).set(s.oldest_pending_age_s)
            metrics.DELAYED_JOBS.labels(workflow=name).set(s.delayed)
            metrics.DEAD_LETTER_BACKLOG.labels(workflow=name).set(s.dead_letters)
        waiting = await Checkpoints(Jobs(self.pool, {})).waiting_counts()
        for stream in self.streams:
            name = stream.keys.workflow
            metrics.JOBS_WAITING.labels(workflow=name).set(waiting.get(name, 0))
        outbox = await OutboxStore(self.pool, statement_timeout_s=self.config.timeout_s).counts()
        metrics.OUTBOX_UNSENT.set(outbox.unsent)
        metrics.OUTBOX_FAILED.set(outbox.failed)
        metrics.OUTBOX_OLDEST_UNSENT_AGE.set(outbox.oldest_unsent_age_s or 0.0)

    async def _answers(self, check: Callable[[], Awaitable[object]]) -> bool:
        try:
            async with asyncio.timeout(self.config.timeout_s):
                await check()
        except Exception:
            return False
        return True

    async def _ping_redis(self) -> None:
        if not await redis_client.ping(self.redis):
            raise RuntimeError("Redis answered the ping with something else")
