"""Which models a call may use, in order, and which of them the fleet skips
(docs/model-routing.md).

A call's *route* is the primary model (ONCELY_LLM_MODEL, or the variant a
workflow runs on) then its fallbacks (ONCELY_LLM_FALLBACKS, or the
workflow's own ``fallbacks=``), each ``name`` or ``name@base_url``. The
model (``oncely.llm.model``) moves down the route when a model's retries
ran out on a transient failure; a permanent one ends the call where it is.

The **cooldown** is shared by every worker through Redis, one hash per
model (``oncely:cooldown:<model>``: one key, so its scripts run on Redis
Cluster too). A model that failed transiently ``failures`` times within
``window_s`` is skipped by the whole fleet for ``cooldown_s``; then the
first worker to ask gets the *probe*: its call decides, a success ends the
cooldown, a failure starts another. Everyone else keeps skipping the model
while the probe is out (at most ``probe_s``).

Each process keeps its own view of every model's state and asks Redis at
most every ``refresh_s`` per model (one small script): the calls of a busy
worker pay nothing for the cooldown. Its own failures report to Redis at
once and bring back the fleet's state with the answer. Redis not answering
leaves the view as it was: the cooldown protects the provider, it never
stops a call on its own account.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import structlog
from redis.exceptions import RedisError

from oncely import metrics, names
from oncely.llm.base import LLM
from oncely.redis_client import RedisClient

log = structlog.get_logger(__name__)

# One item of ONCELY_LLM_FALLBACKS: a model name, optionally @ its endpoint.
_MODEL = re.compile(r"^(?P<name>[^@\s,]+)(?:@(?P<url>https?://[^\s,]+))?$")


@dataclass(frozen=True)
class ModelSpec:
    """A model a route names: ``base_url`` None is the primary's endpoint."""

    name: str
    base_url: str | None = None

    def __str__(self) -> str:
        return self.name if self.base_url is None else f"{self.name}@{self.base_url}"


def parse_models(text: str | Sequence[str]) -> list[ModelSpec]:
    """``gpt-4.1-mini,llama3@http://vllm:8000/v1`` (or the same as a list)
    as specs; ValueError naming the item that is neither."""
    items = text.split(",") if isinstance(text, str) else list(text)
    specs = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        match = _MODEL.match(item)
        if match is None:
            raise ValueError(f"{item!r}: expected a model name, or name@http(s)://endpoint")
        specs.append(ModelSpec(match["name"], match["url"]))
    names_ = [s.name for s in specs]
    if len(set(names_)) != len(names_):
        raise ValueError(f"a model is named twice in {', '.join(names_)}")
    return specs


@dataclass(frozen=True)
class Target:
    """One model of a route: its name (what the provider is asked for, and
    every metric's and ledger row's label) and the adapter that asks it."""

    name: str
    llm: LLM


@dataclass(frozen=True)
class CooldownPolicy:
    """ONCELY_LLM_COOLDOWN_*: ``failures`` 0 turns the cooldown off."""

    failures: int = 5
    window_s: float = 30.0
    cooldown_s: float = 60.0
    # The longest a probe may stay out before another worker may probe.
    probe_s: float = 30.0
    # How stale this process's view of a model may be.
    refresh_s: float = 0.5


# KEYS[1]: the model's hash. ARGV[1]: probe lease ms.
# Returns {verdict, ms}: 0 go, 1 go as the probe, 2 skip for ms (cooling
# down), 3 skip while another worker's probe is out (for at most ms).
_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local untl = tonumber(redis.call('HGET', KEYS[1], 'until') or '0')
if untl == 0 then return {0, 0} end
if now < untl then return {2, untl - now} end
local probe = tonumber(redis.call('HGET', KEYS[1], 'probe') or '0')
if probe > now then return {3, probe - now} end
redis.call('HSET', KEYS[1], 'probe', now + tonumber(ARGV[1]))
return {1, 0}
"""

# KEYS[1]: the model's hash. ARGV: failures, window ms, cooldown ms, probe
# (1: this failure was the probe's), state ttl ms.
# Returns the ms the model is skipped for from now (0: not cooling).
_FAILED = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local untl = tonumber(redis.call('HGET', KEYS[1], 'until') or '0')
local cooldown = tonumber(ARGV[3])
if ARGV[4] == '1' or (untl > 0 and now >= untl) then
  redis.call('HSET', KEYS[1], 'until', now + cooldown, 'count', 0)
  redis.call('HDEL', KEYS[1], 'probe')
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
  return cooldown
end
if untl > now then return untl - now end
local start = tonumber(redis.call('HGET', KEYS[1], 'start') or '0')
local count = 1
if now - start > tonumber(ARGV[2]) then
  redis.call('HSET', KEYS[1], 'start', now, 'count', 1)
else
  count = redis.call('HINCRBY', KEYS[1], 'count', 1)
end
if count >= tonumber(ARGV[1]) then
  redis.call('HSET', KEYS[1], 'until', now + cooldown, 'count', 0)
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
  return cooldown
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 0
"""

# KEYS[1]: the model's hash. A probe answered: the cooldown is over.
_RECOVERED = """
if redis.call('HEXISTS', KEYS[1], 'until') == 1 then redis.call('DEL', KEYS[1]) return 1 end
return 0
"""

# How long a cooling model's state outlives its cooldown when nobody probes
# it (a model taken out of every route): then it is forgotten.
_STATE_TTL_S = 3600.0


@dataclass(frozen=True)
class Admission:
    verdict: Literal["go", "probe", "skip"]
    # Skip: seconds until the model may be asked again.
    wait_s: float = 0.0


_GO = Admission("go")


@dataclass
class _View:
    """This process's view of one model: skipped until ``until``
    (monotonic; 0 if not), as Redis said at ``checked``."""

    until: float = 0.0
    checked: float = float("-inf")
    # The refresh in flight, which concurrent callers share.
    refreshing: asyncio.Future[Admission] | None = None


class Cooldown:
    """The fleet's cooldown of models that keep failing (module docstring)."""

    def __init__(self, redis: RedisClient, policy: CooldownPolicy) -> None:
        self.policy = policy
        self._admit = redis.register_script(_ADMIT)
        self._failed = redis.register_script(_FAILED)
        self._recovered = redis.register_script(_RECOVERED)
        self._views: dict[str, _View] = {}

    @property
    def enabled(self) -> bool:
        return self.policy.failures > 0

    def cooling(self, model: str) -> bool:
        """Whether this process skips ``model`` now (no I/O)."""
        view = self._views.get(model)
        return view is not None and time.monotonic() < view.until

    async def admit(self, model: str) -> Admission:
        """Go, go as the probe, or skip for a while."""
        if not self.enabled:
            return _GO
        view = self._view(model)
        now = time.monotonic()
        if now < view.until:
            return Admission("skip", view.until - now)
        if not view.until and now - view.checked < self.policy.refresh_s:
            return _GO
        if view.refreshing is not None:
            # Another call of this process is asking: its answer holds for
            # this one too, but a probe is one call's alone.
            shared = await asyncio.shield(view.refreshing)
            return Admission("skip", self.policy.refresh_s) if shared.verdict == "probe" else shared
        view.refreshing = asyncio.get_running_loop().create_future()
        try:
            admission = await self._ask(model, view)
        finally:
            if not view.refreshing.done():
                view.refreshing.set_result(_GO)
            view.refreshing = None
        return admission

    async def _ask(self, model: str, view: _View) -> Admission:
        assert view.refreshing is not None
        try:
            verdict, ms = await self._admit(
                keys=[names.model_cooldown(model)], args=[_ms(self.policy.probe_s)]
            )
        except RedisError as exc:
            log.warning("cooldown.unreadable", model=model, error=type(exc).__name__)
            admission = _GO
        else:
            admission = _admission(int(verdict), int(ms))
            now = view.checked = time.monotonic()
            if verdict == 1:
                # While this process's probe is out, its other calls skip too.
                view.until = now + self.policy.probe_s
            elif verdict == 3:
                # Another's probe may answer any moment: ask again soon.
                admission = Admission("skip", min(admission.wait_s, self.policy.refresh_s))
                view.until = now + admission.wait_s
            else:
                view.until = now + admission.wait_s if admission.verdict == "skip" else 0.0
        view.refreshing.set_result(admission)
        return admission

    async def failed(self, model: str, *, probe: bool) -> None:
        """A call to ``model`` failed transiently: counted fleet-wide."""
        if not self.enabled:
            return
        p = self.policy
        ttl_ms = _ms(p.cooldown_s + p.probe_s + _STATE_TTL_S)
        args = [p.failures, _ms(p.window_s), _ms(p.cooldown_s), int(probe), ttl_ms]
        try:
            ms = int(await self._failed(keys=[names.model_cooldown(model)], args=args))
        except RedisError as exc:
            log.warning("cooldown.unwritable", model=model, error=type(exc).__name__)
            return
        view = self._view(model)
        now = view.checked = time.monotonic()
        was_cooling = now < view.until
        view.until = now + ms / 1000 if ms > 0 else 0.0
        if ms > 0 and not was_cooling:
            log.warning("model.cooling_down", model=model, seconds=round(ms / 1000, 1))

    async def recovered(self, model: str) -> None:
        """The probe answered: ``model`` is back for the whole fleet."""
        view = self._view(model)
        view.until, view.checked = 0.0, time.monotonic()
        with contextlib.suppress(RedisError):
            if await self._recovered(keys=[names.model_cooldown(model)]):
                log.info("model.recovered", model=model)

    def _view(self, model: str) -> _View:
        view = self._views.get(model)
        if view is None:
            view = self._views[model] = _View()
            gauge = metrics.MODEL_COOLDOWN.labels(model=model)
            gauge.set_function(lambda: 1.0 if self.cooling(model) else 0.0)
        return view


def _admission(verdict: int, ms: int) -> Admission:
    if verdict == 0:
        return _GO
    if verdict == 1:
        return Admission("probe")
    return Admission("skip", max(ms, 1) / 1000)


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))
