"""Group commit: one flush per burst, errors to every waiter, no stranded caller."""

from __future__ import annotations

import asyncio

import pytest

from oncely.batching import GroupCommit


class Recorder:
    def __init__(self, gate: asyncio.Event | None = None, fail: bool = False) -> None:
        self.batches: list[list[int]] = []
        self.gate = gate
        self.fail = fail

    async def flush(self, items: list[int]) -> set[int]:
        self.batches.append(items)
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise ConnectionError("store away")
        return {i for i in items if i % 2 == 0}


async def test_callers_arriving_during_a_flush_share_the_next_one():
    gate = asyncio.Event()
    recorder = Recorder(gate)
    commit = GroupCommit(recorder.flush, key=lambda i: i)
    first = asyncio.create_task(commit(0))
    await asyncio.sleep(0)  # the first flush starts and blocks on the gate
    await asyncio.sleep(0)
    rest = [asyncio.create_task(commit(i)) for i in range(1, 6)]
    await asyncio.sleep(0)
    gate.set()
    assert await first is True
    assert [await r for r in rest] == [False, True, False, True, False]
    assert recorder.batches == [[0], [1, 2, 3, 4, 5]]
    assert commit.flushes == 2


async def test_a_failed_flush_fails_every_caller_in_it():
    commit = GroupCommit(Recorder(fail=True).flush, key=lambda i: i)
    results = await asyncio.gather(*(commit(i) for i in range(3)), return_exceptions=True)
    assert all(isinstance(r, ConnectionError) for r in results)


async def test_a_cancelled_caller_does_not_strand_the_others():
    gate = asyncio.Event()
    recorder = Recorder(gate)
    commit = GroupCommit(recorder.flush, key=lambda i: i)
    first = asyncio.create_task(commit(0))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    second = asyncio.create_task(commit(2))
    await asyncio.sleep(0)
    first.cancel()  # e.g. a handler cancelled at shutdown
    with pytest.raises(asyncio.CancelledError):
        await first
    gate.set()
    assert await asyncio.wait_for(second, 1) is True
    await commit.drain()
    assert recorder.batches == [[0], [2]]
