"""The standalone API's one middleware, ``Edge``: what every request meets
before any route (docs/settings.md).

One layer rather than one per concern, because it runs on every request and
each ASGI layer wraps the request's ``receive`` and ``send`` again
(bench/README.md, Intake). In order:

- ``HEAD`` is answered like ``GET`` without the body (uptime checkers use it);
- a body declared over ``max_body_bytes`` is answered 413 before it is read;
- more than ``max_headers`` header fields, or more than ``max_header_bytes``
  in them: 431;
- the body is counted as it arrives (413 past the limit) and must arrive in
  full within ``body_timeout_s`` of the first read (408, connection closed);
- ``oncely_requests_total`` counts the answer by route template and status
  class;
- an exception no handler took is logged by ``log_unhandled`` and answered
  500 (never raised to the server, which would log it again, message and all).
"""

from __future__ import annotations

import asyncio

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from oncely import metrics
from oncely.api.problems import http_problem, internal_problem, log_unhandled

# On every answer: browsers take the Content-Type as it is, never sniff one.
_NOSNIFF = (b"x-content-type-options", b"nosniff")


class Edge:
    def __init__(
        self,
        app: ASGIApp,
        *,
        max_body_bytes: int,
        max_headers: int,
        max_header_bytes: int,
        body_timeout_s: float,
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_headers = max_headers
        self.max_header_bytes = max_header_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        head = scope["method"] == "HEAD"
        if head:
            scope = {**scope, "method": "GET"}
        status = 500
        started = False

        async def edge_send(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status = message["status"]
                started = True
                message = {**message, "headers": [*message.get("headers", ()), _NOSNIFF]}
            elif head and message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        body = _Body(receive, self.max_body_bytes, self.body_timeout_s)
        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                await http_problem(*refusal)(scope, receive, edge_send)
            else:
                await self.app(scope, body.receive, edge_send)
        except Exception as exc:
            log_unhandled(exc)
            if not started:
                await internal_problem()(scope, receive, edge_send)
        finally:
            body.close()
            route = scope.get("route")
            path = getattr(route, "path", "unmatched")
            metrics.REQUESTS.labels(route=path, outcome=f"{status // 100}xx").inc()

    def _refusal(self, scope: Scope) -> tuple[int, str] | None:
        """413 for a declared body over the limit, else 431 for too many or
        too large header fields; None when the head is acceptable."""
        headers = scope["headers"]
        size = 0
        declared: int | None = None
        for name, value in headers:
            size += len(name) + len(value) + 4
            if declared is None and name == b"content-length" and value.isdigit():
                declared = int(value)
        if declared is not None and declared > self.max_body_bytes:
            return 413, f"the limit is {self.max_body_bytes} bytes"
        if len(headers) > self.max_headers or size > self.max_header_bytes:
            return 431, f"at most {self.max_headers} header fields, {self.max_header_bytes} bytes"
        return None


class _Body:
    """A request's ``receive``, counted and bounded in time. The time bound is
    one timer per request, armed at the first read: it cancels the request
    only while it waits for the body (a late answer between two reads is
    refused at the next one)."""

    def __init__(self, receive: Receive, max_bytes: int, timeout_s: float) -> None:
        self._receive = receive
        self._max_bytes = max_bytes
        self._timeout_s = timeout_s
        self._seen = 0
        self._complete = False
        self._waiting = False
        self._expired = False
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[object] | None = None

    async def receive(self) -> Message:
        if self._complete:
            return await self._receive()
        if self._timer is None:
            self._task = asyncio.current_task()
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self._timeout_s, self._expire)
        if self._expired:
            raise self._too_slow()
        self._waiting = True
        try:
            message = await self._receive()
        except asyncio.CancelledError:
            # Ours alone (no other cancellation pending): the body was too slow.
            if self._expired and self._task is not None and self._task.uncancel() == 0:
                raise self._too_slow() from None
            raise
        finally:
            self._waiting = False
        self._seen += len(message.get("body", b""))
        if self._seen > self._max_bytes:
            self.close()
            # Surfaces through the app's HTTPException handler as a 413 problem.
            raise HTTPException(413, f"the limit is {self._max_bytes} bytes")
        if not message.get("more_body", False):
            self._complete = True
            self.close()
        return message

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _expire(self) -> None:
        self._expired = True
        if self._waiting and self._task is not None:
            self._task.cancel()

    def _too_slow(self) -> HTTPException:
        detail = f"the body did not arrive within {self._timeout_s:g} s"
        return HTTPException(408, detail, headers={"Connection": "close"})
