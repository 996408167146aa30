"""The composition root: settings in, live clients and pools out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from psycopg_pool import AsyncConnectionPool
from redis.asyncio import Redis

from oncely.settings import Settings


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
    )
    await pool.open(wait=True, timeout=30)
    try:
        yield Resources(settings, redis, pool)
    finally:
        await pool.close()
        await redis.aclose()


async def serve_api(settings: Settings, *, host: str, port: int) -> None:
    async with open_resources(settings) as res:
        await _serve(res, host=host, port=port)


async def _serve(res: Resources, *, host: str, port: int) -> None:
    import uvicorn

    from oncely.api.app import create_app

    app = create_app(res.settings, redis=res.redis, pool=res.pool)
    config = uvicorn.Config(
        app, host=host, port=port, log_config=None, access_log=False, lifespan="off"
    )
    await uvicorn.Server(config).serve()


async def create_key(settings: Settings, tenant: str) -> str:
    from oncely.api.auth import create_api_key

    async with open_resources(settings) as res:
        return await create_api_key(res.pool, tenant)


async def revoke_key(settings: Settings, key: str) -> str | None:
    from oncely.api.auth import revoke_api_key

    async with open_resources(settings) as res:
        return await revoke_api_key(res.pool, key)
