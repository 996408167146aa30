"""A job's status changes, told from one place (docs/architecture.md, Jobs).

Every door that changes a job's status writes the row through the jobs
stores and then tells ``Transitions.changed`` what the row came to: the
worker (dead, back in line after a failure), the API, the CLI and the
console (cancelled, rewound, resumed by an event or a decision, a dead
letter replayed), the timers (resumed). What has to follow a change subscribes here, wired by the
composition root; today that is the live ``status`` event, so a page
following a job's stream hears that a person cancelled it, whichever door
they used. A delivery's own running, waiting and done go out with its
tokens, in order, through ``oncely.live.events.LiveJob``.

Telling is a view of what the row already says: a listener that fails is
logged and never fails the transition.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import structlog

log = structlog.get_logger("oncely.jobs")

# (workflow, job id, status, extra fields of the status event)
Listener = Callable[[str, str, str, Mapping[str, Any]], None]


class Transitions:
    """The listeners told of each job status change (module docstring)."""

    def __init__(self) -> None:
        self._listeners: list[Listener] = []

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def changed(self, workflow: str, job_id: str, status: str, **extra: Any) -> None:
        for listener in self._listeners:
            try:
                listener(workflow, job_id, status, extra)
            except Exception as exc:
                log.warning(
                    "jobs.transition_not_told", job_id=job_id, status=status, error=repr(exc)
                )
