"""Isolation probe (docs/http-api.md): with two tenants, every tenant-scoped
route tried with the other tenant's job ids and Idempotency-Keys finds
nothing and changes nothing of the other's. Evidence: every row, stream
entry and idempotency record of the first tenant, before and after.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest

from oncely.api.auth import create_api_key
from oncely.builtin import app as builtin_app
from oncely.names import tenant_digest as tenant_tag
from tests.helpers import asgi_app, rows

WORKFLOWS = {
    "/v1/summaries": {"text": "Acme's private text.", "notify": "ada@acme.example.com"},
    "/v1/triage": {"subject": "Acme's invoice", "body": "Acme's private ticket."},
}
KEY = "shared-looking-key-0001"


async def state(pool, redis) -> dict[str, Any]:
    """Everything the intake and the worker keep: rows (not api_keys, whose
    last use changes with every request) and every Redis key's value."""
    found: dict[str, Any] = {}
    for table in ("jobs", "results", "outbox"):
        found[table] = {repr(r) for r in await rows(pool, f"SELECT * FROM {table}")}
    async for name in redis.scan_iter("*"):
        kind = await redis.type(name)
        if kind == "string":
            found[name] = await redis.get(name)
        elif kind == "hash":
            found[name] = await redis.hgetall(name)
        elif kind == "stream":
            found[name] = {entry_id: fields for entry_id, fields in await redis.xrange(name)}
        elif kind == "zset":
            found[name] = dict(await redis.zrange(name, 0, -1, withscores=True))
        else:
            found[name] = kind
    return found


def kept(before: dict[str, Any], after: dict[str, Any]) -> None:
    """Everything in ``before`` is in ``after``, unchanged."""
    for name, value in before.items():
        assert name in after, f"{name} disappeared"
        if isinstance(value, set):
            assert value <= after[name], f"{name}: rows changed"
        elif isinstance(value, dict):
            assert {k: after[name].get(k) for k in value} == value, f"{name} changed"
        else:
            assert after[name] == value, f"{name} changed"


@pytest.fixture
async def tenants(client, pool):
    """Acme with a job in each workflow (by KEY); Globex's key."""
    acme = {"Authorization": f"Bearer {await create_api_key(pool, 'acme')}"}
    globex = {"Authorization": f"Bearer {await create_api_key(pool, 'globex')}"}
    jobs = {}
    for route, body in WORKFLOWS.items():
        r = await client.post(route, json=body, headers={**acme, "Idempotency-Key": KEY})
        assert r.status_code == 202
        jobs[route] = r.json()["job_id"]
    return acme, globex, jobs


def spellings(job_id: str) -> list[str]:
    """The forms ``uuid.UUID`` reads as the same id."""
    u = uuid.UUID(job_id)
    return [job_id, job_id.upper(), u.hex, f"{{{job_id}}}", u.urn]


async def test_reads_with_the_other_tenants_job_ids_find_nothing_and_change_nothing(
    client, pool, redis, tenants
):
    acme, globex, jobs = tenants
    before = await state(pool, redis)
    assert len(builtin_app) == len(jobs) == 2
    for job_id in jobs.values():
        for route in WORKFLOWS:  # its own workflow's route and the other's
            for spelling in spellings(job_id):
                for method in ("GET", "HEAD"):
                    r = await client.request(method, f"{route}/{spelling}", headers=globex)
                    assert r.status_code == 404, (method, route, spelling)
                    assert job_id not in r.text and "Acme" not in r.text
    assert await state(pool, redis) == before
    for route, job_id in jobs.items():  # the control: the owner does find them
        mine = await client.get(f"{route}/{job_id}", headers=acme)
        assert mine.status_code == 200


async def test_posts_with_the_other_tenants_keys_are_fresh_and_touch_nothing_of_theirs(
    client, pool, redis, tenants
):
    acme, globex, jobs = tenants
    initech = {"Authorization": f"Bearer {await create_api_key(pool, 'initech')}"}
    before = await state(pool, redis)
    for route, body in WORKFLOWS.items():
        other_body = {k: v.replace("Acme", "Globex") for k, v in body.items()}
        # Acme's key with Acme's body: no replay; with another body: no 422.
        for sent, auth in ((body, globex), (other_body, initech)):
            r = await client.post(route, json=sent, headers={**auth, "Idempotency-Key": KEY})
            assert r.status_code == 202, r.text
            assert "idempotent-replayed" not in r.headers
            assert r.json()["job_id"] != jobs[route]
            fresh = await client.post(
                route, json=sent, headers={**auth, "Idempotency-Key": f"{KEY}-other"}
            )
            assert fresh.status_code == 202
    after = await state(pool, redis)
    kept(before, after)

    # What was added is the others' alone.
    new_rows = after["jobs"] - before["jobs"]
    assert len(new_rows) == 8 and all("'acme'" not in r for r in new_rows)
    acme_rows = await rows(pool, "SELECT job_id::text FROM jobs WHERE tenant = 'acme'")
    assert sorted(r[0] for r in acme_rows) == sorted(jobs.values())
    for name, value in after.items():
        if isinstance(value, dict) and name.endswith(":stream"):
            for entry_id in set(value) - set(before.get(name, {})):
                assert value[entry_id]["tenant"] in ("globex", "initech")
        if name.startswith("oncely:idem:") and name not in before:
            assert tenant_tag("acme") not in value
    for route, job_id in jobs.items():
        replay = await client.post(
            route, json=WORKFLOWS[route], headers={**acme, "Idempotency-Key": KEY}
        )
        assert replay.headers["idempotent-replayed"] == "true"
        assert replay.json()["job_id"] == job_id, "Acme's key still answers Acme's job"


async def test_one_tenants_intake_limit_is_not_the_others(settings, redis, pool):
    """The per-tenant limit (ONCELY_TENANT_RPM) is the other tenant-scoped
    state: Globex spending its minute leaves Acme's untouched."""
    app = asgi_app(settings.model_copy(update={"tenant_rpm": 1}), redis, pool)
    acme = {"Authorization": f"Bearer {await create_api_key(pool, 'acme')}"}
    globex = {"Authorization": f"Bearer {await create_api_key(pool, 'globex')}"}
    body = WORKFLOWS["/v1/summaries"]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        for n in range(2):
            r = await c.post(
                "/v1/summaries", json=body, headers={**globex, "Idempotency-Key": f"{KEY}-{n}"}
            )
        assert r.status_code == 429, "Globex is over its limit"
        mine = await c.post("/v1/summaries", json=body, headers={**acme, "Idempotency-Key": KEY})
    assert mine.status_code == 202
    assert [t for (t,) in await rows(pool, "SELECT tenant FROM jobs ORDER BY tenant")] == [
        "acme",
        "globex",
    ]
