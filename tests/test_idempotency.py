"""The idempotency machinery on a second, tiny route with its own handler.

The route counts handler runs, so every test can assert how many times the
work really happened.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any

import httpx
import pytest
from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from structlog.testing import capture_logs

from oncely import names
from oncely.api.idempotency import IdempotentRequest
from oncely.builtin.summaries import SummaryRequest
from oncely.redis_client import ScriptCall
from tests.helpers import asgi_app

KEY = "echo-key-0001-abcdef"


class Echo(BaseModel):
    value: int


@dataclass
class Behaviour:
    """What the echo handler does next; tests flip these between requests."""

    mode: str = "ok"  # ok | raise | 500 | settle-then-500
    calls: int = 0
    entered: asyncio.Event = field(default_factory=asyncio.Event)
    gate: asyncio.Event | None = None
    # With settle-then-500: the write that follows from the settled outcome.
    along: ScriptCall | None = None


@pytest.fixture
def behaviour() -> Behaviour:
    return Behaviour()


def echo_router(behaviour: Behaviour, idempotent: Any) -> APIRouter:
    """Any POST route of one's own, made idempotent by the API's dependency."""
    router = APIRouter()

    @router.post("/v1/echo", status_code=201)
    async def echo(body: Echo, idem: IdempotentRequest = Depends(idempotent)) -> Response:
        async def handler() -> Response:
            behaviour.calls += 1
            call = behaviour.calls
            behaviour.entered.set()
            if behaviour.gate is not None:
                await behaviour.gate.wait()
            if behaviour.mode == "raise":
                raise RuntimeError("handler failed")
            if behaviour.mode == "500":
                return JSONResponse({"error": "boom"}, status_code=500)
            if behaviour.mode == "settle-then-500":
                settled = JSONResponse({"value": body.value, "call": call}, status_code=201)
                idem.settle(settled, along=[behaviour.along] if behaviour.along else [])
                return JSONResponse({"error": "boom after the outcome"}, status_code=500)
            return JSONResponse({"value": body.value, "call": call}, status_code=201)

        return await idem.run(body, handler)

    return router


@pytest.fixture
async def echo(settings, redis, pool, behaviour, auth) -> AsyncIterator[httpx.AsyncClient]:
    app = asgi_app(settings, redis, pool)
    app.include_router(echo_router(behaviour, app.state.oncely.idempotent))
    # The app answers 500 to an unhandled exception, then re-raises it for
    # the server's log; a real server would not hand it to the client.
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t", headers=auth) as c:
        yield c


def hdrs(**extra: str) -> dict[str, str]:
    return {"Idempotency-Key": KEY, **extra}


async def idem_keys(redis) -> list[str]:
    return [k async for k in redis.scan_iter(names.IDEMPOTENCY_PREFIX + "*")]


async def test_any_post_route_gets_replay_from_the_dependency(echo, behaviour):
    first = await echo.post("/v1/echo", json={"value": 7}, headers=hdrs())
    again = await echo.post("/v1/echo", json={"value": 7}, headers=hdrs())
    assert first.status_code == again.status_code == 201
    assert again.content == first.content == b'{"value":7,"call":1}'
    assert again.headers["idempotent-replayed"] == "true"
    assert behaviour.calls == 1


async def test_a_key_is_scoped_to_its_route(echo, behaviour, auth, redis):
    await echo.post("/v1/echo", json={"value": 7}, headers=hdrs())
    other = await echo.post(
        "/v1/summaries", json={"text": "t", "notify": "a@example.com"}, headers=hdrs()
    )
    assert other.status_code == 202
    assert "idempotent-replayed" not in other.headers
    assert len(await idem_keys(redis)) == 2


async def test_handler_exception_releases_the_key_and_the_retry_runs(echo, behaviour, redis):
    behaviour.mode = "raise"
    failed = await echo.post("/v1/echo", json={"value": 1}, headers=hdrs())
    assert failed.status_code == 500
    assert failed.headers["content-type"] == "application/problem+json"
    assert await idem_keys(redis) == []
    behaviour.mode = "ok"
    retry = await echo.post("/v1/echo", json={"value": 1}, headers=hdrs())
    assert retry.status_code == 201
    assert "idempotent-replayed" not in retry.headers
    assert behaviour.calls == 2


async def test_handler_5xx_is_not_stored_and_the_retry_runs(echo, behaviour, redis):
    behaviour.mode = "500"
    failed = await echo.post("/v1/echo", json={"value": 1}, headers=hdrs())
    assert failed.status_code == 500
    assert await idem_keys(redis) == []
    behaviour.mode = "ok"
    retry = await echo.post("/v1/echo", json={"value": 1}, headers=hdrs())
    assert retry.status_code == 201
    assert behaviour.calls == 2


async def test_a_5xx_after_settling_releases_the_key_and_still_sends_the_writes_along(
    echo, behaviour, redis
):
    """The handler's outcome was durable (settled) with writes that follow
    from it, then it answered 5xx: the 5xx is not stored, the key is released
    so the retry runs, and the writes still go out, once per run."""
    incr = redis.register_script("return redis.call('INCR', KEYS[1])")
    behaviour.mode = "settle-then-500"
    behaviour.along = ScriptCall(incr, ["echo:along"], [])
    failed = await echo.post("/v1/echo", json={"value": 1}, headers=hdrs())
    assert failed.status_code == 500
    assert await idem_keys(redis) == []
    assert await redis.get("echo:along") == "1"
    behaviour.mode = "ok"
    retry = await echo.post("/v1/echo", json={"value": 1}, headers=hdrs())
    assert retry.status_code == 201
    assert "idempotent-replayed" not in retry.headers
    assert behaviour.calls == 2
    assert await redis.get("echo:along") == "1", "the retry's outcome sent nothing along"


async def test_cancelled_request_releases_the_key(echo, behaviour, redis):
    """The client goes away mid-handler: shielded cleanup still frees the key."""
    behaviour.gate = asyncio.Event()
    request = asyncio.create_task(echo.post("/v1/echo", json={"value": 1}, headers=hdrs()))
    await behaviour.entered.wait()
    assert len(await idem_keys(redis)) == 1
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    await asyncio.sleep(0.05)  # the shielded release finishes on its own
    assert await idem_keys(redis) == []
    behaviour.gate = None
    retry = await echo.post("/v1/echo", json={"value": 1}, headers=hdrs())
    assert retry.status_code == 201
    assert behaviour.calls == 2


async def test_in_flight_duplicate_gets_409_with_retry_after(echo, behaviour):
    behaviour.gate = asyncio.Event()
    first = asyncio.create_task(echo.post("/v1/echo", json={"value": 1}, headers=hdrs()))
    await behaviour.entered.wait()
    dup = await echo.post("/v1/echo", json={"value": 1}, headers=hdrs())
    different = await echo.post("/v1/echo", json={"value": 2}, headers=hdrs())
    behaviour.gate.set()
    assert (await first).status_code == 201
    assert dup.status_code == 409
    assert dup.headers["retry-after"] == "1"
    assert different.status_code == 422, "a different body is checked before 409"
    assert behaviour.calls == 1


async def test_prefer_wait_waits_for_the_first_and_replays_it(echo, behaviour):
    behaviour.gate = asyncio.Event()
    first = asyncio.create_task(echo.post("/v1/echo", json={"value": 1}, headers=hdrs()))
    await behaviour.entered.wait()
    waiting = asyncio.create_task(
        echo.post("/v1/echo", json={"value": 1}, headers=hdrs(Prefer="wait=2"))
    )
    await asyncio.sleep(0.2)
    assert not waiting.done()
    behaviour.gate.set()
    original, replay = await first, await waiting
    assert replay.status_code == 201
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.content == original.content
    assert behaviour.calls == 1


async def test_prefer_wait_gives_up_with_409_after_n_seconds(echo, behaviour):
    behaviour.gate = asyncio.Event()
    first = asyncio.create_task(echo.post("/v1/echo", json={"value": 1}, headers=hdrs()))
    await behaviour.entered.wait()
    dup = await echo.post("/v1/echo", json={"value": 1}, headers=hdrs(Prefer="wait=1"))
    behaviour.gate.set()
    await first
    assert dup.status_code == 409
    assert behaviour.calls == 1


async def test_request_that_lost_its_lock_cannot_overwrite_the_new_owner(echo, behaviour, redis):
    """A pauses past its lock; B takes the key over and finishes; A's late
    result is dropped (token guard) and the lost lock is logged."""
    paused = behaviour.gate = asyncio.Event()
    slow = asyncio.create_task(echo.post("/v1/echo", json={"value": 1}, headers=hdrs()))
    await behaviour.entered.wait()
    [key] = await idem_keys(redis)
    await redis.delete(key)  # A's lock expired while it was paused
    behaviour.gate = None
    newer = await echo.post("/v1/echo", json={"value": 1}, headers=hdrs())
    assert newer.status_code == 201
    with capture_logs() as logs:
        paused.set()
        late = await slow
    assert late.status_code == 201
    assert any(e["event"] == "idempotency.lock_lost" for e in logs)
    assert all(KEY not in str(e) for e in logs), "raw keys are never logged"
    replay = await echo.post("/v1/echo", json={"value": 1}, headers=hdrs())
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.content == newer.content
    assert behaviour.calls == 2


async def test_long_handler_renews_its_lock(settings, redis, pool, auth, behaviour):
    """A handler slower than the lock TTL keeps its key: no second run."""
    # A TTL of 1 s renewed every third of it: only a loop stalled for a
    # whole second (a loaded machine) could lose it, not a busy moment.
    short = settings.model_copy(update={"idempotency_lock_ttl_s": 1.0})
    app = asgi_app(short, redis, pool)
    app.include_router(echo_router(behaviour, app.state.oncely.idempotent))
    behaviour.gate = asyncio.Event()
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://t", headers=auth
    ) as c:
        first = asyncio.create_task(c.post("/v1/echo", json={"value": 1}, headers=hdrs()))
        await behaviour.entered.wait()
        await asyncio.sleep(2.5)  # well past the 1 s TTL
        try:
            # A lost lock would run the handler again, which waits on the
            # gate: bounded, so the test fails instead of hanging.
            dup = await asyncio.wait_for(c.post("/v1/echo", json={"value": 1}, headers=hdrs()), 30)
        finally:
            behaviour.gate.set()
        assert (await first).status_code == 201
    assert dup.status_code == 409
    assert behaviour.calls == 1


class _Line(BaseModel):
    sku: str = Field(alias="SKU")
    quantity: int
    price: Decimal


class _Order(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    customer: str = Field(alias="customerName")
    placed_at: datetime
    lines: list[_Line]
    note: str | None = None
    tags: set[str] = Field(default_factory=set)


def test_a_models_fingerprint_is_what_it_always_was() -> None:
    """The intake fingerprints a model from its JSON dump by alias, not
    through FastAPI's ``jsonable_encoder``: the same bytes, or every retry
    spanning an upgrade would be refused as a reused key."""
    from fastapi.encoders import jsonable_encoder

    from oncely.api.idempotency import _jsonable
    from oncely.identity import fingerprint

    order = _Order.model_validate(
        {
            "customerName": "Ada",
            "placed_at": "2026-12-02T10:00:00+01:00",
            "lines": [{"SKU": "a-1", "quantity": 2, "price": "9.90"}],
            "tags": ["gift"],
        }
    )
    assert fingerprint(_jsonable(order)) == fingerprint(jsonable_encoder(order))
    for builtin in (SummaryRequest(text="One. Two.", notify="ada@example.com"),):
        assert fingerprint(_jsonable(builtin)) == fingerprint(jsonable_encoder(builtin))
    assert _jsonable({"not": "a model"}) == {"not": "a model"}
