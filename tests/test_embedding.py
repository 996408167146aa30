"""oncely's routes inside a team's own FastAPI service (its auth, its
lifespan), and `oncely api` as an ASGI factory under a plain uvicorn."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI, Header, HTTPException

from oncely.bootstrap import http_api
from oncely.builtin import app as builtin_app
from tests.processes import free_port, running, start_command, wait_healthy

BODY = {"text": "Mounted routes keep every guarantee.", "notify": "ada@example.com"}


async def team(x_team: str | None = Header(default=None)) -> str:
    """The host's own auth: whoever it says, as the tenant."""
    if not x_team:
        raise HTTPException(401, "who are you?")
    return x_team


async def test_routes_mount_into_an_existing_app_with_its_own_auth_and_lifespan(
    settings, pool, redis
):
    api = http_api(builtin_app, settings, auth=team)
    host = FastAPI(lifespan=api.lifespan)

    @host.get("/hello")
    async def hello() -> dict[str, str]:
        return {"hello": "world"}

    api.mount(host, prefix="/ai")
    async with host.router.lifespan_context(host):
        transport = httpx.ASGITransport(app=host)
        async with httpx.AsyncClient(transport=transport, base_url="http://host") as client:
            headers = {"X-Team": "blue", "Idempotency-Key": "mounted-route-key-01"}
            first = await client.post("/ai/v1/summaries", json=BODY, headers=headers)
            again = await client.post("/ai/v1/summaries", json=BODY, headers=headers)
            no_key = await client.post("/ai/v1/summaries", json=BODY, headers={"X-Team": "blue"})
            anonymous = await client.post("/ai/v1/summaries", json=BODY)
            job_url = first.headers["location"]
            own = await client.get(job_url, headers={"X-Team": "blue"})
            other = await client.get(job_url, headers={"X-Team": "red"})
            # No stream token under the host's auth: it would open nothing.
            token = await client.post(f"{job_url}/stream-token", headers={"X-Team": "blue"})
            assert token.status_code in (404, 405), token.text
            assert (await client.get("/hello")).json() == {"hello": "world"}
    assert first.status_code == 202
    assert job_url.startswith("/ai/v1/summaries/")
    assert again.content == first.content and again.headers["idempotent-replayed"] == "true"
    assert no_key.status_code == 400
    assert no_key.headers["content-type"] == "application/problem+json"
    assert anonymous.status_code == 401, "the host's auth decides"
    assert own.json()["status"] == "queued"
    assert other.status_code == 404, "tenants come from the host's auth"
    async with pool.connection() as conn:
        rows = await (await conn.execute("SELECT tenant, kind FROM jobs")).fetchall()
    assert rows == [("blue", "summaries")]
    assert await redis.xlen("oncely:{summaries}:stream") == 1
    with pytest.raises(RuntimeError, match="lifespan"):
        _ = api.clients  # closed with the host


@pytest.mark.slow
async def test_the_api_is_an_asgi_factory_for_plain_uvicorn(
    redis_url, database_url, redis, pool, tmp_path
):
    from oncely.api.auth import create_api_key

    key = await create_api_key(pool, "acme")
    port = free_port()
    log = tmp_path / "uvicorn.log"
    env = {"ONCELY_REDIS_URL": redis_url, "ONCELY_DATABASE_URL": database_url}
    factory = ["-m", "uvicorn", "--factory", "oncely.bootstrap:asgi_app", "--port", str(port)]
    proc = start_command(factory, env, log)
    base = f"http://127.0.0.1:{port}"
    with running(proc):
        await wait_healthy(base, proc, log)
        async with httpx.AsyncClient(base_url=base) as client:
            r = await client.post(
                "/v1/triage",
                json={"subject": "Hi", "body": "A question about my account."},
                headers={"Authorization": f"Bearer {key}", "Idempotency-Key": "factory-key-0001"},
            )
            ready = await client.get("/readyz")
    assert r.status_code == 202, r.text
    assert ready.json() == {"ready": True, "redis": True, "postgres": True}
    async with pool.connection() as conn:
        row = await (await conn.execute("SELECT kind, status FROM jobs")).fetchone()
    assert row == ("triage", "queued")
