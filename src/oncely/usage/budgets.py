"""Tenants' daily spend on the model, fleet-wide in Redis, and the budgets
it is held to (ONCELY_TENANT_DAILY_TOKENS, ONCELY_TENANT_DAILY_USD).

Workers add what each tenant's calls used as the ledger writes them
(``oncely.usage.ledger``): one hash per tenant and UTC day, ``tokens`` and
``usd``, kept two days; a batch Redis did not take is added again with the
next one, so spend during a Redis timeout is counted when Redis returns.

Concurrent requests cannot overshoot a token budget together: the intake
**reserves** an estimate of each new job's tokens once it holds the key (a
replay never gets that far, so never reserves), in one Lua call that
refuses once spent + reserved reaches the budget, and the ledger releases
a job's reservation in the same call that adds its first spend (a job that
spends nothing has its reservation expire after ``ONCELY_BUDGET_HOLD_S``).
A tenant may therefore overshoot only by what its jobs in flight spend
beyond their estimates. A tenant over either budget gets 429
``budget-exceeded`` until midnight UTC, and the key is released. Jobs
already accepted run regardless: a budget refuses new work, it never
strands accepted work.

Each API process remembers a tenant it found over budget for
``refresh_s`` (``refusing``): its further requests are refused before a
key is claimed, without a Redis call.
Shadow runs' calls are the operator's experiment and count against no
tenant's budget.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import structlog
from redis.exceptions import RedisError

from oncely import names
from oncely.redis_client import RedisClient, ScriptCall, call_together

log = structlog.get_logger(__name__)

# KEYS: a tenant's day (spend, holds, estimates). ARGV: tokens, usd, keep ms,
# then the jobs whose reservation the spend releases.
_ADD = """
redis.call('HINCRBY', KEYS[1], 'tokens', ARGV[1])
if tonumber(ARGV[2]) ~= 0 then redis.call('HINCRBYFLOAT', KEYS[1], 'usd', ARGV[2]) end
for i = 4, #ARGV do
  local held = redis.call('HGET', KEYS[3], ARGV[i])
  if held then
    redis.call('HINCRBY', KEYS[1], 'reserved', -tonumber(held))
    redis.call('HDEL', KEYS[3], ARGV[i])
    redis.call('ZREM', KEYS[2], ARGV[i])
  end
end
for _, key in ipairs(KEYS) do redis.call('PEXPIRE', key, ARGV[3]) end
return 1
"""

# KEYS: as _ADD. ARGV: job id, estimate, token budget (0: none), USD budget
# (0: none), now ms, hold ms, keep ms. 1: reserved (or held already), 0:
# refused. Expired holds are released first, at most 100 a call.
_RESERVE = """
local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[5], 'LIMIT', 0, 100)
for _, job in ipairs(gone) do
  local held = tonumber(redis.call('HGET', KEYS[3], job) or '0')
  redis.call('HINCRBY', KEYS[1], 'reserved', -held)
  redis.call('HDEL', KEYS[3], job)
  redis.call('ZREM', KEYS[2], job)
end
if redis.call('ZSCORE', KEYS[2], ARGV[1]) then return 1 end
local tokens = tonumber(redis.call('HGET', KEYS[1], 'tokens') or '0')
local usd = tonumber(redis.call('HGET', KEYS[1], 'usd') or '0')
local reserved = tonumber(redis.call('HGET', KEYS[1], 'reserved') or '0')
local estimate, limit, limit_usd = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if limit_usd > 0 and usd >= limit_usd then return 0 end
if limit > 0 and (tokens + reserved >= limit or
                  (reserved > 0 and tokens + reserved + estimate > limit)) then
  return 0
end
redis.call('HINCRBY', KEYS[1], 'reserved', estimate)
redis.call('HSET', KEYS[3], ARGV[1], estimate)
redis.call('ZADD', KEYS[2], tonumber(ARGV[5]) + tonumber(ARGV[6]), ARGV[1])
for _, key in ipairs(KEYS) do redis.call('PEXPIRE', key, ARGV[7]) end
return 1
"""

# A day's spend is kept until the day after has ended.
_KEEP_MS = 2 * 86_400_000


@dataclass(frozen=True)
class Spent:
    """Tokens (prompt and completion) and USD (priced calls only)."""

    tokens: int = 0
    usd: float = 0.0

    def __add__(self, other: Spent) -> Spent:
        return Spent(self.tokens + other.tokens, self.usd + other.usd)


def utc_day(at: float | None = None) -> str:
    """``YYYY-MM-DD`` of ``at`` (epoch seconds; default now), in UTC."""
    return datetime.fromtimestamp(time.time() if at is None else at, UTC).strftime("%Y-%m-%d")


def seconds_to_midnight(now: float | None = None) -> int:
    """Whole seconds until the next UTC day begins (at least 1)."""
    moment = datetime.fromtimestamp(time.time() if now is None else now, UTC)
    midnight = (moment + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    return max(1, math.ceil((midnight - moment).total_seconds()))


@dataclass(frozen=True)
class BudgetLimits:
    """Per tenant per UTC day; 0 turns a budget off. ``reserve_tokens``: what
    a job is expected to spend beyond its request's own size, reserved when
    it is accepted; ``hold_s``: how long a reservation no spend released
    lasts."""

    daily_tokens: int = 0
    daily_usd: float = 0.0
    reserve_tokens: int = 1000
    hold_s: float = 3600.0

    @property
    def enabled(self) -> bool:
        return self.daily_tokens > 0 or self.daily_usd > 0

    def exceeded_by(self, spent: Spent) -> bool:
        return (0 < self.daily_tokens <= spent.tokens) or (0 < self.daily_usd <= spent.usd)


class Budgets:
    """Tenants' spend per UTC day, and whether a tenant may start new work."""

    def __init__(
        self, redis: RedisClient, limits: BudgetLimits = BudgetLimits(), *, refresh_s: float = 1.0
    ) -> None:
        self.redis = redis
        self.limits = limits
        self.refresh_s = refresh_s
        self._add = redis.register_script(_ADD)
        self._reserve = redis.register_script(_RESERVE)
        # tenant -> (when it was refused, monotonic; the UTC day it was over)
        self._seen: dict[str, tuple[float, str]] = {}

    async def add(
        self,
        spent: Mapping[tuple[str, str], Spent],
        jobs: Mapping[tuple[str, str], Sequence[str]] | None = None,
    ) -> dict[tuple[str, str], Spent]:
        """Add to each (tenant, day)'s spend, releasing the reservations of
        ``jobs`` (by the same key), in one round trip. Answers what Redis did
        not take, to add again later (the ledger does)."""
        jobs = jobs or {}
        keyed = [
            (key, s, _keys(key)) for key, s in spent.items() if s.tokens or s.usd or jobs.get(key)
        ]
        calls = [
            ScriptCall(
                self._add,
                [k.spend, k.holds, k.estimates],
                [s.tokens, repr(s.usd), _KEEP_MS, *jobs.get(key, ())],
            )
            for key, s, k in keyed
        ]
        if not calls:
            return {}
        results = await call_together(self.redis, calls)
        failed = {
            key: s
            for (key, s, _), r in zip(keyed, results, strict=True)
            if isinstance(r, RedisError)
        }
        if failed:
            log.warning("budgets.not_counted_yet", batches=len(failed))
        return failed

    async def spent(self, tenant: str, day: str | None = None) -> Spent:
        """What ``tenant`` spent on ``day`` (default today, UTC)."""
        key = _keys((tenant, day or utc_day())).spend
        tokens, usd = await self.redis.hmget(key, ["tokens", "usd"])
        return Spent(int(tokens or 0), float(usd or 0.0))

    async def reserved(self, tenant: str, day: str | None = None) -> int:
        """The tokens held for ``tenant``'s accepted jobs on ``day``."""
        found = await self.redis.hget(_keys((tenant, day or utc_day())).spend, "reserved")
        return int(found or 0)

    def estimate(self, request_bytes: int) -> int:
        """A job's tokens, as reserved: its request's (about four bytes a
        token) and what the limits expect beyond it."""
        return request_bytes // 4 + self.limits.reserve_tokens

    def refusing(self, tenant: str) -> int | None:
        """Without I/O: the seconds until midnight UTC if ``tenant`` was
        found over budget in the last ``refresh_s``, else None."""
        seen = self._seen.get(tenant)
        if seen is None or seen[1] != utc_day() or time.monotonic() - seen[0] >= self.refresh_s:
            return None
        return seconds_to_midnight()

    async def reserve(self, tenant: str, job_id: str, estimate: int) -> int | None:
        """Hold ``estimate`` tokens of ``tenant``'s budget for ``job_id`` (a
        job that holds some already keeps its hold): None when held, else
        the seconds until it may start new work again (midnight UTC), and
        ``refusing`` says so for ``refresh_s``."""
        if not self.limits.enabled:
            return None
        today = utc_day()
        keys = _keys((tenant, today))
        held = await self._reserve(
            keys=[keys.spend, keys.holds, keys.estimates],
            args=[
                job_id,
                estimate,
                self.limits.daily_tokens,
                repr(self.limits.daily_usd),
                int(time.time() * 1000),
                int(self.limits.hold_s * 1000),
                _KEEP_MS,
            ],
        )
        if held:
            self._seen.pop(tenant, None)
            return None
        if len(self._seen) > 100_000:
            self._seen.clear()
        self._seen[tenant] = (time.monotonic(), today)
        return seconds_to_midnight()


def _keys(tenant_day: tuple[str, str]) -> names.BudgetKeys:
    tenant, day = tenant_day
    return names.tenant_budget(names.tenant_digest(tenant), day)


async def publish_limits(redis: RedisClient, budgets: Budgets | None) -> None:
    """Say in Redis which budgets the API enforces (none: the key goes), so
    that ``oncely tenants usage`` reports them without the API's
    environment. A Redis that does not answer only costs the report."""
    try:
        if budgets is None:
            await redis.delete(names.BUDGET_LIMITS)
        else:
            limits = {
                "daily_tokens": budgets.limits.daily_tokens,
                "daily_usd": budgets.limits.daily_usd,
            }
            await redis.set(names.BUDGET_LIMITS, json.dumps(limits))
    except RedisError as exc:
        log.warning("budgets.limits_not_published", error=type(exc).__name__)


async def published_limits(redis: RedisClient) -> BudgetLimits | None:
    """The budgets the API last said it enforces (None: none said)."""
    found = await redis.get(names.BUDGET_LIMITS)
    if found is None:
        return None
    data = json.loads(found)
    return BudgetLimits(int(data["daily_tokens"]), float(data["daily_usd"]))
