"""Every door that changes a job's status tells ``Jobs.transitions`` (the
live ``status`` event follows from it): an event, a timer, a rewind, a
cancel and a dead letter's replay each tell what the row came to, once; a
job's end reaches the end listeners, and one that fails fails nothing.
(A map child's count as an end listener: tests/test_maps.py.)"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

import pytest

from oncely.jobs import dead_letters
from oncely.jobs.timers import Timers
from oncely.jobs.transitions import Ended
from oncely.live.events import JobEvents
from tests.durable import Harness, drain, wait_until_due

Told = list[tuple[str, str, str]]


@pytest.fixture
def told(harness: Harness) -> Told:
    """What the harness's stores told, as the composition root's listeners hear it."""
    heard: Told = []

    def listen(workflow: str, job_id: str, status: str, _extra: Mapping[str, Any]) -> None:
        heard.append((workflow, job_id, status))

    harness.jobs.transitions.subscribe(listen)
    return heard


async def waiting_approval(harness: Harness, **body: Any) -> str:
    job_id = await harness.submit("/v1/approvals", {"text": "needs a yes", **body})
    await drain(harness.worker("approvals"))
    assert await harness.status(job_id) == "waiting"
    return job_id


async def test_an_event_that_ends_a_wait_tells_queued(harness: Harness, told: Told) -> None:
    job_id = await waiting_approval(harness)
    outcome = await harness.checkpoints.receive_event(
        "approvals", uuid.UUID(job_id), "acme", "approval", {"approved": True}, "f1"
    )
    assert outcome.resumed is not None
    assert told == [("approvals", job_id, "queued")]
    # The same event again resumes nothing and tells nothing.
    again = await harness.checkpoints.receive_event(
        "approvals", uuid.UUID(job_id), "acme", "approval", {"approved": True}, "f1"
    )
    assert again.resumed is None and len(told) == 1


async def test_a_timer_that_comes_due_tells_queued(harness: Harness, told: Told) -> None:
    job_id = await waiting_approval(harness, wait_s=0.3)
    await wait_until_due(harness, job_id)
    assert await Timers(harness.checkpoints).run_once() == 1
    assert told == [("approvals", job_id, "queued")]
    assert await harness.status(job_id) == "queued"


async def test_a_cancel_then_a_rewind_tell_cancelled_then_queued(
    harness: Harness, told: Told
) -> None:
    job_id = await waiting_approval(harness)
    await harness.checkpoints.cancel(uuid.UUID(job_id))
    rewound = await harness.checkpoints.rewind(uuid.UUID(job_id), "model")
    assert rewound is not None and await harness.status(job_id) == "queued"
    assert told == [("approvals", job_id, "cancelled"), ("approvals", job_id, "queued")]


async def test_a_dead_letters_replay_tells_queued_and_reaches_the_live_stream(
    harness: Harness, told: Told
) -> None:
    """``oncely dlq replay`` (dead → queued): told once; with the live
    listener the CLI wires, the job's stream carries the ``queued`` event."""
    events = JobEvents(harness.redis)
    harness.jobs.transitions.subscribe(events.status_changed)
    job_id = await waiting_approval(harness)
    await harness.rows("UPDATE jobs SET status = 'dead' WHERE job_id = %s RETURNING 1", job_id)
    replayed = await dead_letters.replay(harness.jobs, "approvals", job_id)
    assert replayed is not None and await harness.status(job_id) == "queued"
    assert told == [("approvals", job_id, "queued")]
    await events.drain()
    [last] = await events.latest("approvals", job_id, 1)
    assert (last.type, last.data) == ("status", {"status": "queued"})
    # A job that is not dead is not replayed, and nothing is told.
    assert await dead_letters.replay(harness.jobs, "approvals", job_id) is None
    assert len(told) == 1


async def test_an_end_listener_that_fails_never_fails_the_end(harness: Harness, told: Told) -> None:
    """A cancel's end reaches every end listener in turn; one that raises is
    logged, and the cancel, the status listeners and the next listener
    still happen."""
    job_id = await waiting_approval(harness)
    ends: list[Ended] = []

    async def broken(_end: Ended) -> None:
        raise RuntimeError("a listener's bug")

    async def kept(end: Ended) -> None:
        ends.append(end)

    harness.jobs.transitions.when_ended(broken)
    harness.jobs.transitions.when_ended(kept)
    found = await harness.checkpoints.cancel(uuid.UUID(job_id))
    assert found is not None and await harness.status(job_id) == "cancelled"
    assert told == [("approvals", job_id, "cancelled")]
    assert ends == [Ended("approvals", job_id, "cancelled", child=False)]
