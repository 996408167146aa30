"""The idempotency store in Redis: claim, finalise, release, renew.

One string per scope at ``oncely:idem:<sha256(scope)>`` holding JSON:
``{"state": "running", "fp", "token"}`` while a request runs (TTL = lock
TTL) and ``{"state": "done", "fp", "status", "headers", "body"}`` once it
finished (TTL = result TTL). Everything that changes a claimed key checks
the token first, in one Lua script, so a request that outlived its lock can
never overwrite or delete the key of the request that took it over.

A claim, finalise or release that got no answer may still be applied when
Redis wakes up: a marker nobody runs would then answer 409 for the lock TTL.
``release_eventually`` keeps trying an owner-checked release in the
background until Redis has answered for a while (docs/failure-model.md).
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.exceptions
import structlog

from oncely import names
from oncely.redis_client import RedisClient, ScriptCall, call_together

log = structlog.get_logger("oncely.idempotency")

# Background releases: a round every _RELEASE_EVERY_S; a key is done once
# Redis has answered for _SETTLE_S (a write sent before it woke is applied
# within its first moments), or after _GIVE_UP_S without an answer.
_RELEASE_EVERY_S = 0.25
_SETTLE_S = 1.0
_GIVE_UP_S = 3600.0

# KEYS[1] = key; ARGV[1] = token, ARGV[2] = new value, ARGV[3] = ttl ms
_FINALISE = """
local v = redis.call('GET', KEYS[1])
if not v or cjson.decode(v)['token'] ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1
"""
# KEYS[1] = key; ARGV[1] = token
_RELEASE = """
local v = redis.call('GET', KEYS[1])
if not v or cjson.decode(v)['token'] ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
"""
# KEYS[1] = key; ARGV[1] = token, ARGV[2] = ttl ms
_RENEW = """
local v = redis.call('GET', KEYS[1])
if not v or cjson.decode(v)['token'] ~= ARGV[1] then return 0 end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
"""


@dataclass(frozen=True)
class StoredResponse:
    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def to_json(self, fp: str, tenant: str = "") -> str:
        return json.dumps(
            {
                "state": "done",
                "fp": fp,
                "t": names.tenant_digest(tenant),
                "status": self.status,
                "headers": self.headers,
                "body": base64.b64encode(self.body).decode(),
            }
        )

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> StoredResponse:
        return cls(
            status=int(record["status"]),
            headers=[(str(k), str(v)) for k, v in record["headers"]],
            body=base64.b64decode(record["body"]),
        )


@dataclass(frozen=True)
class Claimed:
    token: str


@dataclass(frozen=True)
class Running:
    fp: str


@dataclass(frozen=True)
class Finished:
    fp: str
    response: StoredResponse


ClaimOutcome = Claimed | Running | Finished


def new_token() -> str:
    """A claim's owner token."""
    return secrets.token_hex(16)


@dataclass
class _Unreleased:
    digest: str
    token: str
    since: float
    answered_at: float | None = None


@dataclass
class _Releases:
    """Owner-checked releases still to be confirmed, and the task doing them."""

    pending: list[_Unreleased] = field(default_factory=list)
    task: asyncio.Task[None] | None = None


class IdempotencyStore:
    def __init__(self, redis: RedisClient, *, lock_ttl_s: float, result_ttl_s: int) -> None:
        self.redis = redis
        self.lock_ttl_ms = max(1, int(lock_ttl_s * 1000))
        self.result_ttl_ms = result_ttl_s * 1000
        self._finalise = redis.register_script(_FINALISE)
        self._release = redis.register_script(_RELEASE)
        self._renew = redis.register_script(_RENEW)
        self._releases = _Releases()

    async def claim(self, digest: str, fp: str, token: str, *, tenant: str = "") -> ClaimOutcome:
        """Take the key with ``token``, or report what holds it (a running or
        finished request)."""
        key = names.idempotency_key(digest)
        marker = json.dumps(
            {"state": "running", "fp": fp, "token": token, "t": names.tenant_digest(tenant)}
        )
        # One round trip either way: SET NX GET (Redis 7.0+) sets the marker
        # and answers nothing, or sets nothing and answers what holds the key.
        raw: Any = await self.redis.set(key, marker, nx=True, px=self.lock_ttl_ms, get=True)
        if raw is None:
            return Claimed(token)
        record = json.loads(raw)
        if record["state"] == "running":
            if record.get("token") == token:
                # Our own SET, applied although its answer was lost (the
                # client retried it on a fresh connection).
                return Claimed(token)
            return Running(record["fp"])
        return Finished(record["fp"], StoredResponse.from_record(record))

    async def peek(self, digest: str) -> Running | Finished | None:
        """What holds the key, without claiming it (None: nothing)."""
        raw: Any = await self.redis.get(names.idempotency_key(digest))
        if raw is None:
            return None
        record = json.loads(raw)
        if record["state"] == "running":
            return Running(record["fp"])
        return Finished(record["fp"], StoredResponse.from_record(record))

    async def finalise(
        self,
        digest: str,
        token: str,
        fp: str,
        response: StoredResponse,
        *,
        tenant: str = "",
        along: Sequence[ScriptCall] = (),
    ) -> bool:
        """Store the response if we still own the key; False means the lock
        was lost. ``along``: writes that follow from the response, sent in
        the same round trip (each failure goes to its ``on_error``)."""
        key = names.idempotency_key(digest)
        args: list[str | int] = [token, response.to_json(fp, tenant), self.result_ttl_ms]
        if not along:
            return bool(await self._finalise(keys=[key], args=args))
        stored, *_ = await call_together(
            self.redis, [ScriptCall(self._finalise, [key], args), *along]
        )
        if isinstance(stored, redis.exceptions.RedisError):
            raise stored
        return bool(stored)

    async def erase_tenant(self, tenant: str, batch: int = 1000) -> int:
        """Delete every record of ``tenant`` (right to erasure); how many.
        Records carry a hash of their tenant; older ones, without it, expire
        within the result TTL."""
        tag = names.tenant_digest(tenant)
        erased = 0
        keys: list[str] = []
        async for key in self.redis.scan_iter(match=names.IDEMPOTENCY_PREFIX + "*", count=batch):
            keys.append(key)
            if len(keys) >= batch:
                erased += await self._erase_matching(keys, tag)
                keys = []
        return erased + (await self._erase_matching(keys, tag) if keys else 0)

    async def _erase_matching(self, keys: list[str], tag: str) -> int:
        # One GET per key in one pipeline, not MGET: on a cluster the keys
        # live in many slots, and the pipeline sends each to its node.
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.get(key)
            values: list[Any] = await pipe.execute()
        doomed = [
            k for k, v in zip(keys, values, strict=True) if v and json.loads(v).get("t") == tag
        ]
        if doomed:
            await self.redis.delete(*doomed)
        return len(doomed)

    async def release(self, digest: str, token: str) -> bool:
        key = names.idempotency_key(digest)
        return bool(await self._release(keys=[key], args=[token]))

    async def renew(self, digest: str, token: str) -> bool:
        key = names.idempotency_key(digest)
        return bool(await self._renew(keys=[key], args=[token, self.lock_ttl_ms]))

    # -- releases that could not be confirmed ------------------------------------

    def release_eventually(self, digest: str, token: str) -> None:
        """Release ``token``'s claim on the key once Redis answers again (and
        for a moment after, in case the claim itself lands late)."""
        loop = asyncio.get_running_loop()
        self._releases.pending.append(_Unreleased(digest, token, loop.time()))
        task = self._releases.task
        if task is None or task.done():
            task = self._releases.task = loop.create_task(self._release_pending())
            task.add_done_callback(_log_death)

    async def _release_pending(self) -> None:
        while self._releases.pending:
            await self._release_round()
            if self._releases.pending:
                await asyncio.sleep(_RELEASE_EVERY_S)

    async def _release_round(self) -> None:
        loop = asyncio.get_running_loop()
        for item in list(self._releases.pending):
            try:
                released = await self.release(item.digest, item.token)
            except redis.exceptions.RedisError:
                break  # not answering yet: every key waits for the next round
            now = loop.time()
            if item.answered_at is None:
                item.answered_at = now
            if released or now - item.answered_at >= _SETTLE_S:
                self._releases.pending.remove(item)
                log.info("idempotency.released_late", scope=item.digest[:16], held=released)
        now = loop.time()
        for item in list(self._releases.pending):
            if item.answered_at is None and now - item.since > _GIVE_UP_S:
                self._releases.pending.remove(item)
                log.warning("idempotency.release_abandoned", scope=item.digest[:16])

    async def aclose(self) -> None:
        """Stop releasing (shutdown): a marker left behind expires with its TTL."""
        task = self._releases.task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def _log_death(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("idempotency.release_loop_failed", exc_info=exc)
