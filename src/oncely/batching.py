"""Group commit: many concurrent callers, one round trip per burst.

The first caller starts a flush; callers arriving while it runs queue up and
go together in the next one. Nothing waits on a timer, so a lone caller pays
no latency, and under load one Redis or Postgres call serves many jobs. The
worker's acknowledgements, the relay's "sent" marks (``GroupCommit``),
the loads of the runs deliveries resume from, the runs' checkpoint writes
and the jobs' results (``GroupRead``, a write's answer its outcome) all use
it. A batch that fails for one item's fault is split (``each_at_fault``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class GroupRead(Generic[T, K, V]):
    """``await read(item)`` is the value the batch ``flush`` answered for the
    item's key, or None when it answered none."""

    def __init__(
        self, flush: Callable[[list[T]], Awaitable[Mapping[K, V]]], key: Callable[[T], K]
    ) -> None:
        self._flush = flush
        self._key = key
        self._queued: list[tuple[T, asyncio.Future[V | None]]] = []
        # A task, not the first caller: a caller cancelled mid-flush must not
        # strand the others queued behind it.
        self._flusher: asyncio.Task[None] | None = None
        self.flushes = 0

    async def read(self, item: T) -> V | None:
        answer: asyncio.Future[V | None] = asyncio.get_running_loop().create_future()
        self._queued.append((item, answer))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.ensure_future(self._flush_queued())
        return await answer

    async def drain(self) -> None:
        """Wait until everything queued so far is flushed."""
        while self._flusher is not None and not self._flusher.done():
            await asyncio.shield(self._flusher)

    async def _flush_queued(self) -> None:
        while self._queued:
            batch, self._queued = self._queued, []
            self.flushes += 1
            try:
                answers = await self._flush([item for item, _ in batch])
            except Exception as exc:
                for _, answer in batch:
                    if not answer.done():
                        answer.set_exception(exc)
                continue
            for item, answer in batch:
                if not answer.done():
                    answer.set_result(answers.get(self._key(item)))


class GroupCommit(GroupRead[T, K, bool]):
    """``await commit(item)`` is True when the batch ``flush`` reported the
    item's key among the ones it succeeded for."""

    def __init__(
        self, flush: Callable[[list[T]], Awaitable[set[K]]], key: Callable[[T], K]
    ) -> None:
        async def succeeded(items: list[T]) -> Mapping[K, bool]:
            return dict.fromkeys(await flush(items), True)

        super().__init__(succeeded, key)

    async def __call__(self, item: T) -> bool:
        return await self.read(item) is True


async def each_at_fault(
    flush: Callable[[list[T]], Awaitable[Mapping[int, V]]],
    items: list[T],
    faults: tuple[type[Exception], ...],
) -> dict[int, V | Exception]:
    """``flush(items)``, answering by each item's ``id``. When the batch
    fails with one of ``faults`` (an item's own fault: a key taken, a value
    the database refuses), the items go again in halves, so that only the
    one at fault gets its error, in a few flushes more."""
    try:
        return dict(await flush(items))
    except faults as exc:
        if len(items) == 1:
            return {id(items[0]): exc}
        half = len(items) // 2
        return await each_at_fault(flush, items[:half], faults) | await each_at_fault(
            flush, items[half:], faults
        )
