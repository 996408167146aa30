"""Long-running parts of a process, and how their side tasks are supervised.

Every part (worker, reconciler, relay, API server) is a ``Service``: ``run()``
until ``stop()``. A service's side tasks (lease renewal, redelivery,
trimming, the relay's listener and retention) run in the service's
``asyncio.TaskGroup`` through ``supervised``: one that dies is logged with its
traceback and takes its service (and so the process) down with a non-zero
exit, for a supervisor to restart. Nothing fails silently.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import structlog


class Progress:
    """When a service's loop last went round (monotonic): what ``/healthz``
    reads to tell a live process from a wedged one."""

    def __init__(self) -> None:
        self.at = time.monotonic()

    def tick(self) -> None:
        self.at = time.monotonic()

    def age_s(self) -> float:
        return time.monotonic() - self.at


class Service(Protocol):
    async def run(self) -> None: ...
    def stop(self) -> None: ...


async def supervised(
    name: str, loop: Callable[[], Awaitable[None]], log: structlog.typing.FilteringBoundLogger
) -> None:
    """Run a side task's loop; log its death (with traceback) and re-raise."""
    try:
        await loop()
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("process.task_failed", task=name)
        raise
