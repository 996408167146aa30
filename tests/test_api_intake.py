"""POST /v1/summaries end to end through the ASGI app, on real Redis and Postgres.

Each test checks what was stored (job rows, stream messages, idempotency
records), not only the response.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from psycopg_pool import AsyncConnectionPool
from redis.asyncio import Redis

from oncely import names
from oncely.api.auth import create_api_key, revoke_api_key
from oncely.api.store import IdempotencyStore
from oncely.builtin.summaries import summaries
from oncely.identity import Scope
from tests.helpers import asgi_app
from tests.processes import wait_for

URL = "/v1/summaries"
BODY = {"text": "Idempotency keys make retries safe.", "notify": "ada@example.com"}


def headers(auth: dict[str, str], key: str = "req-0001-abcdefgh", **extra: str) -> dict[str, str]:
    return {**auth, "Idempotency-Key": key, **extra}


async def job_count(pool: AsyncConnectionPool) -> int:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT count(*) FROM jobs")
        row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def stream_entries(redis: Redis) -> list[dict[str, str]]:
    return [fields for _, fields in await redis.xrange(summaries.keys.stream)]


async def test_first_request_accepts_one_job_and_one_message(client, auth, pool, redis):
    r = await client.post(URL, json=BODY, headers=headers(auth))
    assert r.status_code == 202
    job_id = r.json()["job_id"]
    assert r.json() == {"job_id": job_id, "status": "queued"}
    assert r.headers["location"] == f"{URL}/{job_id}"
    assert "idempotent-replayed" not in r.headers
    assert await job_count(pool) == 1
    entries = await stream_entries(redis)
    assert len(entries) == 1
    assert entries[0]["job_id"] == job_id
    assert entries[0]["tenant"] == "acme"
    assert json.loads(entries[0]["payload"]) == BODY
    assert float(entries[0]["enqueued_at"]) > 0
    # The reconciler's index knows the entry.
    assert await redis.hget(summaries.keys.index, job_id) is not None


async def test_identical_retry_replays_byte_identical_without_new_message(
    client, auth, pool, redis
):
    first = await client.post(URL, json=BODY, headers=headers(auth))
    again = await client.post(URL, json=BODY, headers=headers(auth))
    assert again.status_code == first.status_code == 202
    assert again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"
    assert again.headers["location"] == first.headers["location"]
    assert await job_count(pool) == 1
    assert len(await stream_entries(redis)) == 1


async def test_same_key_different_body_is_422(client, auth, pool, redis):
    await client.post(URL, json=BODY, headers=headers(auth))
    r = await client.post(URL, json={**BODY, "text": "something else"}, headers=headers(auth))
    assert r.status_code == 422
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["type"].endswith("/problems/idempotency-key-reused")
    assert await job_count(pool) == 1
    assert len(await stream_entries(redis)) == 1


async def test_key_order_and_whitespace_do_not_make_a_different_body(client, auth, pool, redis):
    await client.post(URL, json=BODY, headers=headers(auth))
    reordered = '{ "notify" : "ada@example.com",\n  "text": "Idempotency keys make retries safe." }'
    r = await client.post(
        URL,
        content=reordered,
        headers=headers(auth, **{"Content-Type": "application/json"}),
    )
    assert r.status_code == 202
    assert r.headers["idempotent-replayed"] == "true"
    assert await job_count(pool) == 1


async def test_missing_key_is_400_and_stores_nothing(client, auth, pool, redis):
    r = await client.post(URL, json=BODY, headers=auth)
    assert r.status_code == 400
    assert r.json()["type"].endswith("/problems/idempotency-key-missing")
    assert await job_count(pool) == 0
    assert await redis.dbsize() == 0


@pytest.mark.parametrize(
    "raw",
    [
        [("Idempotency-Key", "too-short")],
        [("Idempotency-Key", "k" * 256)],
        [("Idempotency-Key", "abcdefghijklmnop\x7f")],
        [("Idempotency-Key", "req-0001-abcdefgh"), ("Idempotency-Key", "req-0001-abcdefgh")],
    ],
    ids=["too-short", "too-long", "non-printable", "repeated"],
)
async def test_malformed_key_is_400(client, auth, pool, redis, raw):
    r = await client.post(URL, json=BODY, headers=[*auth.items(), *raw])
    assert r.status_code == 400
    assert r.headers["content-type"] == "application/problem+json"
    assert await job_count(pool) == 0
    assert await redis.dbsize() == 0


async def test_quoted_structured_field_key_equals_bare_key(client, auth, pool):
    first = await client.post(URL, json=BODY, headers=headers(auth, key="req-0001-abcdefgh"))
    quoted = await client.post(URL, json=BODY, headers=headers(auth, key='"req-0001-abcdefgh"'))
    assert quoted.headers["idempotent-replayed"] == "true"
    assert quoted.content == first.content
    assert await job_count(pool) == 1


async def test_twenty_concurrent_duplicates_run_the_handler_once(client, auth, pool, redis):
    responses = await asyncio.gather(
        *(client.post(URL, json=BODY, headers=headers(auth)) for _ in range(20))
    )
    fresh = [
        r for r in responses if r.status_code == 202 and "idempotent-replayed" not in r.headers
    ]
    replayed = [r for r in responses if r.headers.get("idempotent-replayed") == "true"]
    busy = [r for r in responses if r.status_code == 409]
    assert len(fresh) == 1
    assert len(fresh) + len(replayed) + len(busy) == 20
    assert all(r.headers["retry-after"] == "1" for r in busy)
    assert all(r.json()["type"].endswith("idempotency-key-in-progress") for r in busy)
    assert all(r.content == fresh[0].content for r in replayed)
    assert await job_count(pool) == 1
    assert len(await stream_entries(redis)) == 1


async def test_two_tenants_with_the_same_key_get_independent_jobs(client, auth, pool):
    other = {"Authorization": f"Bearer {await create_api_key(pool, 'globex')}"}
    a = await client.post(URL, json=BODY, headers=headers(auth))
    b = await client.post(URL, json=BODY, headers=headers(other))
    assert a.status_code == b.status_code == 202
    assert "idempotent-replayed" not in b.headers
    assert a.json()["job_id"] != b.json()["job_id"]
    assert await job_count(pool) == 2
    own = await client.get(a.headers["location"], headers=auth)
    assert own.status_code == 200
    assert own.json()["status"] == "queued"
    foreign = await client.get(a.headers["location"], headers=other)
    assert foreign.status_code == 404
    assert foreign.json()["type"].endswith("/problems/not-found")


async def test_schema_invalid_body_claims_no_key_and_the_corrected_retry_runs(
    client, auth, pool, redis
):
    bad = await client.post(URL, json={"text": "", "notify": "nope"}, headers=headers(auth))
    assert bad.status_code == 422
    assert bad.headers["content-type"] == "application/problem+json"
    assert bad.json()["type"].endswith("/problems/validation")
    assert await redis.dbsize() == 0
    good = await client.post(URL, json=BODY, headers=headers(auth))
    assert good.status_code == 202
    assert "idempotent-replayed" not in good.headers
    assert await job_count(pool) == 1


async def test_body_over_the_limit_is_413(settings, redis, pool, auth):
    small = settings.model_copy(update={"max_body_bytes": 200})
    app = asgi_app(small, redis, pool)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.post(URL, json={**BODY, "text": "x" * 500}, headers=headers(auth))
    assert r.status_code == 413
    assert r.json()["type"].endswith("/problems/payload-too-large")
    assert await job_count(pool) == 0
    assert await redis.dbsize() == 0


async def test_chunked_body_over_the_limit_is_413(settings, redis, pool, auth):
    """No Content-Length: the limit is enforced while the body streams in."""
    small = settings.model_copy(update={"max_body_bytes": 200})
    app = asgi_app(small, redis, pool)

    async def chunks():
        yield b'{"text": "'
        for _ in range(10):
            yield b"x" * 50
        yield b'", "notify": "ada@example.com"}'

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.post(URL, content=chunks(), headers=headers(auth))
    assert r.status_code == 413
    assert await job_count(pool) == 0


@pytest.mark.parametrize(
    "authorization", [None, "Bearer onc_not-a-real-key", "Basic dXNlcjpwYXNz"], ids=str
)
async def test_missing_or_unknown_key_is_401(client, pool, redis, authorization):
    hdrs = {"Idempotency-Key": "req-0001-abcdefgh"}
    if authorization:
        hdrs["Authorization"] = authorization
    r = await client.post(URL, json=BODY, headers=hdrs)
    assert r.status_code == 401
    assert r.json()["type"].endswith("/problems/unauthorized")
    assert await job_count(pool) == 0
    assert await redis.dbsize() == 0


async def test_a_revoked_key_is_401_once_the_key_cache_expires(client, pool, api_key, auth):
    """The API trusts a key it looked up for ONCELY_API_KEY_CACHE_S (0.5 s
    in tests): right after revocation the cached key still works, without
    asking PostgreSQL; then it is refused."""
    assert (await client.post(URL, json=BODY, headers=headers(auth))).status_code == 202
    assert await revoke_api_key(pool, api_key) == "acme"
    cached = await client.post(URL, json=BODY, headers=headers(auth, key="req-0002-abcdefgh"))
    assert cached.status_code == 202, "answered from the cache"
    keys = iter(f"req-{n:04d}-abcdefgh" for n in range(3, 10_000))

    async def refused() -> bool:
        r = await client.post(URL, json=BODY, headers=headers(auth, key=next(keys)))
        return r.status_code == 401

    await wait_for(refused, 10, "the revoked key refused")
    accepted = await job_count(pool)
    r = await client.post(URL, json=BODY, headers=headers(auth, key="req-9999-abcdefgh"))
    assert r.status_code == 401
    assert await job_count(pool) == accepted, "a refused request stores nothing"


async def test_without_the_key_cache_a_revoked_key_is_401_at_once(settings, redis, pool):
    key = await create_api_key(pool, "acme")
    auth = {"Authorization": f"Bearer {key}"}
    app = asgi_app(settings.model_copy(update={"api_key_cache_s": 0}), redis, pool)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        assert (await c.post(URL, json=BODY, headers=headers(auth))).status_code == 202
        assert await revoke_api_key(pool, key) == "acme"
        r = await c.post(URL, json=BODY, headers=headers(auth, key="req-0002-abcdefgh"))
    assert r.status_code == 401
    assert await job_count(pool) == 1


async def test_redis_unreachable_is_503_and_nothing_is_stored(settings, pool, auth):
    dead = Redis.from_url("redis://127.0.0.1:1/0", decode_responses=True, socket_timeout=1)
    app = asgi_app(settings, dead, pool)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.post(URL, json=BODY, headers=headers(auth))
        ready = await c.get("/readyz")
    await dead.aclose()
    assert r.status_code == 503
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["type"].endswith("/problems/unavailable")
    assert ready.status_code == 503
    assert ready.json()["redis"] is False
    assert await job_count(pool) == 0


async def test_crash_before_the_enqueue_and_finalise_replays_the_acceptance_from_the_row(
    settings, redis, pool, auth, monkeypatch
):
    """The API dies after the insert, before the one write that enqueues the
    job and stores the response: the marker expires, and the retry finds the
    job row with the same body: the same 202 bytes, replayed from the row,
    and no message from the retry (the queued row is the reconciler's to
    restore, tests/test_reconcile.py)."""

    class Crash(BaseException):
        pass

    async def die(*args: object, **kwargs: object) -> bool:
        raise Crash

    short = settings.model_copy(update={"idempotency_lock_ttl_s": 0.2})
    app = asgi_app(short, redis, pool)
    monkeypatch.setattr(IdempotencyStore, "finalise", die)
    monkeypatch.setattr(IdempotencyStore, "release", die)  # a dead process releases nothing
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        with pytest.raises(Crash):
            await c.post(URL, json=BODY, headers=headers(auth))
        monkeypatch.undo()
        assert (await c.post(URL, json=BODY, headers=headers(auth))).status_code == 409
        await asyncio.sleep(0.3)  # the marker's TTL runs out
        retry = await c.post(URL, json=BODY, headers=headers(auth))
        again = await c.post(URL, json=BODY, headers=headers(auth))
    assert retry.status_code == 202
    assert retry.headers["idempotent-replayed"] == "true"
    assert retry.headers["location"] == f"{URL}/{retry.json()['job_id']}"
    assert again.content == retry.content and again.headers["idempotent-replayed"] == "true"
    assert await job_count(pool) == 1
    assert await stream_entries(redis) == []
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT job_id::text, status FROM jobs")
        assert await cur.fetchall() == [(retry.json()["job_id"], "queued")]


async def test_a_failed_enqueue_leaves_the_stored_answer_and_the_row(
    client, redis, pool, auth, capsys
):
    """The enqueue and the stored response go out together, and one failing
    does not stop the other: with the stream unusable (a string where the
    stream should be), the POST is still 202, its answer is stored (the
    retry is replayed from Redis, not from the row), the row is queued for
    the reconciler, and the failure is logged."""
    await redis.set(summaries.keys.stream, "not a stream")
    first = await client.post(URL, json=BODY, headers=headers(auth))
    assert first.status_code == 202
    assert "jobs.enqueue_failed" in capsys.readouterr().out
    record = json.loads(await redis.get(_idem_key(auth)) or "{}")
    assert record["state"] == "done" and record["status"] == 202
    retry = await client.post(URL, json=BODY, headers=headers(auth))
    assert retry.headers["idempotent-replayed"] == "true"
    assert retry.content == first.content
    assert await job_count(pool) == 1


async def test_scripts_redis_forgot_lose_nothing(client, redis, pool, auth):
    """SCRIPT FLUSH (a restarted Redis): the enqueue and the finalise, sent
    together, still both happen."""
    await client.post(URL, json=BODY, headers=headers(auth, key="req-warm-abcdefgh"))
    await redis.script_flush()
    r = await client.post(URL, json=BODY, headers=headers(auth))
    assert r.status_code == 202
    assert [e["job_id"] for e in await stream_entries(redis)][-1] == r.json()["job_id"]
    record = json.loads(await redis.get(_idem_key(auth)) or "{}")
    assert record["state"] == "done"


def _idem_key(auth: dict[str, str], key: str = "req-0001-abcdefgh") -> str:
    return names.idempotency_key(Scope("acme", "POST", URL, key).digest)


async def test_get_unknown_or_malformed_job_id_is_404(client, auth):
    for job_id in ("8a0e3b4e-0000-4000-8000-000000000000", "not-a-uuid"):
        r = await client.get(f"{URL}/{job_id}", headers=auth)
        assert r.status_code == 404
        assert r.headers["content-type"] == "application/problem+json"


async def test_get_job_requires_a_key(client):
    r = await client.get(f"{URL}/8a0e3b4e-0000-4000-8000-000000000000")
    assert r.status_code == 401


def metric(text: str, sample: str) -> float:
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_health_ready_and_metrics(client, auth):
    assert (await client.get("/healthz")).json() == {"status": "ok"}
    ready = await client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json() == {"ready": True, "redis": True, "postgres": True}
    replays = 'oncely_idempotency_replays_total{route="/v1/summaries"}'
    ok = 'oncely_requests_total{outcome="2xx",route="/v1/summaries"}'
    before = (await client.get("/metrics")).text
    await client.post(URL, json=BODY, headers=headers(auth))
    await client.post(URL, json=BODY, headers=headers(auth))
    after = (await client.get("/metrics")).text
    assert metric(after, replays) - metric(before, replays) == 1
    assert metric(after, ok) - metric(before, ok) == 2


async def test_openapi_documents_the_idempotency_contract(client):
    spec = (await client.get("/openapi.json")).json()
    post = spec["paths"]["/v1/summaries"]["post"]
    params = {p["name"]: p for p in post["parameters"]}
    assert params["Idempotency-Key"]["in"] == "header"
    assert "24 h" in params["Idempotency-Key"]["description"]
    for status in ("400", "401", "409", "413", "422", "503"):
        assert status in post["responses"]
    assert "Idempotent-Replayed" in post["responses"]["202"]["headers"]
    assert "Retry-After" in post["responses"]["409"]["headers"]
    assert "x-idempotency-retention" in spec["info"]


async def test_a_body_too_deep_or_too_wide_is_a_422_never_a_500(settings, redis, pool, auth):
    from structlog.testing import capture_logs

    app = asgi_app(settings, redis, pool)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    client = httpx.AsyncClient(transport=transport, base_url="http://t")
    with capture_logs() as logs:
        await _deep_and_wide(client, auth)
    assert await job_count(pool) == 0
    assert not [e for e in logs if e["event"] == "api.unhandled"]


async def _deep_and_wide(client: httpx.AsyncClient, auth: dict[str, str]) -> None:
    async with client:
        deep = "[" * 5000 + "]" * 5000
        for extra in ({}, headers(auth, "deep-body-000000001")):
            r = await client.post(
                "/v1/summaries",
                content=deep,
                headers={**extra, "Content-Type": "application/json"},
            )
            assert r.status_code == 422, r.text
            assert r.json()["errors"][0]["msg"] == "JSON nested too deeply"
        wide = {"text": "x", "notify": "a@example.com", "extra": list(range(50_000))}
        r = await client.post(
            "/v1/summaries",
            json={**wide, "text": list(range(50_000))},
            headers=headers(auth, "wide-body-000000001"),
        )
        assert r.status_code == 422, r.text
        body = r.json()
        assert len(body["errors"]) <= 20 and body["error_count"] >= 1
        assert len(r.content) < 10_000


async def test_two_authorization_headers_are_refused(settings, redis, pool, auth):
    app = asgi_app(settings, redis, pool)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        doubled = [("Authorization", auth["Authorization"]), ("Authorization", "Bearer onc_other")]
        r = await c.get("/v1/summaries/00000000-0000-4000-8000-000000000000", headers=doubled)
        assert r.status_code == 400, r.text
        r = await c.post(
            "/v1/summaries",
            json={"text": "hi", "notify": "a@example.com"},
            headers=[*doubled, ("Idempotency-Key", "doubled-auth-00000001")],
        )
        assert r.status_code == 400, r.text
    assert await job_count(pool) == 0
