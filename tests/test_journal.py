"""The journal's bookkeeping of effects between checkpoints, with parallel
branches (no servers: the store is a small in-process one that records what
each statement would write)."""

from __future__ import annotations

import asyncio
from typing import Any

from oncely.journal import Checkpoint, Emitted, ForEvent, Journal, Recorded, Wait, Writes


class GatedStore:
    """Records every statement's effects; a wait holds until released."""

    def __init__(self) -> None:
        self.written: list[str] = []
        self.waiting = asyncio.Event()
        self.release = asyncio.Event()

    async def write(self, writes: Writes) -> None:
        self.written += [e.dedupe_key for e in writes.effects]

    async def wait(self, writes: Writes, wait: Wait) -> Checkpoint | None:
        self.written += [e.dedupe_key for e in writes.effects]
        self.waiting.set()
        await self.release.wait()
        return Checkpoint(wait.key, wait.ordinal, wait.kind, "done", {"approved": True})


def _effect(key: str) -> Emitted:
    return Emitted("refund.decided", {"key": key}, key)


async def test_an_effect_emitted_by_one_branch_while_another_waits_is_kept() -> None:
    store = GatedStore()
    journal = Journal([], store, workflow="refunds")  # type: ignore[arg-type]

    async def waits() -> Any:
        return await journal.wait("approval", "wait", ForEvent("approval"), 60, lambda v: v)

    async def emits_meanwhile() -> None:
        await store.waiting.wait()
        journal.emit(_effect("emitted-during-the-wait"))
        store.release.set()

    async def step() -> None:
        journal.emit(_effect("emitted-before"))
        await asyncio.gather(waits(), emits_meanwhile())

    await journal.run(step())
    assert store.written == ["emitted-before"]
    # The result's statement writes the other one: it was not dropped.
    assert [e.dedupe_key for e in journal.unwritten().effects] == ["emitted-during-the-wait"]


async def test_a_replayed_checkpoint_keeps_another_branchs_new_effect() -> None:
    """Branch A replays a stored checkpoint after branch B emitted anew:
    B's effect is still written (A's own, replayed, change nothing again)."""
    stored = [Checkpoint("[1]/lookup", 1, "step", "done", "found")]
    journal = Journal(stored, GatedStore(), workflow="refunds")  # type: ignore[arg-type]
    b_emitted = asyncio.Event()

    async def a() -> None:
        await b_emitted.wait()
        await journal.record("lookup", "step", _never_called, lambda v: v)

    async def b() -> None:
        journal.emit(_effect("new-in-b"))
        b_emitted.set()

    async def step() -> None:
        await asyncio.gather(a(), b())

    await journal.run(step())
    assert [e.dedupe_key for e in journal.unwritten().effects] == ["new-in-b"]


async def _never_called() -> Any:
    raise AssertionError("a stored checkpoint is not worked again")


async def test_a_shared_scope_keys_every_tasks_checkpoints_as_its_own_in_order() -> None:
    """A framework's turns come from tasks it starts: in a shared scope they
    are the scope's own checkpoints (``run/model``, ``run/model#2``), not
    branches (``run/[1]/model``); an ordinary scope branches them."""
    journal = Journal([], GatedStore(), workflow="frameworks")  # type: ignore[arg-type]

    async def turn() -> Any:
        async def work() -> Recorded[str]:
            return Recorded("ok", "ok")

        return await journal.record("model", "model", work, str)

    async def step() -> None:
        for shared, name in ((True, "run"), (False, "plain")):
            scope = journal.open_scope(name, shared=shared)
            with journal.within(scope):
                for _ in range(2):
                    await asyncio.create_task(turn())

    await journal.run(step())
    assert journal.reached == [
        "run/model",
        "run/model#2",
        "plain/[1]/model",
        "plain/[2]/model",
    ]
