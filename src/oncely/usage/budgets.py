"""Tenants' daily spend on the model, fleet-wide in Redis, and the budgets
it is held to (ONCELY_TENANT_DAILY_TOKENS, ONCELY_TENANT_DAILY_USD).

Workers add what each tenant's calls used as the ledger writes them
(``oncely.usage.ledger``): one hash per tenant and UTC day, ``tokens`` and
``usd``, kept two days. The intake reads it before it claims a key: a tenant
over either budget gets 429 ``budget-exceeded`` until midnight UTC, and no
key is claimed. Jobs already accepted run regardless: a budget refuses new
work, it never strands accepted work (so a day's spend may end a little
over the budget, by what accepted jobs still had to do).

Each API process trusts what it read of a tenant for ``refresh_s``: the
intake of a busy tenant reads Redis once a second, not once a request.
Shadow runs' calls are the operator's experiment and count against no
tenant's budget.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import structlog
from redis.exceptions import RedisError

from oncely import names
from oncely.redis_client import RedisClient, ScriptCall, call_together

log = structlog.get_logger(__name__)

# KEYS[1]: a tenant's day. ARGV: tokens, usd, ttl ms.
_ADD = """
redis.call('HINCRBY', KEYS[1], 'tokens', ARGV[1])
if tonumber(ARGV[2]) ~= 0 then redis.call('HINCRBYFLOAT', KEYS[1], 'usd', ARGV[2]) end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
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
    """Per tenant per UTC day; 0 turns a budget off."""

    daily_tokens: int = 0
    daily_usd: float = 0.0

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
        # tenant -> (read at, monotonic; over budget on that day, or None)
        self._seen: dict[str, tuple[float, str | None]] = {}

    async def add(self, spent: Mapping[tuple[str, str], Spent]) -> None:
        """Add to each (tenant, day)'s spend, in one round trip."""
        calls = [
            ScriptCall(
                self._add,
                [names.tenant_spend(names.tenant_digest(tenant), day)],
                [s.tokens, repr(s.usd), _KEEP_MS],
            )
            for (tenant, day), s in spent.items()
            if s.tokens or s.usd
        ]
        if not calls:
            return
        failed = [r for r in await call_together(self.redis, calls) if isinstance(r, RedisError)]
        if failed:
            # A budget is a soft limit: losing a batch's count is better than
            # holding the ledger up.
            log.warning("budgets.not_counted", error=type(failed[0]).__name__, batches=len(failed))

    async def spent(self, tenant: str, day: str | None = None) -> Spent:
        """What ``tenant`` spent on ``day`` (default today, UTC)."""
        key = names.tenant_spend(names.tenant_digest(tenant), day or utc_day())
        tokens, usd = await self.redis.hmget(key, ["tokens", "usd"])
        return Spent(int(tokens or 0), float(usd or 0.0))

    async def refusal(self, tenant: str) -> int | None:
        """Seconds until ``tenant`` may start new work again (midnight UTC),
        or None when it is within its budgets (or there are none)."""
        if not self.limits.enabled:
            return None
        today = utc_day()
        now = time.monotonic()
        seen = self._seen.get(tenant)
        if seen is None or now - seen[0] >= self.refresh_s:
            over = self.limits.exceeded_by(await self.spent(tenant, today))
            seen = (now, today if over else None)
            if len(self._seen) > 100_000:
                self._seen.clear()
            self._seen[tenant] = seen
        return seconds_to_midnight() if seen[1] == today else None
