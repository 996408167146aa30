"""Following jobs' events from one API process (docs/streaming.md).

Many clients may watch many jobs; each open stream must not hold a Redis
connection of its own blocked in ``XREAD``. One reader task per workflow
(its jobs' keys share a slot) blocks in one ``XREAD`` over every watched
job's key, each after the last id it delivered, and hands what it read to
the watchers. A watcher that joins is read from the next pass (within
``block_ms``); what it needs from before, it reads itself first
(``JobEvents.after``).

The reader is shared, so nothing one watcher brings may stop it for the
others: a resume id that is no event id is refused before it is watched
(``live.events.event_id``); a key Redis refuses to read, or an entry that
does not decode, cuts off that key's watchers alone (``live.watch_failed``);
a reader that fails anyway is logged (``live.reader_failed``) and started
again while anyone watches. A watcher holds at most ``limit`` events its
stream has not sent: past that it is cut off too (``live.watch_overflowed``),
so a slow client costs the process a bounded amount of memory.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import structlog
from redis.exceptions import RedisError, ResponseError

from oncely import names
from oncely.live.events import JobEvent, event_id
from oncely.logs import frames
from oncely.redis_client import RedisClient

log = structlog.get_logger(__name__)

# The events a watcher may hold unsent before it is cut off.
WATCHER_LIMIT = 1000


@dataclass(eq=False)
class Watcher:
    """One stream's share of a job's events. ``None`` comes last when the
    reader stopped feeding it (cut off): its stream ends, and its client
    resumes after the last event it got."""

    limit: int = WATCHER_LIMIT
    queue: asyncio.Queue[JobEvent | None] = field(default_factory=asyncio.Queue)
    cut: bool = False

    def offer(self, event: JobEvent) -> bool:
        """Queue ``event``; False (and cut off) when the stream is too far behind."""
        if self.cut:
            return True
        if self.queue.qsize() >= self.limit:
            self.cut_off()
            return False
        self.queue.put_nowait(event)
        return True

    def cut_off(self) -> None:
        if not self.cut:
            self.cut = True
            self.queue.put_nowait(None)


@dataclass
class _Watch:
    last: str
    watchers: set[Watcher] = field(default_factory=set)


class Followers:
    """Every job this process's clients watch, read by one task per workflow."""

    def __init__(
        self, redis: RedisClient, *, block_ms: int = 250, limit: int = WATCHER_LIMIT
    ) -> None:
        self.redis = redis
        self.block_ms = block_ms
        self.limit = limit
        # workflow -> job key -> its watch
        self._watched: dict[str, dict[str, _Watch]] = {}
        self._readers: dict[str, asyncio.Task[None]] = {}
        self._closed = False

    @contextlib.asynccontextmanager
    async def watch(self, workflow: str, job_id: str, after: str) -> AsyncIterator[Watcher]:
        """The job's events after ``after`` (an event id, else ValueError),
        for the block."""
        last = event_id(after)
        if last is None:
            raise ValueError("not an event id")
        key = names.job_events(workflow, job_id)
        watcher = Watcher(self.limit)
        watched = self._watched.setdefault(workflow, {})
        watch = watched.get(key)
        if watch is None:
            watch = watched[key] = _Watch(last)
        elif _newer(watch.last, last):
            # Another watcher is further behind: read from the earlier id.
            watch.last = last
        watch.watchers.add(watcher)
        self._start(workflow)
        try:
            yield watcher
        finally:
            watch.watchers.discard(watcher)
            if not watch.watchers and watched.get(key) is watch:
                del watched[key]

    def _start(self, workflow: str) -> None:
        reader = self._readers.get(workflow)
        if self._closed or (reader is not None and not reader.done()):
            return
        reader = asyncio.ensure_future(self._read(workflow))
        reader.add_done_callback(partial(self._reader_ended, workflow))
        self._readers[workflow] = reader

    def _reader_ended(self, workflow: str, reader: asyncio.Task[None]) -> None:
        if reader.cancelled() or reader.exception() is None:
            return
        exc = reader.exception()
        assert exc is not None
        log.error(
            "live.reader_failed", workflow=workflow, error=type(exc).__name__, where=frames(exc)
        )
        # Its watchers still wait: a new reader, a pass later (a reader that
        # fails at once must not spin).
        loop = asyncio.get_running_loop()
        loop.call_later(self.block_ms / 1000, self._restart, workflow)

    def _restart(self, workflow: str) -> None:
        if self._watched.get(workflow):
            log.info("live.reader_restarted", workflow=workflow)
            self._start(workflow)

    async def _read(self, workflow: str) -> None:
        watched = self._watched.setdefault(workflow, {})
        while watched:
            streams: dict[Any, Any] = {key: watch.last for key, watch in watched.items()}
            try:
                found: Any = await self.redis.xread(streams, block=self.block_ms)
            except ResponseError as exc:
                # Redis refused the read: one key's doing, which must not
                # silence the others.
                if not await self._drop_unreadable(workflow, watched):
                    log.info("live.read_failed", workflow=workflow, error=type(exc).__name__)
                    await asyncio.sleep(self.block_ms / 1000)
                continue
            except RedisError as exc:
                log.info("live.read_failed", workflow=workflow, error=type(exc).__name__)
                await asyncio.sleep(self.block_ms / 1000)
                continue
            for key, entries in found or ():
                self._hand_out(workflow, watched, _text(key), entries)

    async def _drop_unreadable(self, workflow: str, watched: dict[str, _Watch]) -> bool:
        """Each key read alone; the watchers of those Redis refuses are cut
        off. Whether any was."""
        dropped = False
        for key, watch in list(watched.items()):
            try:
                await self.redis.xread({key: watch.last}, count=1)
            except ResponseError as exc:
                self._drop(workflow, watched, key, type(exc).__name__)
                dropped = True
            except RedisError:
                break  # Redis itself is away: the next pass says so.
        return dropped

    def _hand_out(self, workflow: str, watched: dict[str, _Watch], key: str, entries: Any) -> None:
        watch = watched.get(key)
        if watch is None:
            return
        for entry_id, fields in entries:
            try:
                event = JobEvent.of(entry_id, fields)
            except ValueError as exc:
                # Not an event this module wrote: the job's stream cannot go on.
                self._drop(workflow, watched, key, type(exc).__name__)
                return
            if not _newer(event.id, watch.last):
                continue
            watch.last = event.id
            for watcher in list(watch.watchers):
                if not watcher.offer(event):
                    log.info("live.watch_overflowed", workflow=workflow, limit=watcher.limit)

    @staticmethod
    def _drop(workflow: str, watched: dict[str, _Watch], key: str, error: str) -> None:
        watch = watched.pop(key, None)
        log.warning("live.watch_failed", workflow=workflow, error=error)
        for watcher in watch.watchers if watch is not None else ():
            watcher.cut_off()

    async def aclose(self) -> None:
        self._closed = True
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
