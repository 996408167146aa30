"""The fleet's cooldown of models that keep failing (docs/model-routing.md,
"The cooldown").

A cooldown must tell a sick provider from a sick request. The rule:

- **What counts.** A call that failed transiently *from the model's side*:
  a 5xx, 408, 409, a connection error, its own time running out. Never a
  429 (pacing is the fleet limiter's business: ``oncely.llm.limiter``), never
  a call cancelled from outside (a job's cancel, a shutdown). Failures are
  counted by **distinct job** within a window of ``window_s``: one job's
  retries and redeliveries are one failure. Answered calls are counted too,
  per tenant.
- **A tenant's cooldown.** A tenant with at least ``failures`` failing jobs
  in the window, failing jobs at least ``share`` of its failing jobs and
  answered calls together, has the model skipped *for its own calls*. One
  tenant's failing prompts never cool the model for anybody else.
- **The fleet's cooldown.** The model is skipped for every call once at
  least ``failures`` jobs failed in the window, from at least ``tenants``
  failing tenants (each as above, by share) that make up at least ``share``
  of the tenants active in the window. In a deployment with one tenant, its
  cooldown is the fleet's in effect.
- **The probe** (half-open). A cooling scope lets one call through every
  ``probe_every_s``: the first call in the scope past that time is the
  probe. Its answer ends the cooldown at once; its failure waits another
  ``probe_every_s`` for the next (the provider's ``Retry-After``, when it
  asks for longer, up to ``cooldown_s``), never a whole new cooldown, so a
  model that comes back is found within seconds. Meanwhile other calls
  keep skipping (at most ``probe_s`` per probe out). The job whose failure
  was the last probe's may not probe again within ``probe_grace_s`` of the
  next probe's time while another job may: one failing job cannot keep a
  model cooling by taking every probe.
- **The jobs waiting.** A job whose every model cools waits outside the
  worker (``oncely.errors.ResumeLater``) for ``cooldown_s`` at most; the
  workers let it out earlier (``scopes``): one such job per scope when its
  probe may go, and all of them once their scope no longer cools.

State lives in Redis, per model, in three keys of one hash slot
(``names.model_cooldown``): the scopes' cooldowns, the window's failing
jobs, and the window's counts per tenant (tenants by digest, never by
name). Each process keeps its own view and asks Redis at most every
``refresh_s`` per model (one small script, which also brings the process's
answered calls): the calls of a busy worker pay nothing for the cooldown.
Its failures report at once and bring the fleet's state back with the
answer. Redis not answering leaves the view as it was: the cooldown protects
the provider, it never stops a call on its own account.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

import structlog
from redis.exceptions import RedisError

from oncely import metrics, names
from oncely.llm.routing import Caller
from oncely.redis_client import RedisClient

log = structlog.get_logger(__name__)

# The fleet's scope; a tenant's scope is its digest (hex).
FLEET = "*"


@dataclass(frozen=True)
class CooldownPolicy:
    """ONCELY_LLM_COOLDOWN_*: ``failures`` 0 turns the cooldown off."""

    # Failing jobs (distinct) in the window before a scope may cool.
    failures: int = 5
    window_s: float = 30.0
    # The longest between two probes (a Retry-After asking for more is cut
    # to it), and the longest a job waiting for the cooldown stays away.
    cooldown_s: float = 60.0
    # Between two probes of a cooling scope (half-open): one call through.
    probe_every_s: float = 5.0
    # The share of failing jobs (of a tenant's failing jobs and answered
    # calls), and of failing tenants (of the active ones), that cools.
    share: float = 0.5
    # Failing tenants the fleet's cooldown needs.
    tenants: int = 3
    # The longest a probe may stay out before another call may probe.
    probe_s: float = 30.0
    # How long past the next probe's time the job that failed the last
    # probe leaves that probe to another job.
    probe_grace_s: float = 5.0
    # How long a call that found a probe out waits before asking again.
    probe_wait_s: float = 2.0
    # How stale this process's view of a model may be.
    refresh_s: float = 0.5


@dataclass(frozen=True)
class Admission:
    """Go, go as the probe of ``scope``, or skip for ``wait_s`` seconds."""

    verdict: Literal["go", "probe", "skip"]
    wait_s: float = 0.0
    scope: str = ""


_GO = Admission("go")

# Shared by every script. KEYS[1]: the scopes (u:<scope> until, p:<scope>
# probe lease, f:<scope> the job that failed the last probe); KEYS[2]: the
# window's failing jobs (job -> tenant); KEYS[3]: the window's counts (end,
# n failing jobs, f:<tenant> failing jobs, o:<tenant> answered calls).
_COMMON = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function window(window_ms)
  local e = tonumber(redis.call('HGET', KEYS[3], 'end') or '0')
  if e <= now then
    redis.call('DEL', KEYS[2], KEYS[3])
    e = now + tonumber(window_ms)
    redis.call('HSET', KEYS[3], 'end', e)
    redis.call('PEXPIREAT', KEYS[3], e)
  end
  return e
end
local function answered(from, window_ms)
  if #ARGV < from then return end
  window(window_ms)
  for i = from, #ARGV, 2 do
    redis.call('HINCRBY', KEYS[3], 'o:' .. ARGV[i], ARGV[i + 1])
  end
end
local function snapshot(head)
  local all = redis.call('HGETALL', KEYS[1])
  for i = 1, #all, 2 do
    if string.sub(all[i], 1, 2) == 'u:' then
      head[#head + 1] = string.sub(all[i], 3)
      head[#head + 1] = tostring(tonumber(all[i + 1]) - now)
    end
  end
  return head
end
local function until_of(s)
  return tonumber(redis.call('HGET', KEYS[1], 'u:' .. s) or '0')
end
"""

# ARGV: job, tenant scope, probe ms, probe grace ms, probe wait ms, window
# ms, then answered calls (scope, count)... Returns {verdict, ms, scope,
# snapshot...}: verdict 0 go, 1 go as the probe of scope, 2 skip for ms.
_ADMIT = (
    _COMMON
    + """
answered(7, ARGV[6])
local job, mine = ARGV[1], ARGV[2]
local function probe(s)
  local u = until_of(s)
  if u == 0 then return nil end
  local p = tonumber(redis.call('HGET', KEYS[1], 'p:' .. s) or '0')
  if p > now then return {2, math.min(p - now, tonumber(ARGV[5])), s} end
  local grace = u + tonumber(ARGV[4])
  if redis.call('HGET', KEYS[1], 'f:' .. s) == job and now < grace then
    return {2, math.min(grace - now, tonumber(ARGV[5])), s}
  end
  redis.call('HSET', KEYS[1], 'p:' .. s, now + tonumber(ARGV[3]))
  return {1, 0, s}
end
for _, s in ipairs({mine, '*'}) do
  local u = until_of(s)
  if now < u then return snapshot({2, u - now, s}) end
end
return snapshot(probe(mine) or probe('*') or {0, 0, ''})
"""
)

# ARGV: job, tenant scope, probe scope ('' if none), failures, window ms,
# ms until the next probe, share, tenants, state ttl ms, then answered calls (scope,
# count)... Returns the snapshot.
_FAILED = (
    _COMMON
    + """
local e = window(ARGV[5])
answered(10, ARGV[5])
local job, mine, min = ARGV[1], ARGV[2], tonumber(ARGV[4])
local share, quorum = tonumber(ARGV[7]), tonumber(ARGV[8])
local function arm(s)
  redis.call('HSET', KEYS[1], 'u:' .. s, now + tonumber(ARGV[6]))
  redis.call('HDEL', KEYS[1], 'p:' .. s)
  redis.call('PEXPIRE', KEYS[1], ARGV[9])
end
local function failing(f, o) return f > 0 and f >= share * (f + o) end
if ARGV[3] ~= '' then
  arm(ARGV[3])
  redis.call('HSET', KEYS[1], 'f:' .. ARGV[3], job)
end
if redis.call('HSETNX', KEYS[2], job, mine) == 1 then
  redis.call('PEXPIREAT', KEYS[2], e)
  local f = redis.call('HINCRBY', KEYS[3], 'f:' .. mine, 1)
  local n = redis.call('HINCRBY', KEYS[3], 'n', 1)
  local o = tonumber(redis.call('HGET', KEYS[3], 'o:' .. mine) or '0')
  if until_of(mine) == 0 and f >= min and failing(f, o) then arm(mine) end
  if until_of('*') == 0 and n >= min then
    local counts, active, bad = {}, 0, 0
    local all = redis.call('HGETALL', KEYS[3])
    for i = 1, #all, 2 do
      local kind, s = string.sub(all[i], 1, 2), string.sub(all[i], 3)
      if kind == 'f:' or kind == 'o:' then
        local c = counts[s]
        if c == nil then c = {0, 0}; counts[s] = c; active = active + 1 end
        c[kind == 'f:' and 1 or 2] = tonumber(all[i + 1])
      end
    end
    for _, c in pairs(counts) do
      if failing(c[1], c[2]) then bad = bad + 1 end
    end
    if bad >= quorum and bad >= share * active then arm('*') end
  end
end
return snapshot({})
"""
)

# The cooling scopes, each with 1 when its probe may go now (its time has
# come and no probe is out), else 0.
_SCOPES = (
    _COMMON
    + """
local all, out = redis.call('HGETALL', KEYS[1]), {}
local probes = {}
for i = 1, #all, 2 do
  if string.sub(all[i], 1, 2) == 'p:' then probes[string.sub(all[i], 3)] = tonumber(all[i + 1]) end
end
for i = 1, #all, 2 do
  if string.sub(all[i], 1, 2) == 'u:' then
    local s = string.sub(all[i], 3)
    local ready = tonumber(all[i + 1]) <= now and (probes[s] or 0) <= now
    out[#out + 1] = s
    out[#out + 1] = ready and 1 or 0
  end
end
return out
"""
)

# ARGV: the scope whose probe answered. Its cooldown is over, and its
# counts start afresh.
_RECOVERED = (
    _COMMON
    + """
local s = ARGV[1]
if until_of(s) == 0 then return 0 end
redis.call('HDEL', KEYS[1], 'u:' .. s, 'p:' .. s, 'f:' .. s)
if s == '*' then
  redis.call('DEL', KEYS[2], KEYS[3])
else
  local f = tonumber(redis.call('HGET', KEYS[3], 'f:' .. s) or '0')
  if f > 0 then redis.call('HINCRBY', KEYS[3], 'n', -f) end
  redis.call('HDEL', KEYS[3], 'f:' .. s, 'o:' .. s)
end
return 1
"""
)

# How long a cooling model's state outlives its cooldown when nobody probes
# it (a model taken out of every route): then it is forgotten.
_STATE_TTL_S = 3600.0


@dataclass
class _View:
    """This process's view of one model: the scopes Redis had cooling, each
    skipped until its monotonic time (a time past: over, awaiting its probe),
    as read at ``checked``; the answered calls not yet reported."""

    cooling: dict[str, float] = field(default_factory=dict)
    checked: float = float("-inf")
    # When the workers last saw the fleet's cooldown in Redis (``scopes``).
    seen: float = float("-inf")
    answered: Counter[str] = field(default_factory=Counter)
    # The refresh in flight, which concurrent callers share.
    refreshing: asyncio.Future[None] | None = None

    def wait_s(self, scope: str, now: float) -> float:
        """How long a call of ``scope`` skips the model from ``now`` (0: not)."""
        until = max(self.cooling.get(scope, 0.0), self.cooling.get(FLEET, 0.0))
        return max(0.0, until - now)

    def armed(self, scope: str) -> bool:
        return scope in self.cooling or FLEET in self.cooling

    def apply(self, snapshot: list[bytes | str], now: float) -> None:
        pairs = zip(snapshot[::2], snapshot[1::2], strict=True)
        self.cooling = {_text(s): now + max(0, int(ms)) / 1000 for s, ms in pairs}
        self.checked = now

    def take_answered(self) -> list[str | int]:
        pairs: list[str | int] = []
        for scope, count in self.answered.items():
            pairs += [scope, count]
        self.answered.clear()
        return pairs


class Cooldown:
    """The fleet's cooldown of models that keep failing (module docstring)."""

    def __init__(self, redis: RedisClient, policy: CooldownPolicy) -> None:
        self.policy = policy
        self._admit = redis.register_script(_ADMIT)
        self._failed = redis.register_script(_FAILED)
        self._recovered = redis.register_script(_RECOVERED)
        self._scopes = redis.register_script(_SCOPES)
        self._views: dict[str, _View] = {}

    @property
    def enabled(self) -> bool:
        return self.policy.failures > 0

    def cooling(self, model: str, caller: Caller | None = None) -> bool:
        """Whether this process skips ``model`` now, for the fleet or for
        ``caller``'s tenant (no I/O)."""
        view = self._views.get(model)
        scope = caller.scope if caller is not None else FLEET
        return view is not None and view.wait_s(scope, time.monotonic()) > 0

    async def admit(self, model: str, caller: Caller) -> Admission:
        """Go, go as the probe, or skip for a while."""
        if not self.enabled:
            return _GO
        view, scope = self._view(model), caller.scope
        now = time.monotonic()
        if wait_s := view.wait_s(scope, now):
            return Admission("skip", wait_s)
        if not view.armed(scope) and now - view.checked < self.policy.refresh_s:
            return _GO
        if view.refreshing is not None:
            # Another call of this process is asking: the state it brings
            # back holds for this call too, but a probe is one call's alone.
            await asyncio.shield(view.refreshing)
            now = time.monotonic()
            if wait_s := view.wait_s(scope, now):
                return Admission("skip", wait_s)
            return Admission("skip", self.policy.refresh_s) if view.armed(scope) else _GO
        view.refreshing = asyncio.get_running_loop().create_future()
        try:
            return await self._ask(model, view, caller)
        finally:
            view.refreshing.set_result(None)
            view.refreshing = None

    async def _ask(self, model: str, view: _View, caller: Caller) -> Admission:
        p = self.policy
        args: list[str | int | float] = [caller.job, caller.scope, _ms(p.probe_s)]
        args += [_ms(p.probe_grace_s), _ms(p.probe_wait_s), _ms(p.window_s)]
        args += view.take_answered()
        try:
            reply = await self._admit(keys=names.model_cooldown(model), args=args)
        except RedisError as exc:
            log.warning("cooldown.unreadable", model=model, error=type(exc).__name__)
            return _GO
        verdict, ms, scope = int(reply[0]), int(reply[1]), _text(reply[2])
        now = time.monotonic()
        view.apply(reply[3:], now)
        if verdict == 1:
            # While this process's probe is out, its other calls skip too.
            view.cooling[scope] = now + p.probe_s
            return Admission("probe", scope=scope)
        if verdict == 2:
            view.cooling[scope] = max(view.cooling.get(scope, 0.0), now + ms / 1000)
            return Admission("skip", max(ms, 1) / 1000)
        return _GO

    async def failed(
        self,
        model: str,
        caller: Caller,
        *,
        probe: str = "",
        retry_after_s: float | None = None,
    ) -> None:
        """A call of ``caller`` to ``model`` failed from the model's side
        (module docstring: what counts); ``probe``: the scope it probed."""
        if not self.enabled:
            return
        p = self.policy
        # Until the next probe: a failed one or a new cooldown alike.
        next_s = p.probe_every_s
        if retry_after_s is not None:
            next_s = min(max(next_s, retry_after_s), max(p.cooldown_s, p.probe_every_s))
        ttl_ms = _ms(p.cooldown_s + p.probe_s + _STATE_TTL_S)
        view = self._view(model)
        args: list[str | int | float] = [caller.job, caller.scope, probe, p.failures]
        args += [_ms(p.window_s), _ms(next_s), p.share, p.tenants, ttl_ms]
        args += view.take_answered()
        try:
            snapshot = await self._failed(keys=names.model_cooldown(model), args=args)
        except RedisError as exc:
            log.warning("cooldown.unwritable", model=model, error=type(exc).__name__)
            return
        before = dict(view.cooling)
        now = time.monotonic()
        view.apply(snapshot, now)
        for scope, until in view.cooling.items():
            if until > now and before.get(scope, 0.0) <= now:
                log.warning(
                    "model.cooling_down",
                    model=model,
                    scope="fleet" if scope == FLEET else "tenant",
                    seconds=round(until - now, 1),
                )

    async def answered(self, model: str, caller: Caller, *, probe: str = "") -> None:
        """A call answered: counted with the next report; a probe's answer
        ends its scope's cooldown for the whole fleet."""
        if not self.enabled:
            return
        view = self._view(model)
        if not probe:
            view.answered[caller.scope] += 1
            return
        view.cooling.pop(probe, None)
        try:
            if await self._recovered(keys=names.model_cooldown(model), args=[probe]):
                log.info(
                    "model.recovered", model=model, scope="fleet" if probe == FLEET else "tenant"
                )
        except RedisError as exc:
            log.warning("cooldown.unwritable", model=model, error=type(exc).__name__)

    async def scopes(self, model: str) -> dict[str, bool]:
        """The scopes cooling ``model`` fleet-wide, each True when its probe
        may go now: what the workers let waiting jobs out by. Redis not
        answering: none (the cooldown never holds a job on its own account)."""
        if not self.enabled:
            return {}
        try:
            reply = await self._scopes(keys=names.model_cooldown(model), args=[])
        except RedisError as exc:
            log.warning("cooldown.unreadable", model=model, error=type(exc).__name__)
            return {}
        found = {
            _text(s): int(ready) == 1 for s, ready in zip(reply[::2], reply[1::2], strict=True)
        }
        view = self._view(model)
        for scope in [s for s in view.cooling if s not in found]:
            del view.cooling[scope]  # ended by another process's probe
        if FLEET in found:
            view.cooling.setdefault(FLEET, 0.0)
            view.seen = time.monotonic()
        return found

    def _fleet_cools(self, model: str) -> bool:
        """The gauge: the fleet's cooldown of ``model`` as this process last
        read it (between probes, too), within a cooldown's length."""
        view, now = self._views.get(model), time.monotonic()
        if view is None or FLEET not in view.cooling:
            return False
        return view.wait_s(FLEET, now) > 0 or now - max(view.checked, view.seen) < (
            self.policy.cooldown_s
        )

    def _view(self, model: str) -> _View:
        view = self._views.get(model)
        if view is None:
            view = self._views[model] = _View()
            gauge = metrics.MODEL_COOLDOWN.labels(model=model)
            gauge.set_function(lambda: 1.0 if self._fleet_cools(model) else 0.0)
        return view


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))
