"""What the floors' own processes share (``bench.worker --floor-consumer``,
``bench.relay --minimal-relay``): a Postgres pool the size of oncely's, so
neither side wins on connections, batched writes in the background, and
running until the benchmark stops them."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

from psycopg_pool import AsyncConnectionPool

PG_POOL_MIN, PG_POOL_MAX = 1, 10  # oncely's defaults (Settings.pg_pool_min/max)


@contextlib.asynccontextmanager
async def pg_pool(database_url: str) -> AsyncIterator[AsyncConnectionPool]:
    """An autocommit pool, its first connections open before the floor starts."""
    p = AsyncConnectionPool(
        database_url,
        min_size=PG_POOL_MIN,
        max_size=PG_POOL_MAX,
        open=False,
        kwargs={"autocommit": True},
    )
    await p.open(wait=True)
    try:
        yield p
    finally:
        await p.close()


async def whenever_set(wanted: asyncio.Event, batch: Callable[[], Awaitable[None]]) -> None:
    """``batch`` each time ``wanted`` is set: what piles up while one batch
    runs goes in the next."""
    while True:
        await wanted.wait()
        wanted.clear()
        await batch()


async def until_stopped(work: Coroutine[Any, Any, None]) -> None:
    """``work`` until SIGTERM or SIGINT cancels it, so its ``finally`` runs."""
    task = asyncio.create_task(work)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await task
