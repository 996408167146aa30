"""A job's status changes, told from one place (docs/architecture.md, Jobs).

Every door that changes a job's status writes the row through the jobs
stores and then tells ``Transitions`` what the row came to: the worker
(done, dead, back in line after a failure), the API, the CLI and the
console (cancelled, rewound, resumed by an event or a decision, a dead
letter replayed), the timers (resumed). What has to follow a change
subscribes here, wired by the composition root:

- every change (``changed``): the live ``status`` event, so a page
  following a job's stream hears that a person cancelled it, whichever
  door they used. A delivery's own running, waiting and done go out with
  its tokens, in order, through ``oncely.live.events.LiveJob``, so its end
  is told as already said (``ended(..., told=True)``);
- a job's end (``ended``: done, dead, cancelled), awaited in order: a map
  child's count in its map (``oncely.jobs.children``) and, for a done job,
  its hand-off to the shadow variants (``oncely.shadow.dispatch``).

Telling is a view of what the row already says: a listener that fails is
logged and never fails the transition (a map's repair pass counts an end
that was not).

What a delivery's writes emitted wakes the relay where they are written
(``oncely.outbox.wakeup``): effects follow writes, not statuses, and a
running job writes them at its checkpoints too.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

log = structlog.get_logger("oncely.jobs")

# (workflow, job id, status, extra fields of the status event)
Listener = Callable[[str, str, str, Mapping[str, Any]], None]


@dataclass(frozen=True)
class Ended:
    """A job's end, as the door that ended it knows it."""

    workflow: str
    job_id: str
    status: str  # done, dead or cancelled
    # A map's child: its end counts in its map.
    child: bool = False
    # A done job: its request and its stored result (the shadow hand-off).
    tenant: str | None = None
    payload: Mapping[str, Any] | None = None
    result: Mapping[str, Any] | None = None


EndListener = Callable[[Ended], Awaitable[None]]


class Transitions:
    """The listeners told of each job status change (module docstring)."""

    def __init__(self) -> None:
        self._listeners: list[Listener] = []
        self._on_end: list[EndListener] = []

    def subscribe(self, listener: Listener) -> None:
        """``listener`` told of every status change (module docstring)."""
        self._listeners.append(listener)

    def when_ended(self, listener: EndListener) -> None:
        """``listener`` awaited at every job's end (module docstring)."""
        self._on_end.append(listener)

    def changed(self, workflow: str, job_id: str, status: str, **extra: Any) -> None:
        for listener in self._listeners:
            try:
                listener(workflow, job_id, status, extra)
            except Exception as exc:
                log.warning(
                    "jobs.transition_not_told", job_id=job_id, status=status, error=repr(exc)
                )

    async def ended(self, end: Ended, *, told: bool = False) -> None:
        """The job's end: every change listener told (unless the delivery
        told its stream already, ``told``), then every end listener awaited
        in turn. Never raises for a listener."""
        if not told:
            self.changed(end.workflow, end.job_id, end.status)
        for listener in self._on_end:
            try:
                await listener(end)
            except Exception as exc:
                log.warning(
                    "jobs.end_not_followed",
                    job_id=end.job_id,
                    status=end.status,
                    error=f"{type(exc).__name__}: {exc}"[:500],
                )
