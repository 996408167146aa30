"""The intake's hardening on the shared test servers: fingerprints kept with
the job row, a truthful 202/503, and the maximum hold of a key.

Faults are real: Redis forgets its data (FLUSHDB), the stream key holds the
wrong type (XADD fails), a transaction holds the job's row (the insert gets
no answer in time). Frozen servers are in ``test_intake_faults.py``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import psycopg
import pytest
from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from psycopg.types.json import Jsonb
from pydantic import BaseModel
from structlog.testing import capture_logs

from oncely import names
from oncely.api.idempotency import IdempotentRequest
from oncely.builtin.summaries import summaries
from oncely.identity import Scope, fingerprint
from oncely.jobs.reconcile import Reconciler
from oncely.sql import query
from tests.helpers import asgi_app, rows
from tests.processes import wait_for

URL = "/v1/summaries"
BODY = {"text": "The row remembers the body.", "notify": "ada@example.com"}
KEY = "hardening-key-0001"


def headers(auth: dict[str, str], key: str = KEY) -> dict[str, str]:
    return {**auth, "Idempotency-Key": key}


async def running_markers(redis) -> list[str]:
    """Idempotency keys held by a request in progress."""
    found = []
    async for key in redis.scan_iter(names.IDEMPOTENCY_PREFIX + "*"):
        raw = await redis.get(key)
        if raw is not None and json.loads(raw)["state"] == "running":
            found.append(key)
    return found


# -- the fingerprint lives with the job row ---------------------------------------


async def test_after_redis_forgot_the_key_another_body_is_422_and_the_same_body_replays(
    client, auth, pool, redis
):
    first = await client.post(URL, json=BODY, headers=headers(auth))
    assert first.status_code == 202
    await redis.flushdb()  # the 24 h record expired, or Redis lost its data

    other = await client.post(URL, json={**BODY, "text": "another"}, headers=headers(auth))
    same = await client.post(URL, json=BODY, headers=headers(auth))

    assert other.status_code == 422
    assert other.headers["content-type"] == "application/problem+json"
    assert other.json()["type"].endswith("/problems/idempotency-key-reused")
    assert same.status_code == 202
    assert same.content == first.content, "the original acceptance, byte for byte"
    assert same.headers["location"] == first.headers["location"]
    assert same.headers["idempotent-replayed"] == "true"
    assert await redis.xlen(summaries.keys.stream) == 0, "not enqueued again"
    [(payload, fp)] = await rows(pool, "SELECT payload, fingerprint FROM jobs")
    assert payload == BODY, "the reused key did not overwrite the job"
    assert fp == fingerprint(BODY)


async def test_the_replay_from_the_row_is_stored_for_the_next_retry(client, auth, redis):
    await client.post(URL, json=BODY, headers=headers(auth))
    await redis.flushdb()
    from_row = await client.post(URL, json=BODY, headers=headers(auth))
    from_redis = await client.post(URL, json=BODY, headers=headers(auth))
    assert from_redis.content == from_row.content
    assert from_redis.headers.get_list("idempotent-replayed") == ["true"]


async def test_a_row_accepted_before_fingerprints_were_kept_replays_the_acceptance(
    client, auth, pool, redis
):
    job_id = str(Scope("acme", "POST", URL, KEY).job_id)
    async with pool.connection() as conn:  # as an older API wrote it
        await conn.execute(query("insert_job"), (job_id, "acme", "summaries", Jsonb(BODY)))
    r = await client.post(URL, json={**BODY, "text": "cannot tell"}, headers=headers(auth))
    assert r.status_code == 202
    assert r.json() == {"job_id": job_id, "status": "queued"}
    assert r.headers["idempotent-replayed"] == "true"
    assert await redis.xlen(summaries.keys.stream) == 0


# -- truthful answers -------------------------------------------------------------


async def test_a_failed_enqueue_after_the_row_committed_answers_202_and_is_dispatched_again(
    client, auth, pool, redis, jobs
):
    """The row is the record of acceptance: XADD failing afterwards is not a
    503 (the job would run anyway). The process dispatches it again itself
    as soon as Redis answers, once: the reconciler finds nothing to do."""
    await redis.set(summaries.keys.stream, "not a stream")  # every XADD fails (WRONGTYPE)
    with capture_logs() as logs:
        r = await client.post(URL, json=BODY, headers=headers(auth))
    assert r.status_code == 202
    job_id = r.json()["job_id"]
    assert [e["job_id"] for e in logs if e["event"] == "jobs.enqueue_failed"] == [job_id]
    assert await rows(pool, "SELECT status FROM jobs") == [("queued",)]
    replay = await client.post(URL, json=BODY, headers=headers(auth))
    assert replay.content == r.content and replay.headers["idempotent-replayed"] == "true"

    await redis.delete(summaries.keys.stream)

    async def dispatched() -> bool:
        return await redis.exists(summaries.keys.stream) and bool(
            await redis.xrange(summaries.keys.stream)
        )

    await wait_for(dispatched, within_s=30, what="the job dispatched again")
    assert await Reconciler(jobs, "summaries", after_s=0.01).run_once() == 0
    [(_, fields)] = await redis.xrange(summaries.keys.stream)
    assert fields["job_id"] == job_id


@pytest.fixture
def slow_insert_settings(settings):
    return settings.model_copy(update={"pg_statement_timeout_s": 0.5})


async def hold_row(database_url: str, job_id: str, *, token: str | None = None):
    """A transaction that has inserted ``job_id`` and not committed: an
    insert of the same id waits for it, as on a stalled server."""
    conn = await psycopg.AsyncConnection.connect(database_url)
    await conn.execute(
        "INSERT INTO jobs (job_id, tenant, kind, payload, fingerprint, intake_token)"
        " VALUES (%s, 'acme', 'summaries', %s, %s, %s)",
        (job_id, Jsonb(BODY), fingerprint(BODY), token),
    )
    return conn


async def test_an_insert_without_an_answer_is_503_and_withdrawn_then_the_retry_is_fresh(
    slow_insert_settings, redis, pool, auth, database_url
):
    """The insert waits on a lock past the statement bound: 503 at once, and
    whatever becomes of the insert, the job never runs; the retry with the
    same key is a fresh acceptance."""
    app = asgi_app(slow_insert_settings, redis, pool)
    job_id = str(Scope("acme", "POST", URL, KEY).job_id)
    blocker = await hold_row(database_url, job_id)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        # The row stays locked until the rollback below: a request that waited
        # for the lock would meet the test's timeout; the bound answers it.
        r = await c.post(URL, json=BODY, headers=headers(auth))
        assert r.status_code == 503
        assert r.json()["type"].endswith("/problems/unavailable")
        await blocker.rollback()  # the stall ends: the late insert may land now
        await blocker.close()

        async def withdrawn() -> bool:
            return await rows(pool, "SELECT status FROM jobs") == [("withdrawn",)]

        await wait_for(withdrawn, 10, "the intake withdrawn")
        assert (await c.get(f"{URL}/{job_id}", headers=auth)).status_code == 404
        assert await redis.xlen(summaries.keys.stream) == 0
        retry = await c.post(URL, json=BODY, headers=headers(auth))
    assert retry.status_code == 202
    assert "idempotent-replayed" not in retry.headers
    assert await rows(pool, "SELECT status, payload FROM jobs") == [("queued", BODY)]
    [(_, fields)] = await redis.xrange(summaries.keys.stream)
    assert fields["job_id"] == job_id


async def test_a_withdrawal_never_touches_a_row_another_request_recorded(
    slow_insert_settings, settings, redis, pool, auth, database_url
):
    """The row that blocked the insert belongs to another request (Redis had
    forgotten the key) and commits: it stays queued and is replayed."""
    app = asgi_app(slow_insert_settings, redis, pool)
    job_id = str(Scope("acme", "POST", URL, KEY).job_id)
    blocker = await hold_row(database_url, job_id, token="00000000-0000-4000-8000-000000000001")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        with capture_logs() as logs:
            assert (await c.post(URL, json=BODY, headers=headers(auth))).status_code == 503
            await blocker.commit()
            await blocker.close()

            async def settled() -> bool:
                return any(e["event"] == "intake.withdrawn" for e in logs)

            await wait_for(settled, 10, "the withdrawal to run")
        [withdrawal] = [e for e in logs if e["event"] == "intake.withdrawn"]
        assert withdrawal["undone"] is False
        assert await rows(pool, "SELECT status FROM jobs") == [("queued",)]
    # The retry through an API with the usual bounds (this one's statements
    # time out after half a second, which a busy machine can reach).
    usual = asgi_app(settings, redis, pool)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=usual), base_url="http://t"
    ) as c:
        retry = await c.post(URL, json=BODY, headers=headers(auth))
    assert retry.status_code == 202
    assert retry.headers["idempotent-replayed"] == "true"


# -- the maximum hold -------------------------------------------------------------


class Echo(BaseModel):
    value: int


@dataclass
class Handler:
    """What the test route's handler does; tests flip these between requests."""

    hang: bool = True
    settle_first: bool = False
    calls: int = 0
    cancelled: int = 0
    fingerprints: list[str] = field(default_factory=list)


def hold_router(handler: Handler, idempotent: object) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/hold", status_code=201)
    async def hold(body: Echo, idem: IdempotentRequest = Depends(idempotent)) -> Response:  # type: ignore[arg-type]
        async def run() -> Response:
            handler.calls += 1
            handler.fingerprints.append(idem.fingerprint)
            response = JSONResponse({"value": body.value, "call": handler.calls}, 201)
            if handler.settle_first:
                idem.settle(response)
            try:
                while handler.hang:
                    await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                handler.cancelled += 1
                raise
            return response

        return await idem.run(body, run)

    return router


@pytest.fixture
async def hold_client(
    settings, redis, pool, auth
) -> AsyncIterator[tuple[httpx.AsyncClient, Handler]]:
    short = settings.model_copy(
        update={"idempotency_max_hold_s": 1.0, "idempotency_lock_ttl_s": 0.3}
    )
    app = asgi_app(short, redis, pool)
    handler = Handler()
    app.include_router(hold_router(handler, app.state.oncely.idempotent))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t", headers=auth) as c:
        yield c, handler


async def test_a_handler_past_the_max_hold_is_cancelled_its_key_released_and_503(
    hold_client, redis
):
    client, handler = hold_client
    hdrs = {"Idempotency-Key": KEY}
    started = time.monotonic()
    first = asyncio.create_task(client.post("/v1/hold", json={"value": 1}, headers=hdrs))
    await asyncio.sleep(0.7)  # past the 0.3 s lock TTL: the lock is renewed
    duplicate = await client.post("/v1/hold", json={"value": 1}, headers=hdrs)
    r = await first
    took = time.monotonic() - started
    assert duplicate.status_code == 409
    assert r.status_code == 503
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["type"].endswith("/problems/unavailable")
    assert r.headers["retry-after"] == "1"
    assert took >= 1.0  # held its 1 s; the max hold ends it (the handler hangs forever)
    assert handler.cancelled == 1
    assert await running_markers(redis) == []
    handler.hang = False
    retry = await client.post("/v1/hold", json={"value": 1}, headers=hdrs)
    assert retry.status_code == 201
    assert handler.calls == 2
    assert handler.fingerprints == [fingerprint({"value": 1})] * 2


async def test_a_settled_outcome_is_answered_and_stored_even_past_the_max_hold(hold_client, redis):
    """A handler whose outcome is durable says so: being stopped later does
    not turn it into a 503."""
    client, handler = hold_client
    handler.settle_first = True
    hdrs = {"Idempotency-Key": KEY}
    r = await client.post("/v1/hold", json={"value": 2}, headers=hdrs)
    assert r.status_code == 201
    assert r.json() == {"value": 2, "call": 1}
    assert handler.cancelled == 1
    replay = await client.post("/v1/hold", json={"value": 2}, headers=hdrs)
    assert replay.content == r.content and replay.headers["idempotent-replayed"] == "true"
    assert handler.calls == 1


async def test_browsers_on_a_listed_origin_may_call_and_read_the_answers(
    settings, redis, pool
) -> None:
    """``ONCELY_CORS_ORIGINS``: a listed origin's preflight is answered and
    its answers carry the headers a browser needs to read them; another
    origin gets none; ``*`` is refused as a setting."""
    import httpx
    from pydantic import ValidationError

    from oncely.settings import Settings
    from tests.helpers import asgi_app

    allowed = "https://app.example.com"
    app = asgi_app(settings.model_copy(update={"cors_origins": allowed}), redis, pool)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            preflight = await client.options(
                "/v1/summaries",
                headers={
                    "Origin": allowed,
                    "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": "authorization,idempotency-key",
                },
            )
            refused = await client.get("/v1/summaries/x", headers={"Origin": allowed})
            elsewhere = await client.get("/v1/summaries/x", headers={"Origin": "https://evil.io"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == allowed
    assert "idempotency-key" in preflight.headers["access-control-allow-headers"].lower()
    assert refused.status_code == 401
    assert refused.headers["access-control-allow-origin"] == allowed
    assert "access-control-allow-origin" not in elsewhere.headers
    with pytest.raises(ValidationError, match="never"):
        Settings(cors_origins="*")
