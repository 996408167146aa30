"""The idempotency store in Redis: claim, finalise, release, renew.

One string per scope at ``oncely:idem:<sha256(scope)>`` holding JSON:
``{"state": "running", "fp", "token"}`` while a request runs (TTL = lock
TTL) and ``{"state": "done", "fp", "status", "headers", "body"}`` once it
finished (TTL = result TTL). Everything that changes a claimed key checks
the token first, in one Lua script, so a request that outlived its lock can
never overwrite or delete the key of the request that took it over.
"""

from __future__ import annotations

import base64
import json
import secrets
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from oncely import names

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

    def to_json(self, fp: str) -> str:
        return json.dumps(
            {
                "state": "done",
                "fp": fp,
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


class IdempotencyStore:
    def __init__(self, redis: Redis, *, lock_ttl_s: float, result_ttl_s: int) -> None:
        self._redis = redis
        self.lock_ttl_ms = max(1, int(lock_ttl_s * 1000))
        self.result_ttl_ms = result_ttl_s * 1000
        self._finalise = redis.register_script(_FINALISE)
        self._release = redis.register_script(_RELEASE)
        self._renew = redis.register_script(_RENEW)

    async def claim(self, digest: str, fp: str) -> ClaimOutcome:
        """Take the key, or report what holds it (a running or finished request)."""
        key = names.idempotency_key(digest)
        token = secrets.token_hex(16)
        marker = json.dumps({"state": "running", "fp": fp, "token": token})
        while True:
            if await self._redis.set(key, marker, nx=True, px=self.lock_ttl_ms):
                return Claimed(token)
            raw = await self._redis.get(key)
            if raw is None:
                continue  # expired or released between SET and GET: try again
            record = json.loads(raw)
            if record["state"] == "running":
                return Running(record["fp"])
            return Finished(record["fp"], StoredResponse.from_record(record))

    async def finalise(self, digest: str, token: str, fp: str, response: StoredResponse) -> bool:
        """Store the response if we still own the key; False means the lock was lost."""
        key = names.idempotency_key(digest)
        done = await self._finalise(
            keys=[key], args=[token, response.to_json(fp), self.result_ttl_ms]
        )
        return bool(done)

    async def release(self, digest: str, token: str) -> bool:
        key = names.idempotency_key(digest)
        return bool(await self._release(keys=[key], args=[token]))

    async def renew(self, digest: str, token: str) -> bool:
        key = names.idempotency_key(digest)
        return bool(await self._renew(keys=[key], args=[token, self.lock_ttl_ms]))
