"""Waking the relays after a commit wrote outbox rows."""

from __future__ import annotations

import asyncio

import structlog
from psycopg_pool import AsyncConnectionPool

from oncely.sql import query
from oncely.sql.bounded import run_statement

log = structlog.get_logger("oncely.outbox")


class OutboxWakeUp:
    """``NOTIFY oncely_outbox`` after commits, one per burst: while one is on
    its way, later commits only ask for one more. A lost wake-up costs the
    relay's poll interval, never a notification."""

    def __init__(self, pool: AsyncConnectionPool, *, timeout_s: float = 10.0) -> None:
        self.pool = pool
        self.timeout_s = timeout_s
        self.sent = 0
        self._wanted = False
        self._task: asyncio.Task[None] | None = None

    def soon(self) -> None:
        self._wanted = True
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._send())

    async def _send(self) -> None:
        while self._wanted:
            self._wanted = False
            try:
                await run_statement(self.pool, query("notify_outbox"), timeout_s=self.timeout_s)
                self.sent += 1
            except Exception as exc:
                log.warning("outbox.notify_failed", error=f"{type(exc).__name__}: {exc}")
                return
