"""The HTTP server's bounds on what a client may hold (README: Settings).

uvicorn's h11 protocol caps a request head that is still incomplete at
``h11_max_incomplete_event_size`` bytes (over it: 400 and the connection
closed; a complete head that came in one read is the app's to refuse, 431
from ``oncely.api.app.RequestLimits``) and closes a keep-alive connection
idle for ``timeout_keep_alive``. It has no bound on how long a client may
take to send the head: a connection that sends nothing, or one header byte
at a time, is held forever. ``HeadTimeout`` adds that bound. The body's is
the app's (``RequestLimits``), so it holds under any server.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class HeadTimeout(H11Protocol):
    """h11 that closes a connection whose request line and headers have not
    arrived in full within ``head_timeout_s`` of its first byte (or of the
    connection, for the first request)."""

    head_timeout_s: float = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self._head_timer is None:
            self._arm()  # a keep-alive connection's next request begins
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def head_timeout_protocol(head_timeout_s: float) -> type[HeadTimeout]:
    """The protocol class for ``uvicorn.Config(http=...)`` with this bound."""
    return type("HeadTimeout", (HeadTimeout,), {"head_timeout_s": head_timeout_s})
