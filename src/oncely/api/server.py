"""The HTTP server's bounds on what a client may hold (docs/settings.md).

uvicorn's httptools protocol (the fast one) caps neither the size of a
request head nor the time a client may take to send it: 32 MiB of headers
were read in full, and a connection that sends nothing, or one header byte
at a time, was held forever. ``BoundedHead`` adds both bounds: a head over
``max_head_bytes`` (request line and header fields) is answered 431 and the
connection closed, as soon as the bytes are seen; a connection whose head
has not arrived in full ``head_timeout_s`` after it opened (or after the
request's first byte, on a kept-alive one) is closed. A connection whose
answer the app left unfinished (a stalled live stream) is aborted, not
closed gracefully behind a peer that never reads. The bounds on the
body and on the count of header fields are the app's
(``oncely.api.edge.Edge``), so they hold under any server.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class HeadTooLarge(Exception):
    """Raised from the parser's callbacks: the parser stops, uvicorn answers."""


class BoundedHead(HttpToolsProtocol):
    """httptools with a size and a time bound on each request's head."""

    head_timeout_s: float = 10.0
    max_head_bytes: int = 16_384

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        self._too_large = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_CutShort(transport, self))  # type: ignore[arg-type]
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    # Parser callbacks
    def on_message_begin(self) -> None:
        # Its first byte: a kept-alive connection's next request (pipelined
        # or not) gets the same bound as the first.
        self._head_bytes = 0
        if self._head_timer is None:
            self._arm()
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        if not self._too_large:
            super().send_400_response(msg)
            return
        body = json.dumps(
            {
                "type": "https://oncely.dev/problems/headers-too-large",
                "title": "Request Header Fields Too Large",
                "status": 431,
                "detail": f"the request line and headers exceed {self.max_head_bytes} bytes",
            }
        ).encode()
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: application/problem+json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
        )
        self.transport.close()

    def _count(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > self.max_head_bytes:
            self._too_large = True
            raise HeadTooLarge  # the parser error makes uvicorn answer and close

    def _arm(self) -> None:
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()


class _CutShort:
    """A connection's transport, except that closing it after an answer cut
    short (started, never finished: a live stream whose writes stalled,
    docs/streaming.md) aborts it. A graceful close waits for the peer to
    read what is buffered: one that reads nothing would hold the connection,
    and its buffer, forever."""

    def __init__(self, transport: asyncio.Transport, protocol: HttpToolsProtocol) -> None:
        self._transport = transport
        self._protocol = protocol

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def close(self) -> None:
        cycle = self._protocol.cycle
        if cycle is not None and cycle.response_started and not cycle.response_complete:
            self._transport.abort()
        else:
            self._transport.close()


def bounded_protocol(*, head_timeout_s: float, max_head_bytes: int) -> type[BoundedHead]:
    """The protocol class for ``uvicorn.Config(http=...)`` with these bounds."""
    bounds = {"head_timeout_s": head_timeout_s, "max_head_bytes": max_head_bytes}
    return type("BoundedHead", (BoundedHead,), bounds)
