"""API keys at the edge: a revoked or erased key stops working on every API
process within about a second, whatever the key cache's lifetime (real
`oncely api` processes, a cache of an hour: only the announcement can
explain the refusal); unknown keys are cached as unknown and budgeted per
client address, so a scan of random keys costs PostgreSQL a bounded number
of lookups."""

from __future__ import annotations

import asyncio
import secrets
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from oncely.api import auth
from oncely.api.auth import create_api_key, create_api_key_with_id
from tests.processes import free_port, oncely, running, servers_env, start, wait_for

URL = "/v1/summaries"


@pytest.fixture
def env(redis_url: str, database_url: str) -> dict[str, str]:
    # An hour: a refusal within the test can only come from the announcement.
    return servers_env(
        redis_url, database_url, ONCELY_LOG_FORMAT="json", ONCELY_API_KEY_CACHE_S="3600"
    )


@pytest.fixture
def two_apis(env: dict[str, str], tmp_path: Path) -> Iterator[list[str]]:
    ports = [free_port(), free_port()]
    procs = [
        start(["api", "--port", str(port)], env, tmp_path / f"api-{n}.log")
        for n, port in enumerate(ports)
    ]
    with running(*procs):
        yield [f"http://127.0.0.1:{port}" for port in ports]


async def status_of(base: str, key: str) -> int:
    """A read with the key: 404 (an unknown job) while the key works, else 401."""
    async with httpx.AsyncClient(base_url=base) as client:
        r = await client.get(f"{URL}/{uuid.uuid4()}", headers={"Authorization": f"Bearer {key}"})
    return r.status_code


@pytest.mark.slow
async def test_a_revoked_key_is_refused_by_every_api_process(pool, env, two_apis, tmp_path):
    key, key_id = await create_api_key_with_id(pool, "acme")
    other = await create_api_key(pool, "acme")
    for n, base in enumerate(two_apis):
        proc_log = tmp_path / f"api-{n}.log"
        await wait_for(lambda b=base: _up(b), what=f"API {n}: {proc_log.read_text()[-500:]}")
        assert await status_of(base, key) == 404  # looked up, now cached for an hour
        assert await status_of(base, other) == 404
    revoked = await asyncio.to_thread(oncely, "keys", "revoke", "--id", key_id, env=env)
    assert revoked.returncode == 0, revoked.stderr
    assert "within about a second" in revoked.stderr

    async def refused_everywhere() -> bool:
        return all([await status_of(base, key) == 401 for base in two_apis])

    await wait_for(refused_everywhere, what="the revoked key refused by both processes")
    # The tenant's other key still works (looked up again after the cache emptied).
    assert [await status_of(base, other) for base in two_apis] == [404, 404]

    erased = await asyncio.to_thread(oncely, "tenants", "erase", "acme", env=env)
    assert erased.returncode == 0, erased.stderr

    async def erased_everywhere() -> bool:
        return all([await status_of(base, other) == 401 for base in two_apis])

    await wait_for(erased_everywhere, what="an erased tenant's key refused by both processes")


async def _up(base: str) -> bool:
    try:
        async with httpx.AsyncClient(base_url=base) as client:
            return (await client.get("/healthz")).status_code == 200
    except httpx.TransportError:
        return False


async def with_unknown_keys(client: httpx.AsyncClient, n: int) -> list[int]:
    """The statuses of ``n`` reads, each with a random key nobody holds."""
    statuses = []
    for _ in range(n):
        key = "onc_" + secrets.token_urlsafe(32)
        r = await client.get(f"{URL}/{uuid.uuid4()}", headers={"Authorization": f"Bearer {key}"})
        statuses.append(r.status_code)
    return statuses


def counted_lookups(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The key hashes looked up in the database from now on, in order."""
    lookups: list[str] = []
    real = auth._tenant_for_hash

    async def counted(pool, key_hash, *, timeout_s):  # type: ignore[no-untyped-def]
        lookups.append(key_hash)
        return await real(pool, key_hash, timeout_s=timeout_s)

    monkeypatch.setattr(auth, "_tenant_for_hash", counted)
    return lookups


async def test_unknown_keys_are_cached_and_budgeted_per_client(
    settings, redis, pool, monkeypatch, api_key
):
    from tests.helpers import asgi_app

    lookups = counted_lookups(monkeypatch)
    app = asgi_app(settings.model_copy(update={"api_key_cache_s": 600}), redis, pool)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
    mine = {"Authorization": f"Bearer {api_key}"}
    assert (await client.get(f"{URL}/{uuid.uuid4()}", headers=mine)).status_code == 404
    statuses = await with_unknown_keys(client, 1000)
    assert statuses.count(401) == 60 and statuses.count(429) == 940
    assert len(lookups) == 61, "the good key once, then 60 unknown ones: past the budget, none"
    another = {"Authorization": "Bearer onc_" + secrets.token_urlsafe(32)}
    refused = await client.get(f"{URL}/{uuid.uuid4()}", headers=another)
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    assert refused.json()["type"].endswith("/rate-limited")
    # The client's known (cached) key still works: the budget counts unknown keys.
    assert (await client.get(f"{URL}/{uuid.uuid4()}", headers=mine)).status_code == 404
    await client.aclose()


async def test_a_flood_of_unknown_keys_never_locks_a_valid_key_out(
    settings, redis, pool, monkeypatch, api_key
):
    """Past an address's budget, its keys are checked against the active
    keys, read once every few seconds: a valid key that was never cached
    passes, a flood of random ones costs a handful of statements."""
    from oncely.api.auth import create_api_key
    from tests.helpers import asgi_app

    reads: list[int] = []
    real = auth.ApiKeyAuth._active_keys

    async def counted(self):  # type: ignore[no-untyped-def]
        reads.append(1)
        return await real(self)

    monkeypatch.setattr(auth.ApiKeyAuth, "_active_keys", counted)
    other = await create_api_key(pool, "globex")
    app = asgi_app(settings.model_copy(update={"api_key_cache_s": 600}), redis, pool)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        statuses = await with_unknown_keys(c, 500)
        assert statuses.count(401) == 60 and statuses.count(429) == 440
        # Two valid keys first seen from the flooded address: both pass.
        for key in (api_key, other):
            r = await c.get(f"{URL}/{uuid.uuid4()}", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 404, r.text
    assert 1 <= len(reads) <= 3, f"{len(reads)} reads of the active keys for 440 refusals"


async def test_an_unknown_key_asked_again_costs_no_lookup(settings, redis, pool, monkeypatch):
    from tests.helpers import asgi_app

    lookups = counted_lookups(monkeypatch)
    app = asgi_app(settings.model_copy(update={"api_key_cache_s": 60}), redis, pool)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        wrong = {"Authorization": "Bearer onc_" + "x" * 43}
        for _ in range(20):
            assert (await c.get(f"{URL}/{uuid.uuid4()}", headers=wrong)).status_code == 401
        key = await create_api_key(pool, "acme")
        good = {"Authorization": f"Bearer {key}"}
        for _ in range(20):
            assert (await c.get(f"{URL}/{uuid.uuid4()}", headers=good)).status_code == 404
    assert len(lookups) == 2  # one for each key
