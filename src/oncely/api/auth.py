"""API keys: a random bearer token maps to a tenant; only its hash is stored.

Only this module runs SQL on the ``api_keys`` table.

Each API process caches what it looked up (``KeyCache``): an active key for
``ONCELY_API_KEY_CACHE_S``, an unknown one for as long, so a key costs one
statement per process and period whatever the traffic. A revocation or a
tenant's erasure bumps a generation in Redis (``announce_revocation``); every
process reads it at most ``REVOCATION_CHECK_S`` apart while it serves keys
from its cache and empties the cache when it changed (``Revocations``), so a
revoked key stops working on every process within about a second. A process
that cannot read the generation trusts no cached key. Unknown keys are also
throttled per client address (``UnknownKeyBudget``): past the budget a
client's unknown keys are refused (429) without a lookup.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated

import structlog
from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param
from psycopg.rows import class_row
from psycopg_pool import AsyncConnectionPool
from redis.exceptions import RedisError

from oncely import names
from oncely.api.problems import RateLimited, Unauthorized
from oncely.redis_client import RedisClient
from oncely.sql import query
from oncely.sql.bounded import run_statement

log = structlog.get_logger("oncely.auth")

KEY_PREFIX = "onc_"
# How far apart a process reads the revocation generation while it serves
# keys from its cache; a cached key is trusted at most twice this long
# without a read that says nothing was revoked.
REVOCATION_CHECK_S = 0.5
# The longest a request waits for the revocation count before it trusts no
# cached key and looks its key up in PostgreSQL.
REVOCATION_READ_S = 1.0

# A FastAPI dependency that answers the request's tenant (or raises).
TenantDependency = Callable[..., Awaitable[str]]

_bearer = HTTPBearer(auto_error=False, description="An API key from `oncely keys create`.")


def new_api_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_api_key(key: str) -> str:
    # Keys are 256 random bits, so a fast hash is enough: nothing to brute-force.
    return hashlib.sha256(key.encode()).hexdigest()


def api_key_id(key: str) -> str:
    """The key's id, as ``oncely keys list`` shows it: the start of its
    hash (the ``api_keys.id`` column, migration 0006)."""
    return hash_api_key(key)[:12]


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


# The operator paths' bound on each statement (the CLI's and the console's).
_OPERATOR_TIMEOUT_S = 30.0


async def create_api_key_with_id(
    pool: AsyncConnectionPool, tenant: str, *, timeout_s: float = _OPERATOR_TIMEOUT_S
) -> tuple[str, str]:
    """A new key for ``tenant``: (the secret, shown once; its id)."""
    key = new_api_key()
    result = await run_statement(
        pool, query("insert_api_key"), (hash_api_key(key), tenant), timeout_s=timeout_s
    )
    return key, str(result.rows[0][0])


async def revoke_api_key_by_id(
    pool: AsyncConnectionPool, key_id: str, *, timeout_s: float = _OPERATOR_TIMEOUT_S
) -> str | None:
    """Revoke by id; the key's tenant, or None if no active key has that id."""
    result = await run_statement(
        pool, query("revoke_api_key_by_id"), (key_id,), timeout_s=timeout_s
    )
    return str(result.rows[0][0]) if result.rows else None


async def list_api_keys(
    pool: AsyncConnectionPool, tenant: str | None = None, *, timeout_s: float = _OPERATOR_TIMEOUT_S
) -> list[ApiKey]:
    result = await run_statement(
        pool,
        query("list_api_keys"),
        {"tenant": tenant},
        timeout_s=timeout_s,
        row_factory=class_row(ApiKey),
    )
    return result.rows


async def revoke_api_key(
    pool: AsyncConnectionPool, key: str, *, timeout_s: float = _OPERATOR_TIMEOUT_S
) -> str | None:
    """Revoke; return the key's tenant, or None if it was unknown or already revoked."""
    result = await run_statement(
        pool, query("revoke_api_key"), (hash_api_key(key),), timeout_s=timeout_s
    )
    return str(result.rows[0][0]) if result.rows else None


def key_id_of(request: Request) -> str | None:
    """The id of the API key a request was sent with (``api_key_id``); None
    without one."""
    scheme, key = get_authorization_scheme_param(request.headers.get("authorization"))
    if scheme.lower() != "bearer" or not key:
        return None
    return api_key_id(key)


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


async def erase_tenant_api_keys(
    pool: AsyncConnectionPool, tenant: str, *, timeout_s: float = 60.0
) -> int:
    """Delete every key of ``tenant`` (revoked or not); how many."""
    result = await run_statement(
        pool, query("erase_tenant_api_keys"), (tenant,), timeout_s=timeout_s
    )
    return max(result.rowcount, 0)


async def announce_revocation(redis: RedisClient) -> bool:
    """Tell every API process that a key was revoked or erased: they empty
    their key caches within about a second. False (logged) when Redis did
    not answer: then the revocation takes up to ``ONCELY_API_KEY_CACHE_S``."""
    try:
        await redis.incr(names.API_KEYS_GENERATION)
    except RedisError as exc:
        log.warning("keys.revocation_not_announced", error=type(exc).__name__)
        return False
    return True


class KeyCache:
    """Keys looked up recently, by hash: active ones with their tenant,
    unknown ones as unknown, each for ``ttl_s`` on this process (docs/settings.md:
    ``ONCELY_API_KEY_CACHE_S``). ``clear`` empties it (a
    revocation was announced). At most ``max_keys`` entries; the oldest go
    first."""

    def __init__(self, ttl_s: float, max_keys: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        # key hash -> (tenant or None for unknown, monotonic expiry);
        # insertion order is age order.
        self._entries: dict[str, tuple[str | None, float]] = {}
        # Bumped by every clear: a lookup that began before one is not kept.
        self.epoch = 0

    def get(self, key_hash: str) -> tuple[bool, str | None]:
        """(cached?, its tenant: None for a key known to be unknown)."""
        entry = self._entries.get(key_hash)
        if entry is None:
            return False, None
        tenant, expires = entry
        if time.monotonic() >= expires:
            del self._entries[key_hash]
            return False, None
        return True, tenant

    def put(self, key_hash: str, tenant: str | None, epoch: int) -> None:
        """Keep a lookup that began in ``epoch`` (unless a clear came since)."""
        if self.ttl_s <= 0 or epoch != self.epoch:
            return
        self._entries.pop(key_hash, None)
        while len(self._entries) >= self.max_keys:
            del self._entries[next(iter(self._entries))]
        self._entries[key_hash] = (tenant, time.monotonic() + self.ttl_s)

    def clear(self) -> None:
        self._entries.clear()
        self.epoch += 1


class Revocations:
    """Keeps a ``KeyCache`` honest: the revocation generation in Redis read
    at most ``every_s`` apart while the cache is used. ``current`` answers
    whether the cache may be trusted now: within ``every_s`` of the last
    read, yes; within twice that, yes, and a read goes out in the
    background; later, only once a read says so (one Redis GET, shared by
    every request waiting for it). A changed generation empties the cache;
    a read that fails leaves it untrusted."""

    def __init__(
        self,
        redis: Callable[[], RedisClient],
        cache: KeyCache,
        *,
        every_s: float = REVOCATION_CHECK_S,
    ) -> None:
        self._redis = redis
        self._cache = cache
        self.every_s = every_s
        self._generation: str | None = None
        self._read_at = -1e9
        self._reading: asyncio.Task[bool] | None = None

    async def current(self) -> bool:
        age = time.monotonic() - self._read_at
        if age < self.every_s:
            return True
        if age < 2 * self.every_s:
            self._read()
            return True
        return await asyncio.shield(self._read())

    def _read(self) -> asyncio.Task[bool]:
        if self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(self._read_generation())
        return self._reading

    async def _read_generation(self) -> bool:
        try:
            # At most a second: a request waits on this read before its own
            # Redis work, so a hung Redis would otherwise cost it two bounds
            # (docs/failure-model.md promises the bound + 1 s).
            async with asyncio.timeout(REVOCATION_READ_S):
                generation = await self._redis().get(names.API_KEYS_GENERATION)
        except (RedisError, TimeoutError) as exc:
            log.warning("keys.revocations_unread", error=type(exc).__name__)
            self._cache.clear()
            return False
        found = None if generation is None else str(generation)
        if found != self._generation:
            # A revocation (or Redis losing the count): nothing cached holds.
            self._cache.clear()
            self._generation = found
        self._read_at = time.monotonic()
        return True


class UnknownKeyBudget:
    """Unknown keys a client address may present per minute before its keys
    are no longer looked up one by one: past it, a key is checked against
    the active keys (``ActiveKeys``, one statement every few seconds) and an
    unknown one refused (429). A scan of random keys costs PostgreSQL at
    most this many statements a minute per address and process, and never
    locks a valid key out. Known keys never count."""

    def __init__(self, per_minute: int, max_clients: int = 10_000) -> None:
        self.per_minute = per_minute
        self.max_clients = max_clients
        # client -> (unknown keys in the window, monotonic start of the window)
        self._clients: dict[str, tuple[int, float]] = {}

    def refused(self, client: str) -> float:
        """Seconds until ``client`` may present an unknown key again (0: now)."""
        if self.per_minute <= 0:
            return 0.0
        count, since = self._clients.get(client, (0, 0.0))
        left = since + 60.0 - time.monotonic()
        return left if count >= self.per_minute and left > 0 else 0.0

    def count(self, client: str) -> None:
        if self.per_minute <= 0:
            return
        now = time.monotonic()
        count, since = self._clients.pop(client, (0, now))
        if now - since >= 60.0:
            count, since = 0, now
        while len(self._clients) >= self.max_clients:
            del self._clients[next(iter(self._clients))]
        self._clients[client] = (count + 1, since)


class ActiveKeys:
    """Every active key's hash and tenant, read at most every ``every_s``:
    what a key from an address over its unknown-key budget is checked
    against, so that a flood of random keys from one address costs one
    statement per ``every_s`` and never refuses a valid key behind it (a
    key created since the last read is found at the next, within
    ``every_s``). Read again after a revocation: ``epoch`` is the key
    cache's, which a revocation moves."""

    def __init__(self, every_s: float = 5.0) -> None:
        self.every_s = every_s
        self._keys: dict[str, str] = {}
        self._read_at: float | None = None
        self._epoch: int | None = None
        self._reading: asyncio.Lock | None = None

    async def tenant(
        self, key_hash: str, epoch: int, read: Callable[[], Awaitable[dict[str, str]]]
    ) -> str | None:
        if epoch != self._epoch:
            self._keys, self._read_at = {}, None
        found = self._keys.get(key_hash)
        if found is not None:
            return found
        if self._reading is None:
            self._reading = asyncio.Lock()
        async with self._reading:  # one read at a time; the others use it
            stale = self._read_at is None or time.monotonic() - self._read_at >= self.every_s
            if stale or epoch != self._epoch:
                self._keys = await read()
                self._read_at, self._epoch = time.monotonic(), epoch
        return self._keys.get(key_hash)


class ApiKeyAuth:
    """The default auth: ``Authorization: Bearer <api key>`` → its tenant
    (the lookup bounded by ``timeout_s``; keys cached ``cache_s``, see
    ``KeyCache``, and emptied on a revocation, see ``Revocations``; unknown
    keys budgeted per client, see ``UnknownKeyBudget``). ``dependency`` is
    it as a FastAPI dependency, which documents the bearer scheme in
    OpenAPI; the workflows' intake calls ``tenant_of`` directly
    (``oncely.api.workflows``)."""

    def __init__(
        self,
        pool: Callable[[], AsyncConnectionPool],
        *,
        timeout_s: float,
        cache_s: float,
        redis: Callable[[], RedisClient] | None = None,
        unknown_per_minute: int = 60,
    ) -> None:
        self._pool = pool
        self._timeout_s = timeout_s
        self._cache = KeyCache(cache_s)
        # Without Redis (tests of the lookup alone), nothing is cached.
        self._revocations = Revocations(redis, self._cache) if redis is not None else None
        self._unknown = UnknownKeyBudget(unknown_per_minute)
        self._active = ActiveKeys()

        async def current_tenant(
            request: Request,
            credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
        ) -> str:
            if credentials is None:
                raise Unauthorized(_SEND_A_KEY)
            return await self._tenant(request, credentials.scheme, credentials.credentials)

        self.dependency: TenantDependency = current_tenant

    async def tenant_of(self, request: Request) -> str:
        """The request's tenant, read as the dependency reads it."""
        scheme, key = get_authorization_scheme_param(request.headers.get("authorization"))
        if not (scheme and key):
            raise Unauthorized(_SEND_A_KEY)
        return await self._tenant(request, scheme, key)

    async def _tenant(self, request: Request, scheme: str, key: str) -> str:
        if scheme.lower() != "bearer":
            raise Unauthorized(_SEND_A_KEY)
        if len(request.headers.getlist("authorization")) > 1:
            # Which one would count depends on the server: refuse both.
            raise HTTPException(400, "send one Authorization header")
        key_hash = hash_api_key(key)
        trusted = self._revocations is not None and await self._revocations.current()
        if trusted:
            cached, tenant = self._cache.get(key_hash)
            if cached:
                return self._known(tenant)
        client = request.client.host if request.client is not None else "unknown"
        wait_s = self._unknown.refused(client)
        if wait_s:
            # Past its budget, the address's keys are checked against the
            # active keys read at most every few seconds (again after a
            # revocation): a valid key passes, a flood costs no statement
            # per key. Without the revocation count, nothing read is trusted.
            if trusted:
                active = await self._active.tenant(key_hash, self._cache.epoch, self._active_keys)
                if active is not None:
                    return active
            log.warning("auth.unknown_keys_throttled", client=client)
            raise RateLimited({"Retry-After": str(max(1, round(wait_s)))})
        epoch = self._cache.epoch
        tenant = await _tenant_for_hash(self._pool(), key_hash, timeout_s=self._timeout_s)
        if self._revocations is not None:
            self._cache.put(key_hash, tenant, epoch)
        if tenant is None:
            self._unknown.count(client)
        return self._known(tenant)

    async def tenant_of_id(self, key_id: str) -> str | None:
        """The tenant of the active key with this id; None once it is
        revoked or erased, within the same bound as the key itself (the
        answer is cached as a key's is, and a revocation empties the cache)."""
        entry = f"id:{key_id}"
        if self._revocations is not None and await self._revocations.current():
            cached, tenant = self._cache.get(entry)
            if cached:
                return tenant
        epoch = self._cache.epoch
        result = await run_statement(
            self._pool(), query("tenant_for_key_id"), {"key_id": key_id}, timeout_s=self._timeout_s
        )
        tenant = str(result.rows[0][0]) if result.rows else None
        if self._revocations is not None:
            self._cache.put(entry, tenant, epoch)
        return tenant

    async def _active_keys(self) -> dict[str, str]:
        result = await run_statement(
            self._pool(), query("active_api_keys"), None, timeout_s=self._timeout_s
        )
        return {str(h): str(t) for h, t in result.rows}

    @staticmethod
    def _known(tenant: str | None) -> str:
        if tenant is None:
            raise Unauthorized("unknown or revoked API key")
        return tenant


_SEND_A_KEY = "send Authorization: Bearer <api key>"
