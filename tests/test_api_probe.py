"""What an outside probe of the running API found, one regression test each,
and every status the OpenAPI document promises, provoked for real.

In process (the standalone app on the test servers); the server's own
bounds (header size, slow clients) are in ``test_http_limits.py``.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from psycopg_pool import AsyncConnectionPool
from structlog.testing import capture_logs

from oncely import names
from oncely.api.problems import PROBLEM_BASE
from oncely.api.store import IdempotencyStore, new_token
from oncely.bootstrap import make_redis
from oncely.identity import Scope, fingerprint
from tests.conftest import _with_dbname
from tests.helpers import asgi_app, count, make_worker
from tests.processes import free_port

ROOT = Path(__file__).resolve().parent.parent
URL = "/v1/summaries"
BODY = {"text": "A text to summarise.", "notify": "ada@example.com"}
TICKET = {"subject": "Cannot log in", "body": "Since this morning."}
PROBLEM = "application/problem+json"


def key(n: int = 0) -> str:
    return f"probe-key-{n:08d}-0000"


async def no_trace_of_the_request(pool, redis) -> None:  # type: ignore[no-untyped-def]
    assert await count(pool, "SELECT count(*) FROM jobs") == 0
    assert [k async for k in redis.scan_iter(names.IDEMPOTENCY_PREFIX + "*")] == []
    assert await redis.xlen("oncely:{summaries}:stream") == 0


# -- NUL in the text ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("route", "body", "loc"),
    [
        (URL, {**BODY, "text": "nul \u0000 byte"}, ["body", "text"]),
        ("/v1/triage", {**TICKET, "subject": "log\u0000in"}, ["body", "subject"]),
    ],
)
async def test_text_with_nul_is_422_before_any_key_is_claimed_and_logs_nothing_of_it(
    client, auth, pool, redis, route, body, loc
):
    """PostgreSQL cannot store NUL in JSON text: it used to be a 500 on every
    retry (and a traceback quoting the text in the log)."""
    with capture_logs() as logs:
        r = await client.post(route, json=body, headers={**auth, "Idempotency-Key": key()})
    assert r.status_code == 422
    assert r.headers["content-type"] == PROBLEM
    assert r.json()["type"] == PROBLEM_BASE + "validation"
    assert [e["loc"] for e in r.json()["errors"]] == [loc]
    await no_trace_of_the_request(pool, redis)
    assert "\u0000" not in repr(logs)
    fixed = {k: v.replace("\u0000", "") for k, v in body.items()}
    retry = await client.post(route, json=fixed, headers={**auth, "Idempotency-Key": key()})
    assert retry.status_code == 202, "the key was never claimed: the fixed body is fresh"


async def test_lone_surrogates_are_422_too(client, auth, pool, redis):
    raw = b'{"text": "half \\ud800 a pair", "notify": "ada@example.com"}'
    r = await client.post(
        URL,
        content=raw,
        headers={**auth, "Idempotency-Key": key(), "Content-Type": "application/json"},
    )
    assert r.status_code == 422 and r.json()["type"] == PROBLEM_BASE + "validation"
    await no_trace_of_the_request(pool, redis)


async def test_an_unhandled_error_is_a_500_problem_logged_without_request_text(
    client, auth, pool, redis
):
    """The exception does not reach the server (which would log its
    traceback and message); the one log line names the error and where."""
    async with pool.connection() as conn:
        await conn.execute("ALTER TABLE jobs RENAME TO jobs_away")
    marker = "secret-words-of-the-client"
    with capture_logs() as logs:
        r = await client.post(
            URL, json={**BODY, "text": marker}, headers={**auth, "Idempotency-Key": key()}
        )
    assert r.status_code == 500
    assert r.headers["content-type"] == PROBLEM
    assert r.json()["type"] == PROBLEM_BASE + "internal"
    [line] = [e for e in logs if e["event"] == "api.unhandled"]
    assert line["error"] == "UndefinedTable" and line["sqlstate"] == "42P01"
    assert any("accept" in frame for frame in line["where"])
    assert marker not in repr(logs)
    assert [k async for k in redis.scan_iter(names.IDEMPOTENCY_PREFIX + "*")] == [], "released"


# -- HEAD, 405 and Allow --------------------------------------------------------------


async def test_head_answers_wherever_get_does_without_a_body(client, auth, pool):
    accepted = await client.post(URL, json=BODY, headers={**auth, "Idempotency-Key": key()})
    job = accepted.headers["location"]
    for path, headers in [("/healthz", {}), ("/readyz", {}), ("/metrics", {}), (job, auth)]:
        get = await client.get(path, headers=headers)
        head = await client.head(path, headers=headers)
        assert (head.status_code, get.status_code) == (200, 200), path
        assert head.content == b""
        assert head.headers["content-type"] == get.headers["content-type"]
    missing = await client.head(f"{URL}/{uuid.uuid4()}", headers=auth)
    assert missing.status_code == 404 and missing.content == b""
    assert await count(pool, "SELECT count(*) FROM jobs") == 1, "HEAD changed nothing"


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("POST", "/healthz", "GET, HEAD"),
        ("DELETE", URL, "POST"),
        ("PUT", f"{URL}/{uuid.UUID(int=1)}", "GET, HEAD"),
        ("PATCH", "/metrics", "GET, HEAD"),
    ],
)
async def test_every_405_carries_allow(client, auth, method, path, allow):
    r = await client.request(method, path, headers=auth)
    assert r.status_code == 405
    assert r.headers["allow"] == allow
    assert r.headers["content-type"] == PROBLEM
    assert r.json()["type"] == PROBLEM_BASE + "method-not-allowed"


# -- redirects, unparsable bodies, the chunked 413 --------------------------------------


async def test_a_trailing_slash_is_not_redirected_to_the_clients_host(client, auth):
    for path in ("/healthz/", f"{URL}/"):
        r = await client.get(path, headers={**auth, "Host": "evil.example"})
        assert r.status_code == 404
        assert "location" not in r.headers
        assert r.json()["type"] == PROBLEM_BASE + "not-found"


async def test_a_body_that_is_not_utf8_is_a_documented_422(client, auth, pool, redis):
    r = await client.post(
        URL,
        content=b'{"text": "caf\xe9", "notify": "ada@example.com"}',
        headers={**auth, "Idempotency-Key": key(), "Content-Type": "application/json"},
    )
    assert r.status_code == 422
    assert r.json()["type"] == PROBLEM_BASE + "validation"
    await no_trace_of_the_request(pool, redis)


async def test_the_chunked_413_says_what_the_limit_is(settings, redis, pool, auth):
    app = asgi_app(settings.model_copy(update={"max_body_bytes": 64}), redis, pool)

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(8):
            yield b" " * 16

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.post(
            URL,
            content=chunks(),
            headers={**auth, "Idempotency-Key": key(), "Content-Type": "application/json"},
        )
    assert r.status_code == 413
    problem = r.json()
    assert (problem["type"], problem["status"]) == (PROBLEM_BASE + "payload-too-large", 413)
    assert problem["detail"] == "the limit is 64 bytes"


async def test_too_many_header_fields_is_a_431_problem(client, auth):
    many = [(f"x-filler-{i}", "1") for i in range(120)]
    r = await client.get("/healthz", headers=many)
    assert r.status_code == 431
    assert r.json()["type"] == PROBLEM_BASE + "headers-too-large"


# -- the document tells the truth ---------------------------------------------------------


async def test_the_openapi_document_matches_the_service(client):
    doc = (await client.get("/openapi.json")).json()
    for route in (URL, "/v1/triage"):
        post = doc["paths"][route]["post"]
        [header] = [p for p in post["parameters"] if p["name"] == "Idempotency-Key"]
        assert header["required"] is True
        assert (header["schema"]["minLength"], header["schema"]["maxLength"]) == (16, 255)
        get = doc["paths"][route + "/{job_id}"]["get"]
        for op in (post, get):
            assert {"401", "500"} <= set(op["responses"])
            for status, response in op["responses"].items():
                if status >= "400":
                    assert list(response["content"]) == [PROBLEM], (route, status)
        assert "422" not in get["responses"], "a path parameter cannot fail validation"
    assert list(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]


def test_every_problem_type_the_api_answers_is_in_the_documented_list():
    documented = set(
        re.findall(
            r"`([a-z-]+)`",
            (ROOT / "docs" / "http-api.md").read_text().split("stable `type`:")[1].split("\n\n")[0],
        )
    )
    source = "\n".join(p.read_text() for p in (ROOT / "src/oncely/api").glob("*.py"))
    used = set(re.findall(r'problem\(\s*\d+,\s*"([a-z-]+)"', source))
    used |= set(re.findall(r'\d{3}: "([a-z-]+)"', source))  # the status → type table
    used |= {"bad-request", "internal"}  # its fallbacks
    assert len(used) >= 14
    assert used <= documented, used - documented


# -- a dead job's error -------------------------------------------------------------------


async def test_a_dead_job_shows_its_tenant_a_stable_reason_and_operators_the_detail(
    client, auth, pool, redis, jobs, summary_job, fake_llm
):
    text = "Refused by the provider. [[fake:400*1]]"
    r = await client.post(
        URL, json={**BODY, "text": text}, headers={**auth, "Idempotency-Key": key()}
    )
    stream = jobs.streams["summaries"]
    await stream.ensure_group()
    worker = make_worker(stream, summary_job, pool)
    await worker.run_once()
    await worker.wait_idle()

    view = (await client.get(r.headers["location"], headers=auth)).json()
    assert (view["status"], view["error"]) == ("dead", "permanent")
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT error FROM jobs")
        [(detail,)] = await cur.fetchall()
    assert detail.startswith("permanent: ") and "400" in detail, "kept for the console"
    [(_, letter)] = await redis.xrange(summaries_dead())
    assert "400" in letter["last_error"], "kept for oncely dlq list"


def summaries_dead() -> str:
    from oncely.builtin.summaries import summaries

    return summaries.keys.dead


def _stream_provokers(
    route: str,
    body: dict[str, str],
    auth: dict[str, str],
    pool: Any,
    redis: Any,
    via: Any,
    no_postgres: Any,
    broken_table: Any,
) -> dict[tuple[str, str], Provoke]:
    """A job's stream and its token, each documented status provoked."""
    live, token = f"GET {route}/{{job_id}}/stream", f"POST {route}/{{job_id}}/stream-token"

    async def finished(c: Any, r: str = route, b: Any = body) -> str:
        accepted = await c.post(r, json=b, headers={**auth, "Idempotency-Key": key(200)})
        async with pool.connection() as conn:
            await conn.execute("UPDATE jobs SET status = 'done'")
        return str(accepted.headers["location"])

    async def streamed(c: Any, _: Any) -> Any:
        return await c.get(await finished(c) + "/stream", headers=auth)

    async def crowded(c: Any, _: Any) -> Any:
        # The tenant's limit of open streams already taken.
        location = await finished(c)
        lapse = (time.time() + 600) * 1000
        await redis.zadd(
            names.open_streams(names.tenant_digest("acme")),
            {f"held-{i}": lapse for i in range(100)},
        )
        try:
            return await c.get(location + "/stream", headers=auth)
        finally:
            await redis.delete(names.open_streams(names.tenant_digest("acme")))

    async def tokened(c: Any, _: Any) -> Any:
        return await c.post(await finished(c) + "/stream-token", headers=auth)

    async def malformed(c: Any, _: Any) -> Any:
        # A resume id that is no event id.
        return await c.get(await finished(c) + "/stream", headers={**auth, "Last-Event-ID": "$"})

    return {
        (live, "200"): streamed,
        (live, "400"): malformed,
        (live, "401"): lambda c, _, r=route: c.get(f"{r}/{uuid.uuid4()}/stream"),
        (live, "404"): lambda c, _, r=route: c.get(f"{r}/{uuid.uuid4()}/stream", headers=auth),
        (live, "429"): crowded,
        (live, "500"): lambda c, _, r=route: broken_table(
            c, lambda: c.get(f"{r}/{uuid.uuid4()}/stream", headers=auth)
        ),
        (live, "503"): lambda c, _, r=route: via(
            no_postgres, "GET", f"{r}/{uuid.uuid4()}/stream", headers=auth
        ),
        (token, "200"): tokened,
        (token, "401"): lambda c, _, r=route: c.post(f"{r}/{uuid.uuid4()}/stream-token"),
        (token, "404"): lambda c, _, r=route: c.post(
            f"{r}/{uuid.uuid4()}/stream-token", headers=auth
        ),
        (token, "500"): lambda c, _, r=route: broken_table(
            c, lambda: c.post(f"{r}/{uuid.uuid4()}/stream-token", headers=auth)
        ),
        (token, "503"): lambda c, _, r=route: via(
            no_postgres, "POST", f"{r}/{uuid.uuid4()}/stream-token", headers=auth
        ),
    }


def _uncertain_provokers(
    route: str,
    body: dict[str, str],
    auth: dict[str, str],
    pool: Any,
    via: Any,
    no_redis: Any,
    broken_table: Any,
) -> dict[tuple[str, str], Provoke]:
    """A person's word on an uncertain call (docs/at-most-once.md), each
    documented status provoked: a job made to wait on one by its rows."""
    op = f"POST {route}/{{job_id}}/uncertain/{{call_id}}"
    call = "0123456789abcdef0123"

    async def waiting(c: Any, finished: bool = False) -> str:
        fresh = {**auth, "Idempotency-Key": f"probe-uncertain-{uuid.uuid4()}"}
        accepted = await c.post(route, json=body, headers=fresh)
        job_id = accepted.json()["job_id"]
        async with pool.connection() as conn:
            await conn.execute(
                "UPDATE jobs SET status = %s, waiting_for = %s,"
                " wait_until = now() + interval '1 day' WHERE job_id = %s",
                ("done" if finished else "waiting", f"uncertain:{call}", job_id),
            )
            await conn.execute(
                "INSERT INTO checkpoints (job_id, key, ordinal, kind, status, value, until)"
                " VALUES (%s, 'pay/uncertain', 1, 'uncertain', 'waiting', NULL,"
                " now() + interval '1 day')",
                (job_id,),
            )
        return f"{route}/{job_id}/uncertain/{call}"

    def word(b: Any = None, headers: dict[str, str] | None = None) -> Any:
        async def provoke(c: Any, _: Any) -> Any:
            sent = {"resend": True} if b is None else b
            sent_with = headers or {**auth, "Idempotency-Key": f"probe-word-{uuid.uuid4()}"}
            return await c.post(await waiting(c), json=sent, headers=sent_with)

        return provoke

    async def conflict(c: Any, _: Any) -> Any:
        return await c.post(
            await waiting(c, finished=True),
            json={"resend": True},
            headers={**auth, "Idempotency-Key": f"probe-word-{uuid.uuid4()}"},
        )

    nowhere = f"{route}/{uuid.uuid4()}/uncertain/{call}"
    h = {**auth, "Idempotency-Key": key()}
    return {
        (op, "202"): word(),
        (op, "400"): word(headers=auth),
        (op, "401"): lambda c, _: c.post(nowhere, json={"resend": True}),
        (op, "404"): lambda c, _: c.post(nowhere, json={"resend": True}, headers=h),
        (op, "409"): conflict,
        (op, "413"): lambda c, _: c.post(nowhere, json={"failed": "x" * 2_000_000}, headers=h),
        (op, "422"): word(b={"resend": True, "failed": "both"}),
        (op, "500"): lambda c, _: broken_table(
            c, lambda: c.post(nowhere, json={"resend": True}, headers=h)
        ),
        (op, "503"): lambda c, _: via(no_redis, "POST", nowhere, json={"resend": True}, headers=h),
    }


# -- every documented status, provoked ------------------------------------------------------


Provoke = Callable[[httpx.AsyncClient, dict[str, str]], Awaitable[httpx.Response]]


@pytest.fixture
async def provokers(
    settings, redis, pool, auth, database_url
) -> AsyncIterator[dict[tuple[str, str], Provoke]]:
    """For every (operation, status) pair: a request that answers it."""
    limited = asgi_app(settings.model_copy(update={"tenant_rpm": 1}), redis, pool)
    nowhere = make_redis(f"redis://127.0.0.1:{free_port()}/0")
    no_redis = asgi_app(settings, nowhere, pool)
    dead_pool = AsyncConnectionPool(
        _with_dbname(database_url, "x") + f" port={free_port()}", open=False, timeout=0.5
    )
    await dead_pool.open(wait=False)
    no_postgres = asgi_app(
        settings.model_copy(update={"pg_statement_timeout_s": 0.5}), redis, dead_pool
    )

    async def via(app: Any, method: str, path: str, **kw: Any) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.request(method, path, **kw)

    async def broken_table(c: httpx.AsyncClient, r: Callable[[], Awaitable[httpx.Response]]):
        async with pool.connection() as conn:
            await conn.execute("ALTER TABLE jobs RENAME TO jobs_away")
        try:
            return await r()
        finally:
            async with pool.connection() as conn:
                await conn.execute("ALTER TABLE jobs_away RENAME TO jobs")

    async def in_progress(c: httpx.AsyncClient, route: str, body: dict[str, str]) -> httpx.Response:
        store = IdempotencyStore(redis, lock_ttl_s=30, result_ttl_s=60)
        scope = Scope("acme", "POST", route, key(409))
        await store.claim(scope.digest, fingerprint(body), new_token(), tenant="acme")
        return await c.post(route, json=body, headers={**auth, "Idempotency-Key": key(409)})

    table: dict[tuple[str, str], Provoke] = {}
    h = {**auth, "Idempotency-Key": key()}
    for route, body in ((URL, BODY), ("/v1/triage", TICKET)):
        post, get = f"POST {route}", f"GET {route}/{{job_id}}"

        def p(b: dict[str, str] = body, r: str = route, headers: dict[str, str] = h) -> Any:
            return lambda c, _: c.post(r, json=b, headers=headers)

        async def created(c: httpx.AsyncClient, _: Any, r: str = route, b: Any = body) -> Any:
            accepted = await c.post(r, json=b, headers={**auth, "Idempotency-Key": key(200)})
            return await c.get(accepted.headers["location"], headers=auth)

        async def rate_limited(c: Any, _: Any, r: str = route, b: Any = body) -> Any:
            await via(limited, "POST", r, json=b, headers={**auth, "Idempotency-Key": key(1)})
            return await via(
                limited, "POST", r, json=b, headers={**auth, "Idempotency-Key": key(2)}
            )

        table |= {
            (post, "202"): p(),
            (post, "400"): p(headers=auth),
            (post, "401"): p(headers={"Idempotency-Key": key()}),
            (post, "409"): lambda c, _, r=route, b=body: in_progress(c, r, b),
            (post, "413"): lambda c, _, r=route: c.post(
                r, json={"text": "x" * 2_000_000}, headers=h
            ),
            (post, "422"): p(b={"text": ""}),
            (post, "429"): rate_limited,
            (post, "500"): lambda c, _, r=route, b=body: broken_table(
                c, lambda: c.post(r, json=b, headers={**auth, "Idempotency-Key": key(500)})
            ),
            (post, "503"): lambda c, _, r=route, b=body: via(
                no_redis, "POST", r, json=b, headers=h
            ),
            (get, "200"): created,
            (get, "401"): lambda c, _, r=route: c.get(f"{r}/{uuid.uuid4()}"),
            (get, "404"): lambda c, _, r=route: c.get(f"{r}/{uuid.uuid4()}", headers=auth),
            (get, "500"): lambda c, _, r=route: broken_table(
                c, lambda: c.get(f"{r}/{uuid.uuid4()}", headers=auth)
            ),
            (get, "503"): lambda c, _, r=route: via(
                no_postgres, "GET", f"{r}/{uuid.uuid4()}", headers=auth
            ),
        }
        cancel = f"POST {route}/{{job_id}}/cancel"

        async def cancelled(
            c: Any, _: Any, r: str = route, b: Any = body, done: bool = False
        ) -> Any:
            accepted = await c.post(r, json=b, headers={**auth, "Idempotency-Key": key(202)})
            if done:
                async with pool.connection() as conn:
                    await conn.execute("UPDATE jobs SET status = 'done'")
            return await c.post(accepted.headers["location"] + "/cancel", headers=auth)

        table |= {
            (cancel, "202"): cancelled,
            (cancel, "401"): lambda c, _, r=route: c.post(f"{r}/{uuid.uuid4()}/cancel"),
            (cancel, "404"): lambda c, _, r=route: c.post(
                f"{r}/{uuid.uuid4()}/cancel", headers=auth
            ),
            (cancel, "409"): lambda c, a, r=route, b=body: cancelled(c, a, r, b, done=True),
            (cancel, "500"): lambda c, _, r=route: broken_table(
                c, lambda: c.post(f"{r}/{uuid.uuid4()}/cancel", headers=auth)
            ),
            (cancel, "503"): lambda c, _, r=route: via(
                no_postgres, "POST", f"{r}/{uuid.uuid4()}/cancel", headers=auth
            ),
        }
        table |= _stream_provokers(route, body, auth, pool, redis, via, no_postgres, broken_table)
        table |= _uncertain_provokers(route, body, auth, pool, via, no_redis, broken_table)
    table |= {
        ("GET /healthz", "200"): lambda c, _: c.get("/healthz"),
        ("GET /readyz", "200"): lambda c, _: c.get("/readyz"),
        ("GET /readyz", "503"): lambda c, _: via(no_redis, "GET", "/readyz"),
        ("GET /metrics", "200"): lambda c, _: c.get("/metrics"),
    }
    yield table
    await nowhere.aclose()
    await dead_pool.close()


async def test_every_documented_status_is_reachable(client, auth, provokers):
    doc = (await client.get("/openapi.json")).json()
    documented = {
        (f"{method.upper()} {path}", status)
        for path, operations in doc["paths"].items()
        for method, operation in operations.items()
        for status in operation["responses"]
    }
    assert documented == set(provokers), "each documented status has its provoking request"
    for (operation, status), provoke in sorted(provokers.items()):
        r = await provoke(client, auth)
        assert str(r.status_code) == status, (operation, status, r.text)
        if r.status_code >= 400 and operation != "GET /readyz":
            assert r.headers["content-type"] == PROBLEM, (operation, status)
