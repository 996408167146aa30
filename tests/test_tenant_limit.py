"""ONCELY_TENANT_RPM: a tenant over its intake limit gets 429 with the
RateLimit headers, claims no key and stores nothing; others go on."""

from __future__ import annotations

import httpx

from oncely.api.auth import create_api_key
from tests.helpers import asgi_app

BODY = {"text": "Limited.", "notify": "ada@example.com"}


async def test_a_tenant_over_its_limit_is_refused_before_anything_is_stored(settings, redis, pool):
    app = asgi_app(settings.model_copy(update={"tenant_rpm": 2}), redis, pool)
    keys = {t: await create_api_key(pool, t) for t in ("acme", "globex")}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:

        async def post(tenant: str, n: int) -> httpx.Response:
            headers = {
                "Authorization": f"Bearer {keys[tenant]}",
                "Idempotency-Key": f"limit-{tenant}-{n:06d}",
            }
            return await c.post("/v1/summaries", json=BODY, headers=headers)

        first, second, third = [await post("acme", n) for n in range(3)]
        other = await post("globex", 0)
    assert [r.status_code for r in (first, second)] == [202, 202]
    assert third.status_code == 429
    assert third.headers["content-type"] == "application/problem+json"
    assert third.json()["type"].endswith("/rate-limited")
    assert int(third.headers["retry-after"]) >= 1
    assert third.headers["ratelimit-policy"] == '"tenant";q=2;w=60'
    assert third.headers["ratelimit"].startswith('"tenant";r=0;t=')
    assert other.status_code == 202, "another tenant has its own allowance"
    async with pool.connection() as conn:
        row = await (await conn.execute("SELECT count(*) FROM jobs")).fetchone()
    assert row == (3,), "the refused request stored nothing"
    assert len([k async for k in redis.scan_iter(match="oncely:idem:*")]) == 3, "nor claimed a key"
