"""The intake's direct path (``oncely.api.workflows.direct_intake``, taken
with oncely's own API keys) answers every request exactly as FastAPI's
dependency path (taken with an app's own ``auth``) does: the same status,
headers that matter and problem body, checked in the same order. Both apps
here check the same API keys; only the path differs."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from psycopg_pool import AsyncConnectionPool

from oncely.api.app import create_app
from oncely.api.auth import ApiKeyAuth
from oncely.bootstrap import Resources, http_api
from oncely.builtin import app as builtin_app
from oncely.redis_client import RedisClient
from oncely.settings import Settings

URL = "/v1/summaries"
BODY = b'{"text": "Two paths, one answer.", "notify": "ada@example.com"}'
JSON = "application/json"


def _request(
    key: str | None = "k",
    body: bytes = BODY,
    content_type: str | None = JSON,
    authorization: str | None = "good",
    extra: list[tuple[str, str]] | None = None,
) -> dict[str, Any]:
    return {
        "key": key,
        "body": body,
        "content_type": content_type,
        "authorization": authorization,
        "extra": extra or [],
    }


CASES: dict[str, dict[str, Any]] = {
    "no Authorization": _request(authorization=None),
    "another scheme": _request(authorization="Basic YWRhOmFkYQ=="),
    "a scheme without a key": _request(authorization="Bearer"),
    "an unknown key": _request(authorization="Bearer onc_unknown"),
    "no Idempotency-Key": _request(key=None),
    "no Idempotency-Key, and no Authorization": _request(key=None, authorization=None),
    "a key too short": _request(key="short"),
    "two Idempotency-Key headers": _request(extra=[("idempotency-key", "another-key-0001")]),
    "JSON that does not parse": _request(body=b'{"text": '),
    "JSON that does not parse, and no Authorization": _request(body=b"{oops", authorization=None),
    "no body": _request(body=b""),
    "a JSON null": _request(body=b"null"),
    "a JSON list": _request(body=b"[1, 2]"),
    "not UTF-8": _request(body=b'{"text": "\xff\xfe"}'),
    "a field missing": _request(body=b'{"text": "No one to tell."}'),
    "a field missing, and no key": _request(body=b'{"text": "No one."}', key=None),
    "a field missing, and no Authorization": _request(body=b"{}", authorization=None),
    "a wrong type": _request(body=b'{"text": 5, "notify": "not an address"}'),
    "text as plain text": _request(content_type="text/plain"),
    "no content type": _request(content_type=None),
    "NUL in the text": _request(body=b'{"text": "a\\u0000b", "notify": "ada@example.com"}'),
    "a lone surrogate": _request(body=b'{"text": "a\\ud800b", "notify": "ada@example.com"}'),
    "JSON with parameters": _request(content_type="application/json; charset=utf-8"),
    "a +json media type": _request(content_type="application/vnd.api+json"),
    "a fresh request": _request(),
}


@pytest.fixture
async def both(
    settings: Settings, redis: RedisClient, pool: AsyncConnectionPool
) -> AsyncIterator[dict[str, httpx.AsyncClient]]:
    resources = Resources(settings, redis, pool)
    direct = http_api(builtin_app, settings, resources=resources)
    # The same API keys as a FastAPI dependency: the path any app's own auth takes.
    keys = ApiKeyAuth(lambda: pool, timeout_s=5.0, cache_s=0.0)
    solved = http_api(builtin_app, settings, auth=keys.dependency, resources=resources)
    clients: dict[str, httpx.AsyncClient] = {}
    for name, api in (("direct", direct), ("solved", solved)):
        transport = httpx.ASGITransport(app=create_app(api))
        clients[name] = httpx.AsyncClient(transport=transport, base_url="http://t")
    try:
        yield clients
    finally:
        for client in clients.values():
            await client.aclose()


async def _send(
    client: httpx.AsyncClient, case: dict[str, Any], api_key: str, key_suffix: str
) -> httpx.Response:
    headers: list[tuple[str, str]] = []
    if case["authorization"] == "good":
        headers.append(("authorization", f"Bearer {api_key}"))
    elif case["authorization"] is not None:
        headers.append(("authorization", case["authorization"]))
    if case["key"] == "k":
        headers.append(("idempotency-key", f"key-{key_suffix}"))
    elif case["key"] is not None:
        headers.append(("idempotency-key", case["key"]))
    if case["content_type"] is not None:
        headers.append(("content-type", case["content_type"]))
    headers += case["extra"]
    return await client.post(URL, content=case["body"], headers=headers)


@pytest.mark.parametrize("name", list(CASES))
async def test_both_paths_answer_the_same(
    name: str, both: dict[str, httpx.AsyncClient], api_key: str, pool: AsyncConnectionPool
) -> None:
    case = CASES[name]
    # Each path's own key, so that both run the request, not one replaying the other.
    answers = {
        path: await _send(client, case, api_key, f"{path}-{uuid.uuid4().hex}")
        for path, client in both.items()
    }
    direct, solved = answers["direct"], answers["solved"]
    assert direct.status_code == solved.status_code, (direct.text, solved.text)
    assert direct.headers["content-type"] == solved.headers["content-type"]
    if direct.status_code == 202:
        ids = [r.json()["job_id"] for r in (direct, solved)]
        async with pool.connection() as conn:
            cur = await conn.execute(
                "SELECT count(*) FROM jobs WHERE job_id = ANY(%s::uuid[])", (ids,)
            )
            assert (await cur.fetchone()) == (2,), "each path stored its job"
        assert direct.json()["status"] == solved.json()["status"] == "queued"
    else:
        assert direct.json() == solved.json()
        async with pool.connection() as conn:
            cur = await conn.execute("SELECT count(*) FROM jobs")
            assert (await cur.fetchone()) == (0,), "a refused request stores nothing"


async def test_the_direct_path_is_the_one_oncelys_own_keys_take(
    settings: Settings, redis: RedisClient, pool: AsyncConnectionPool
) -> None:
    """So that the test above compares two paths, not one path twice."""
    resources = Resources(settings, redis, pool)
    own = create_app(http_api(builtin_app, settings, resources=resources))
    keys = ApiKeyAuth(lambda: pool, timeout_s=5.0, cache_s=0.0)
    theirs = create_app(http_api(builtin_app, settings, auth=keys.dependency, resources=resources))

    def intake_route(app: Any) -> str:
        [route] = [r for r in app.router.routes if getattr(r, "path", "") == URL]
        return type(route).__name__

    assert (intake_route(own), intake_route(theirs)) == ("DirectRoute", "APIRoute")


async def test_a_client_gone_mid_body_is_answered_alike(
    both: dict[str, httpx.AsyncClient], api_key: str
) -> None:
    """The body never arrives: the server hears the client disconnect."""
    statuses: dict[str, list[int]] = {}
    for path, client in both.items():
        app = client._transport.app  # type: ignore[attr-defined]
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": URL,
            "raw_path": URL.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [
                (b"host", b"t"),
                (b"content-type", JSON.encode()),
                (b"content-length", b"60"),
                (b"authorization", f"Bearer {api_key}".encode()),
                (b"idempotency-key", f"gone-{path}-{uuid.uuid4().hex}".encode()),
            ],
            "client": ("127.0.0.1", 1),
            "server": ("t", 80),
        }
        sent: list[int] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any], sent: list[int] = sent) -> None:
            if message["type"] == "http.response.start":
                sent.append(message["status"])

        await app(scope, receive, send)
        statuses[path] = sent
    assert statuses["direct"] == statuses["solved"] == [422], statuses


async def test_a_streamed_body_over_the_limit_is_answered_alike(
    both: dict[str, httpx.AsyncClient], api_key: str, settings: Settings, pool: AsyncConnectionPool
) -> None:
    """No Content-Length: the edge counts the body as the route reads it
    and refuses it there, inside either path."""
    limit = settings.max_body_bytes

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"text": "'
        for _ in range(limit // 65536 + 2):
            yield b"x" * 65536
        yield b'", "notify": "ada@example.com"}'

    answers = {}
    for path, client in both.items():
        headers = {
            "authorization": f"Bearer {api_key}",
            "idempotency-key": f"stream-{path}-{uuid.uuid4().hex}",
            "content-type": JSON,
        }
        answers[path] = await client.post(URL, content=chunks(), headers=headers)
    assert answers["direct"].status_code == answers["solved"].status_code == 413
    assert answers["direct"].json() == answers["solved"].json()
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT count(*) FROM jobs")
        assert (await cur.fetchone()) == (0,)
