"""The standalone API's one middleware (``oncely.api.edge.Edge``) at the
ASGI level: the body's time bound is one timer per request, and it must cut
only a request waiting for its body, never the work after it. The socket
level (408, 413, 431 from a real server) is tests/test_http_limits.py.
The apps here have no exception handler, so the 408 is caught where it is
raised; ``Edge`` answers what escapes with a 500."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.exceptions import HTTPException

from oncely.api.edge import Edge

LIMITS = {"max_body_bytes": 1000, "max_headers": 50, "max_header_bytes": 8000}


def http_scope(method: str = "POST") -> dict[str, Any]:
    return {"type": "http", "method": method, "path": "/x", "headers": [], "route": None}


def body_parts(*parts: bytes, gap_s: float = 0.0) -> Any:
    """An ASGI receive giving ``parts`` as the body, ``gap_s`` apart."""
    queue = list(parts)

    async def receive() -> dict[str, Any]:
        if gap_s:
            await asyncio.sleep(gap_s)
        part = queue.pop(0)
        return {"type": "http.request", "body": part, "more_body": bool(queue)}

    return receive


async def run(app: Any, receive: Any, timeout_s: float) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await Edge(app, body_timeout_s=timeout_s, **LIMITS)(http_scope(), receive, send)
    return sent


async def test_work_after_the_body_outlives_the_body_bound() -> None:
    """The body arrived in time; the app then works past the bound: not cut."""
    finished: list[bool] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        assert (await receive())["body"] == b"all of it"
        await asyncio.sleep(0.3)  # three times the body bound
        finished.append(True)
        await send({"type": "http.response.start", "status": 202, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    sent = await run(app, body_parts(b"all of it"), timeout_s=0.1)
    assert finished == [True]
    assert sent[0]["status"] == 202


async def test_a_body_still_arriving_past_the_bound_is_refused() -> None:
    """Each part comes 0.2 s after the last; the bound is 0.3 s from the first
    read: the wait for the second part is cut, as a 408."""
    refused: list[int] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        try:
            await receive()
            await receive()
        except HTTPException as exc:
            refused.append(exc.status_code)
            raise

    await run(app, body_parts(b"a", b"b", b"c", gap_s=0.2), timeout_s=0.3)
    assert refused == [408]


async def test_a_read_after_the_bound_passed_between_reads_is_refused() -> None:
    """The app itself dawdled between two reads past the bound: it was not
    cancelled while it dawdled, and its next read is refused."""
    between: list[str] = []
    refused: list[int] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await asyncio.sleep(0.3)  # past the 0.1 s bound, not waiting on the body
        between.append("not cancelled")
        try:
            await receive()
        except HTTPException as exc:
            refused.append(exc.status_code)
            raise

    await run(app, body_parts(b"a", b"b"), timeout_s=0.1)
    assert between == ["not cancelled"]
    assert refused == [408]
