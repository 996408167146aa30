"""API keys: a random bearer token maps to a tenant; only its hash is stored.

Only this module runs SQL on the ``api_keys`` table.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param
from psycopg.rows import class_row
from psycopg_pool import AsyncConnectionPool

from oncely.api.problems import Unauthorized
from oncely.jobs.store import run_statement
from oncely.sql import query

KEY_PREFIX = "onc_"

# A FastAPI dependency that answers the request's tenant (or raises).
TenantDependency = Callable[..., Awaitable[str]]

_bearer = HTTPBearer(auto_error=False, description="An API key from `oncely keys create`.")


def new_api_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_api_key(key: str) -> str:
    # Keys are 256 random bits, so a fast hash is enough: nothing to brute-force.
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class ApiKey:
    """What an operator sees of a key: never the secret."""

    id: str
    tenant: str
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None


async def create_api_key(pool: AsyncConnectionPool, tenant: str) -> str:
    key, _ = await create_api_key_with_id(pool, tenant)
    return key


async def create_api_key_with_id(pool: AsyncConnectionPool, tenant: str) -> tuple[str, str]:
    """A new key for ``tenant``: (the secret, shown once; its id)."""
    key = new_api_key()
    async with pool.connection() as conn:
        cur = await conn.execute(query("insert_api_key"), (hash_api_key(key), tenant))
        row = await cur.fetchone()
    assert row is not None
    return key, str(row[0])


async def revoke_api_key_by_id(pool: AsyncConnectionPool, key_id: str) -> str | None:
    """Revoke by id; the key's tenant, or None if no active key has that id."""
    async with pool.connection() as conn:
        cur = await conn.execute(query("revoke_api_key_by_id"), (key_id,))
        row = await cur.fetchone()
    return None if row is None else str(row[0])


async def list_api_keys(pool: AsyncConnectionPool, tenant: str | None = None) -> list[ApiKey]:
    async with pool.connection() as conn:
        cur = conn.cursor(row_factory=class_row(ApiKey))
        await cur.execute(query("list_api_keys"), {"tenant": tenant})
        return await cur.fetchall()


async def revoke_api_key(pool: AsyncConnectionPool, key: str) -> str | None:
    """Revoke; return the key's tenant, or None if it was unknown or already revoked."""
    async with pool.connection() as conn:
        cur = await conn.execute(query("revoke_api_key"), (hash_api_key(key),))
        row = await cur.fetchone()
    return None if row is None else str(row[0])


async def tenant_for_key(
    pool: AsyncConnectionPool, key: str, *, timeout_s: float = 10.0
) -> str | None:
    """The key's tenant, answered within ``timeout_s`` (or ``StatementTimeout``)."""
    return await _tenant_for_hash(pool, hash_api_key(key), timeout_s=timeout_s)


async def _tenant_for_hash(
    pool: AsyncConnectionPool, key_hash: str, *, timeout_s: float
) -> str | None:
    result = await run_statement(
        pool, query("tenant_for_key"), {"key_hash": key_hash}, timeout_s=timeout_s
    )
    return str(result.rows[0][0]) if result.rows else None


async def erase_tenant_api_keys(pool: AsyncConnectionPool, tenant: str) -> int:
    """Delete every key of ``tenant`` (revoked or not); how many."""
    async with pool.connection() as conn:
        cur = await conn.execute(query("erase_tenant_api_keys"), (tenant,))
    return max(cur.rowcount, 0)


class KeyCache:
    """Active keys seen recently, by hash: the intake's key lookup costs a
    statement only once per key and ``ttl_s`` on each API process. So a
    revoked (or erased) key keeps working for up to ``ttl_s`` on a process
    that saw it (README, Settings: ``ONCELY_API_KEY_CACHE_S``). Only active
    keys are kept: a new key works at once, an unknown one is looked up each
    time. At most ``max_keys`` entries; the oldest go first."""

    def __init__(self, ttl_s: float, max_keys: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        # key hash -> (tenant, monotonic expiry); insertion order is age order.
        self._entries: dict[str, tuple[str, float]] = {}

    def get(self, key_hash: str) -> str | None:
        entry = self._entries.get(key_hash)
        if entry is None:
            return None
        tenant, expires = entry
        if time.monotonic() >= expires:
            del self._entries[key_hash]
            return None
        return tenant

    def put(self, key_hash: str, tenant: str) -> None:
        if self.ttl_s <= 0:
            return
        self._entries.pop(key_hash, None)
        while len(self._entries) >= self.max_keys:
            del self._entries[next(iter(self._entries))]
        self._entries[key_hash] = (tenant, time.monotonic() + self.ttl_s)


class ApiKeyAuth:
    """The default auth: ``Authorization: Bearer <api key>`` → its tenant
    (the lookup bounded by ``timeout_s``; active keys cached ``cache_s``,
    see ``KeyCache``). ``dependency`` is it as a FastAPI dependency, which
    documents the bearer scheme in OpenAPI; the workflows' intake calls
    ``tenant_of`` directly (``oncely.api.workflows``)."""

    def __init__(
        self, pool: Callable[[], AsyncConnectionPool], *, timeout_s: float, cache_s: float
    ) -> None:
        self._pool = pool
        self._timeout_s = timeout_s
        self._cache = KeyCache(cache_s)

        async def current_tenant(
            credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
        ) -> str:
            if credentials is None:
                raise Unauthorized(_SEND_A_KEY)
            return await self._tenant(credentials.scheme, credentials.credentials)

        self.dependency: TenantDependency = current_tenant

    async def tenant_of(self, request: Request) -> str:
        """The request's tenant, read as the dependency reads it."""
        scheme, key = get_authorization_scheme_param(request.headers.get("authorization"))
        if not (scheme and key):
            raise Unauthorized(_SEND_A_KEY)
        return await self._tenant(scheme, key)

    async def _tenant(self, scheme: str, key: str) -> str:
        if scheme.lower() != "bearer":
            raise Unauthorized(_SEND_A_KEY)
        key_hash = hash_api_key(key)
        tenant = self._cache.get(key_hash)
        if tenant is not None:
            return tenant
        tenant = await _tenant_for_hash(self._pool(), key_hash, timeout_s=self._timeout_s)
        if tenant is None:
            raise Unauthorized("unknown or revoked API key")
        self._cache.put(key_hash, tenant)
        return tenant


_SEND_A_KEY = "send Authorization: Bearer <api key>"
