"""The per-tenant intake limit (``ONCELY_TENANT_RPM``), fleet-wide in Redis.

GCRA (generic cell rate algorithm), like the model limiter: one key per
tenant holds its theoretical arrival time; a request is let in when that
time is within a minute's allowance of now. A tenant may therefore send its
whole per-minute quota at once, then one request per ``60 / rpm`` seconds.
It runs before the idempotency claim: a limited request claims no key and
stores nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from oncely import names
from oncely.redis_client import RedisClient

# KEYS[1] = the tenant's key; ARGV: interval ms (60000 / rpm), tolerance ms.
# Returns {wait ms (0: admitted), remaining, reset ms}.
_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local interval, tolerance = tonumber(ARGV[1]), tonumber(ARGV[2])
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
if tat < now then tat = now end
local wait = tat - tolerance - now
if wait > 0 then
  return {wait, 0, tat - now}
end
local new_tat = tat + interval
redis.call('SET', KEYS[1], new_tat, 'PX', math.ceil(new_tat - now) + 1)
return {0, math.floor((tolerance - (new_tat - now)) / interval) + 1, new_tat - now}
"""


@dataclass(frozen=True)
class Admission:
    """Whether a request may go in, and what the RateLimit headers say."""

    wait_s: float
    remaining: int
    reset_s: float
    rpm: int

    @property
    def admitted(self) -> bool:
        return self.wait_s <= 0

    def headers(self) -> dict[str, str]:
        """``RateLimit-Policy`` and ``RateLimit`` (IETF httpapi draft), and
        ``Retry-After`` when refused."""
        headers = {
            "RateLimit-Policy": f'"tenant";q={self.rpm};w=60',
            "RateLimit": f'"tenant";r={self.remaining};t={math.ceil(self.reset_s)}',
        }
        if not self.admitted:
            headers["Retry-After"] = str(max(1, math.ceil(self.wait_s)))
        return headers


class TenantLimiter:
    def __init__(self, redis: RedisClient, rpm: int) -> None:
        self.rpm = rpm
        self._admit = redis.register_script(_ADMIT)
        self._interval_ms = 60_000 / rpm
        # The whole minute's quota may arrive at once.
        self._tolerance_ms = 60_000 - self._interval_ms

    async def admit(self, tenant: str) -> Admission:
        key = names.tenant_rate_key(names.tenant_digest(tenant))
        wait_ms, remaining, reset_ms = await self._admit(
            keys=[key], args=[self._interval_ms, self._tolerance_ms]
        )
        return Admission(
            int(wait_ms) / 1000, max(0, int(remaining)), int(reset_ms) / 1000, self.rpm
        )
