"""The server's bounds on a client, against a real ``oncely api`` over raw
sockets: the request head is capped in size and in time, a body shorter
than its Content-Length is answered 408, HEAD works, and what goes wrong
inside is logged without the request's text.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.processes import api_with_key, wait_for

# A real process to start, and (fuzzing) a few hundred requests on a busy machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

# The bounds the API below runs with: small, so the test is quick.
HEAD_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0
# Generous: only proves that the connection is not held forever.
CLOSED_WITHIN_S = 15.0


@pytest.fixture(scope="module")
def api(
    server_urls: tuple[str, str], module_database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[int, str, Path]]:
    """(port, API key, log) of a real API with short client bounds, shared by
    the module's tests."""
    redis_url, _ = server_urls
    limits = {
        "ONCELY_HTTP_HEADER_TIMEOUT_S": str(HEAD_TIMEOUT_S),
        "ONCELY_HTTP_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S),
    }
    directory = tmp_path_factory.mktemp("limits")
    with api_with_key(redis_url, module_database_url, directory, "acme", **limits) as served:
        url, key, log = served
        yield int(url.rsplit(":", 1)[1]), key, log


@pytest.fixture
async def db(module_database_url: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    conn = await psycopg.AsyncConnection.connect(module_database_url, autocommit=True)
    yield conn
    await conn.close()


async def exchange(port: int, data: bytes, *, then_wait: bool = True) -> bytes:
    """Send ``data``; everything the server sends until it closes (bounded)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(CLOSED_WITHIN_S):
            return await reader.read(-1) if then_wait else await reader.read(65536)
    finally:
        writer.close()


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


async def test_a_request_head_over_the_size_limit_in_one_piece_is_a_431_problem(api):
    port, _, _ = api
    filler = b"".join(b"X-Filler-%d: %s\r\n" % (i, b"a" * 1000) for i in range(20))
    answer = await exchange(
        port, b"GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n" + filler + b"\r\n"
    )
    assert status_of(answer) == 431
    assert b"application/problem+json" in answer and b"headers-too-large" in answer


async def test_a_request_head_over_the_size_limit_in_pieces_is_refused_before_it_ends(api):
    """32 MiB of headers used to be read in full (and answered 200)."""
    port, _, _ = api
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    sent = 0
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: t\r\n")
        async with asyncio.timeout(CLOSED_WITHIN_S):
            while sent < 32 * 1024 * 1024 and not reader.at_eof():
                writer.write(b"X-Filler: %s\r\n" % (b"a" * 4000))
                await writer.drain()
                sent += 4012
                await asyncio.sleep(0)
            answer = await reader.read(-1)
    except ConnectionError:
        answer = b"HTTP/1.1 431 (reset while we were still sending)"
    finally:
        writer.close()
    assert status_of(answer) == 431
    # What we managed to send includes what the sockets' buffers took in.
    assert sent < 8 * 1024 * 1024, f"refused only after {sent} bytes"
    ok = await exchange(port, b"GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    assert status_of(ok) == 200, "still serving"


async def test_more_header_fields_than_the_limit_is_a_431_problem(api):
    port, _, _ = api
    fields = b"".join(b"X-F%d: 1\r\n" % i for i in range(150))
    answer = await exchange(
        port, b"GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n" + fields + b"\r\n"
    )
    assert status_of(answer) == 431
    assert b"application/problem+json" in answer and b"headers-too-large" in answer


@pytest.mark.parametrize(
    "partial",
    [b"", b"GET /healthz HTTP/1.1\r\nHost: t\r\n", b"GET /heal"],
    ids=["nothing", "headers-unfinished", "request-line-unfinished"],
)
async def test_a_connection_that_never_finishes_its_request_head_is_closed(api, partial):
    port, _, _ = api
    loop = asyncio.get_running_loop()
    started = loop.time()
    answer = await exchange(port, partial)
    assert answer == b"", "closed without an answer"
    assert loop.time() - started >= HEAD_TIMEOUT_S * 0.9, "not before the bound"


async def test_a_trickled_request_head_is_closed_at_the_bound_too(api):
    """A byte every 0.1 s, for ever: the bound is on the whole head, so the
    trickle does not keep the connection."""
    port, _, _ = api
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /healthz HTTP/1.1\r\nX-Slow: ")
    try:
        async with asyncio.timeout(CLOSED_WITHIN_S):
            while not reader.at_eof():
                writer.write(b"a")
                await writer.drain()
                await asyncio.sleep(0.1)
        assert await reader.read(-1) == b""
    except ConnectionError:
        pass  # closed while we were writing
    finally:
        writer.close()


async def test_a_body_shorter_than_its_content_length_is_a_408_and_closed(api, db, redis):
    port, key, _ = api
    body = b'{"text": "short"'
    head = (
        b"POST /v1/summaries HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + key.encode() + b"\r\n"
        b"Idempotency-Key: limits-key-0000001\r\nContent-Length: 200\r\n\r\n"
    )
    answer = await exchange(port, head + body)
    assert status_of(answer) == 408
    assert b"request-timeout" in answer and b"connection: close" in answer.lower()
    cur = await db.execute("SELECT count(*) FROM jobs")
    assert await cur.fetchone() == (0,)
    assert await redis.keys("oncely:idem:*") == [], "no key was claimed"


async def test_head_over_the_wire_has_headers_and_no_body_and_keeps_the_connection(api):
    port, _, _ = api
    answer = await exchange(
        port,
        b"HEAD /healthz HTTP/1.1\r\nHost: t\r\n\r\n"
        b"GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
    )
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert status_of(head) == 200 and b"content-length: 15" in head.lower()
    assert rest.startswith(b"HTTP/1.1 200"), "the next response follows at once: no body"
    assert rest.endswith(b'{"status":"ok"}')


async def test_failures_inside_are_logged_without_the_request_text(api, db):
    port, key, log = api
    marker = "words-only-the-client-should-see"
    await db.execute("ALTER TABLE jobs RENAME TO jobs_away")
    try:
        await _post_both(port, key, marker)
    finally:
        await db.execute("ALTER TABLE jobs_away RENAME TO jobs")

    async def logged() -> bool:
        return "api.unhandled" in log.read_text()

    await wait_for(logged, within_s=10, what="the 500's log line")
    text = log.read_text()
    assert marker not in text
    assert "Traceback" not in text
    events = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    [unhandled] = [e for e in events if e["event"] == "api.unhandled"]
    assert unhandled["error"] == "UndefinedTable"


async def _post_both(port: int, key: str, marker: str) -> None:
    """A body with NUL (422) and one that fails inside (500), both quoting ``marker``."""
    for text in (f"nul \\u0000 {marker}", marker):
        body = json.dumps({"text": text, "notify": "ada@example.com"}).replace("\\\\", "\\")
        request = (
            f"POST /v1/summaries HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {key}\r\nIdempotency-Key: limits-key-{len(text):07d}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n{body}"
        )
        answer = await exchange(port, request.encode())
        assert status_of(answer) == (422 if "u0000" in text else 500), answer
