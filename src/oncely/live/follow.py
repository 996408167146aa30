"""Following jobs' events from one API process (docs/streaming.md).

Many clients may watch many jobs; each open stream must not hold a Redis
connection of its own blocked in ``XREAD``. One reader task per workflow
(its jobs' keys share a slot) blocks in one ``XREAD`` over every watched
job's key, each after the last id it delivered, and hands what it read to
the watchers' queues. A watcher that joins is read from the next pass
(within ``block_ms``); what it needs from before, it reads itself first
(``JobEvents.after``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import structlog
from redis.exceptions import RedisError

from oncely import names
from oncely.live.events import JobEvent
from oncely.redis_client import RedisClient

log = structlog.get_logger(__name__)


@dataclass
class _Watch:
    last: str
    queues: set[asyncio.Queue[JobEvent]] = field(default_factory=set)


class Followers:
    """Every job this process's clients watch, read by one task per workflow."""

    def __init__(self, redis: RedisClient, *, block_ms: int = 250) -> None:
        self.redis = redis
        self.block_ms = block_ms
        # workflow -> job key -> its watch
        self._watched: dict[str, dict[str, _Watch]] = {}
        self._readers: dict[str, asyncio.Task[None]] = {}

    @contextlib.asynccontextmanager
    async def watch(
        self, workflow: str, job_id: str, after: str
    ) -> AsyncIterator[asyncio.Queue[JobEvent]]:
        """A queue of the job's events after ``after``, for the block."""
        key = names.job_events(workflow, job_id)
        queue: asyncio.Queue[JobEvent] = asyncio.Queue()
        watched = self._watched.setdefault(workflow, {})
        watch = watched.get(key)
        if watch is None:
            watch = watched[key] = _Watch(after)
        elif _newer(watch.last, after):
            # Another watcher is further behind: read from the earlier id.
            watch.last = after
        watch.queues.add(queue)
        self._start(workflow)
        try:
            yield queue
        finally:
            watch.queues.discard(queue)
            if not watch.queues:
                watched.pop(key, None)

    def _start(self, workflow: str) -> None:
        reader = self._readers.get(workflow)
        if reader is None or reader.done():
            self._readers[workflow] = asyncio.ensure_future(self._read(workflow))

    async def _read(self, workflow: str) -> None:
        watched = self._watched.setdefault(workflow, {})
        while watched:
            streams: dict[Any, Any] = {key: watch.last for key, watch in watched.items()}
            try:
                found: Any = await self.redis.xread(streams, block=self.block_ms)
            except RedisError as exc:
                log.info("live.read_failed", workflow=workflow, error=type(exc).__name__)
                await asyncio.sleep(self.block_ms / 1000)
                continue
            for key, entries in found or ():
                watch = watched.get(_text(key))
                if watch is None:
                    continue
                for entry_id, fields in entries:
                    event = JobEvent.of(entry_id, fields)
                    if not _newer(event.id, watch.last):
                        continue
                    watch.last = event.id
                    for queue in watch.queues:
                        queue.put_nowait(event)

    async def aclose(self) -> None:
        for reader in self._readers.values():
            reader.cancel()
        for reader in self._readers.values():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
        self._readers.clear()


def _newer(a: str, b: str) -> bool:
    """Whether entry id ``a`` comes after ``b``."""
    return _id(a) > _id(b)


def _id(entry: str) -> tuple[int, int]:
    ms, _, seq = entry.partition("-")
    return int(ms or 0), int(seq or 0)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
