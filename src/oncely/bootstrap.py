"""The composition root: settings in, live clients and pools out."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass

import structlog
import uvicorn
from psycopg_pool import AsyncConnectionPool
from redis.asyncio import Redis

from oncely.llm.base import LLM
from oncely.llm.limiter import FleetLimiter, LimitedLLM, Limits
from oncely.outbox.relay import Relay, RelayConfig
from oncely.outbox.store import OutboxStore
from oncely.queue.reconcile import Reconciler
from oncely.queue.stream import Stream
from oncely.queue.worker import Worker, WorkerConfig
from oncely.senders import build_sender
from oncely.senders.base import Sender
from oncely.settings import Settings
from oncely.workflow import SummaryJob, mark_dead

log = structlog.get_logger("oncely.process")


@dataclass(frozen=True)
class Resources:
    settings: Settings
    redis: Redis
    pool: AsyncConnectionPool


def require_urls(settings: Settings) -> tuple[str, str]:
    if not settings.redis_url or not settings.database_url:
        raise SystemExit(
            "set ONCELY_REDIS_URL and ONCELY_DATABASE_URL (or run `oncely dev`, "
            "which starts embedded servers)"
        )
    return settings.redis_url, settings.database_url


def make_redis(url: str) -> Redis:
    return Redis.from_url(url, decode_responses=True, health_check_interval=30)


@asynccontextmanager
async def open_resources(settings: Settings) -> AsyncIterator[Resources]:
    redis_url, database_url = require_urls(settings)
    redis = make_redis(redis_url)
    pool = AsyncConnectionPool(
        database_url,
        min_size=settings.pg_pool_min,
        max_size=settings.pg_pool_max,
        open=False,
        timeout=10,
        # Each statement commits on its own unless code opens
        # ``conn.transaction()``: no BEGIN/COMMIT round trips for single
        # statements, which is every hot-path write.
        kwargs={"autocommit": True},
    )
    await pool.open(wait=True, timeout=10)
    try:
        yield Resources(settings, redis, pool)
    finally:
        await pool.close()
        await redis.aclose()


@contextmanager
def stop_on_signals(*stops: Callable[[], object]) -> Iterator[None]:
    """SIGTERM and SIGINT call every ``stop``: services finish what they hold."""
    loop = asyncio.get_running_loop()

    def stop_all() -> None:
        log.info("process.stopping")
        for stop in stops:
            stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_all)
    try:
        yield
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


class _QuietServer(uvicorn.Server):
    """uvicorn without its own signal handlers: ``stop_on_signals`` owns them,
    so one Ctrl-C stops the API and every other service in the process."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class ApiServer:
    def __init__(self, res: Resources, *, host: str, port: int) -> None:
        from oncely.api.app import create_app

        app = create_app(res.settings, redis=res.redis, pool=res.pool)
        config = uvicorn.Config(
            app, host=host, port=port, log_config=None, access_log=False, lifespan="off"
        )
        self._server = _QuietServer(config)

    async def run(self) -> None:
        await self._server.serve()

    def stop(self) -> None:
        self._server.should_exit = True


async def serve_api(settings: Settings, *, host: str, port: int) -> None:
    async with open_resources(settings) as res:
        server = ApiServer(res, host=host, port=port)
        with stop_on_signals(server.stop):
            await server.run()


def build_worker(res: Resources, llm: LLM) -> Worker:
    s = res.settings
    config = WorkerConfig(
        concurrency=s.worker_concurrency,
        claim_idle_ms=s.claim_idle_ms,
        max_deliveries=s.max_deliveries,
        block_ms=s.block_ms,
        shutdown_grace_s=s.shutdown_grace_s,
        trim_every_s=s.stream_trim_every_s,
    )

    async def on_dead(job_id: str, reason: str) -> None:
        await mark_dead(res.pool, job_id, reason)

    limits = Limits(rpm=s.llm_rpm, tpm=s.llm_tpm, pause_max_s=s.llm_retry_after_max_s)
    limited = LimitedLLM(llm, FleetLimiter(res.redis, limits))
    handler = SummaryJob(res.pool, limited, s)
    return Worker(Stream(res.redis), handler, config, on_dead=on_dead)


async def run_worker(settings: Settings) -> None:
    from oncely.llm.openai_compat import OpenAICompatible

    async with open_resources(settings) as res, OpenAICompatible.from_settings(settings) as llm:
        worker = build_worker(res, llm)
        reconciler = build_reconciler(res)
        with stop_on_signals(worker.stop, reconciler.stop):
            await asyncio.gather(worker.run(), reconciler.run())


def build_reconciler(res: Resources) -> Reconciler:
    return Reconciler(res.pool, Stream(res.redis), after_s=res.settings.reconcile_after_s)


async def create_key(settings: Settings, tenant: str) -> str:
    from oncely.api.auth import create_api_key

    async with open_resources(settings) as res:
        return await create_api_key(res.pool, tenant)


async def revoke_key(settings: Settings, key: str) -> str | None:
    from oncely.api.auth import revoke_api_key

    async with open_resources(settings) as res:
        return await revoke_api_key(res.pool, key)


async def run_relay(settings: Settings) -> None:
    async with open_resources(settings) as res:
        relay, sender = build_relay(res)
        try:
            with stop_on_signals(relay.stop):
                await relay.run()
        finally:
            await sender.aclose()


def build_relay(res: Resources) -> tuple[Relay, Sender]:
    """The relay and its sender; the caller closes the sender after the relay stops."""
    sender = build_sender(res.settings)
    relay = Relay(
        OutboxStore(res.pool),
        sender,
        RelayConfig.from_settings(res.settings),
        database_url=res.settings.database_url,
    )
    return relay, sender
