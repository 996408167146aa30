"""Fleet-wide back-pressure on the model provider, shared through Redis.

Two mechanisms, checked in one Lua call before every model call:

- **Pause.** When any worker gets a 429, it pauses the whole fleet for the
  provider's ``Retry-After`` (capped): every other worker waits too, instead
  of each finding the limit on its own and making it worse.
- **Pacing.** With ``ONCELY_LLM_RPM`` / ``ONCELY_LLM_TPM`` set, a GCRA
  (generic cell rate algorithm) per limit spaces calls evenly across all
  workers, with a small burst allowance. A call that would break either limit
  is not made; the caller is told how long to wait. A call reserves its
  estimated tokens; once the provider reports what it used, the TPM state is
  moved by the difference, so the pacing follows real usage, not the guess.

**Redis away.** A limiter whose Redis node does not answer fails open to
the local limit (docs/production.md, "Failover"): this process paces its
own calls at ``ONCELY_LLM_RPM``/``TPM`` and keeps its own pause until Redis
answers again, so one node's loss stalls no model call whose keys it did
not hold, and no call that never left is failed for it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import structlog
from redis.exceptions import RedisError

from oncely import metrics, names
from oncely.errors import FleetLimited
from oncely.llm.base import (
    LLM,
    Background,
    Completion,
    Message,
    Reasoning,
    ResponseSchema,
    ToolChoice,
    ToolSpec,
    call_options,
)
from oncely.llm.routing import dialect_of, lanes_of, max_tokens_of
from oncely.redis_client import RedisClient
from oncely.retry import classify, retry_after_s, status_of

log = structlog.get_logger(__name__)

# KEYS: pause, then an (rpm, tpm) pair per bucket: the fleet's, and for a
# call that takes a share of the fleet's limits (shadow runs), the share's.
# ARGV: tokens, then per bucket: rpm interval ms, rpm burst ms, tpm interval
# ms per token, tpm burst ms. An interval of 0 means no limit.
# Returns 0 when the call may go now (and records it in every bucket), else
# ms to wait.
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local paused = redis.call('PTTL', KEYS[1])
if paused > 0 then return paused end
local function check(key, interval, burst, cost)
  if interval <= 0 then return 0, 0 end
  local tat = tonumber(redis.call('GET', key) or '0')
  if tat < now then tat = now end
  local new_tat = tat + interval * cost
  local wait = new_tat - burst - now
  -- A call bigger than the burst would wait forever: it goes once nothing
  -- else is owed, and later calls pay for it.
  if interval * cost > burst then wait = tat - now end
  if wait > 0 then return wait, 0 end
  return 0, new_tat
end
local tokens = tonumber(ARGV[1])
local wait = 0
local tats = {}
for b = 0, (#KEYS - 1) / 2 - 1 do
  local a = 2 + b * 4
  local wait_r, tat_r = check(KEYS[2 + b * 2], tonumber(ARGV[a]), tonumber(ARGV[a + 1]), 1)
  local wait_t, tat_t = check(KEYS[3 + b * 2], tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), tokens)
  wait = math.max(wait, wait_r, wait_t)
  tats[#tats + 1] = tat_r
  tats[#tats + 1] = tat_t
end
if wait > 0 then return math.ceil(wait) end
for i, tat in ipairs(tats) do
  if tat > 0 then redis.call('SET', KEYS[i + 1], tat, 'PX', math.ceil(tat - now) + 1) end
end
return 0
"""

# KEYS: the tpm key of each bucket. ARGV: tokens used minus tokens reserved,
# then each key's interval ms per token.
# Moves each theoretical arrival time by the difference, never below now: a
# call that used less than it reserved gives the rest back, one that used more
# pays for it. Returns the fleet bucket's new backlog in ms (0: no state left).
_SETTLE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local backlog = 0
for i, key in ipairs(KEYS) do
  local tat = tonumber(redis.call('GET', key) or '0')
  if tat < now then tat = now end
  local new_tat = tat + tonumber(ARGV[i + 1]) * tonumber(ARGV[1])
  if new_tat <= now then
    redis.call('DEL', key)
  else
    redis.call('SET', key, new_tat, 'PX', math.ceil(new_tat - now) + 1)
    if i == 1 then backlog = math.ceil(new_tat - now) end
  end
end
return backlog
"""

# How stale this process's view of a fleet pause may be (no RPM/TPM limits).
_PAUSE_REFRESH_S = 0.1
# While Redis does not answer, one warning this often, and Redis asked
# again this often.
_FAIL_OPEN_LOG_EVERY_S = 10.0
_FLEET_RETRY_S = 1.0
# A tenth of a minute's allowance may go at once; the rest is paced.
_BURST_SHARE = 0.1
_MINUTE_MS = 60_000.0


@dataclass(frozen=True)
class Limits:
    rpm: int = 0
    tpm: int = 0
    pause_max_s: float = 30.0


def _interval_ms(per_minute: int, fraction: float) -> float:
    """GCRA emission interval of ``fraction`` of a per-minute limit (0: no limit)."""
    return _MINUTE_MS / (per_minute * fraction) if per_minute else 0.0


def _burst_ms(interval_ms: float) -> float:
    return _MINUTE_MS * _BURST_SHARE if interval_ms else 0.0


def estimate_tokens(messages: Sequence[Message], max_output: int = 256) -> int:
    """About four characters a token over all messages, plus the answer's allowance."""
    return sum(len(message.content) for message in messages) // 4 + max_output


class FleetLimiter:
    """The fleet's limits, shared by every worker through Redis.

    With ``share`` below 1 (shadow runs: ``ONCELY_SHADOW_RPM_SHARE``) a call
    counts against the fleet's limits *and* against a bucket of its own at
    ``share`` of them: such calls never take more than their share, and what
    they take counts for the fleet, so production keeps the rest even when it
    runs at the limit."""

    def __init__(self, redis: RedisClient, limits: Limits, *, share: float = 1.0) -> None:
        if not 0 < share <= 1:
            raise ValueError("share must be in (0, 1]")
        self.redis = redis
        self.limits = limits
        self.share = share
        self._acquire = redis.register_script(_ACQUIRE)
        self._settle = redis.register_script(_SETTLE)
        self.waits = 0
        self.pauses = 0
        # Without RPM/TPM limits only the pause matters; this process reads it
        # from Redis at most every _PAUSE_REFRESH_S instead of once per call.
        self._paused_until = 0.0
        self._refreshed_at = -_PAUSE_REFRESH_S
        self._refreshing: asyncio.Future[None] | None = None
        # (rpm key, tpm key, fraction of the limits) per bucket this limiter counts in.
        self._buckets = [(names.LLM_RPM, names.LLM_TPM, 1.0)]
        if share < 1:
            self._buckets.append((names.LLM_SHARE_RPM, names.LLM_SHARE_TPM, share))
        # This process's pacing while Redis does not answer.
        self._local = _LocalPacing(limits, share)
        self._fail_open_logged_at = -_FAIL_OPEN_LOG_EVERY_S
        self._fleet_again_at = 0.0

    async def acquire(self, tokens: int) -> float:
        """0 if a call may go now (and it is counted), else seconds to wait.
        Redis not answering: this process's own pause and pacing decide."""
        if time.monotonic() >= self._fleet_again_at:
            try:
                return await self._acquire_fleet(tokens)
            except RedisError as exc:
                self._failed_open(exc)
        metrics.LIMITER_FAIL_OPEN.inc()
        wait = max(0.0, self._paused_until - time.monotonic(), self._local.wait(tokens))
        if wait > 0:
            self.waits += 1
        return wait

    def _failed_open(self, exc: RedisError) -> None:
        """Redis did not answer: this process decides alone for a while,
        rather than wait for it on every call."""
        now = time.monotonic()
        self._fleet_again_at = now + _FLEET_RETRY_S
        if now - self._fail_open_logged_at >= _FAIL_OPEN_LOG_EVERY_S:
            self._fail_open_logged_at = now
            log.warning("limiter.fail_open", error=type(exc).__name__)

    async def _acquire_fleet(self, tokens: int) -> float:
        if not (self.limits.rpm or self.limits.tpm):
            wait = await self._pause_left()
            if wait > 0:
                self.waits += 1
            return wait
        keys = [names.LLM_PAUSE]
        args: list[float] = [tokens]
        for rpm_key, tpm_key, fraction in self._buckets:
            rpm_ms = _interval_ms(self.limits.rpm, fraction)
            tpm_ms = _interval_ms(self.limits.tpm, fraction)
            keys += [rpm_key, tpm_key]
            args += [rpm_ms, _burst_ms(rpm_ms), tpm_ms, _burst_ms(tpm_ms)]
        wait_ms = int(await self._acquire(keys=keys, args=args))
        if wait_ms > 0:
            self.waits += 1
        return wait_ms / 1000

    async def settle(self, reserved: int, used: int) -> None:
        """Correct a call's TPM reservation to the tokens the provider reported.
        Nothing to do without a TPM limit, or when the provider reported none."""
        if not self.limits.tpm or used <= 0 or used == reserved:
            return
        keys = [tpm_key for _, tpm_key, _ in self._buckets]
        intervals = [_interval_ms(self.limits.tpm, f) for _, _, f in self._buckets]
        try:
            await self._settle(keys=keys, args=[used - reserved, *intervals])
        except RedisError as exc:
            # The answer is paid for and in hand; losing it over a pacing
            # correction would pay for it again.
            log.warning("limiter.settle_failed", error=type(exc).__name__)

    async def _pause_left(self) -> float:
        now = time.monotonic()
        if now - self._refreshed_at >= _PAUSE_REFRESH_S:
            if self._refreshing is None:
                self._refreshing = asyncio.ensure_future(self._refresh_pause())
            refreshing = self._refreshing
            try:
                await asyncio.shield(refreshing)
            finally:
                if self._refreshing is refreshing and refreshing.done():
                    self._refreshing = None
        return max(0.0, self._paused_until - time.monotonic())

    async def _refresh_pause(self) -> None:
        pttl = int(await self.redis.pttl(names.LLM_PAUSE))
        now = time.monotonic()
        self._refreshed_at = now
        self._paused_until = max(self._paused_until, now + pttl / 1000) if pttl > 0 else 0.0

    async def pause(self, seconds: float) -> None:
        """Hold every worker's calls for ``seconds`` (never shortens a longer pause)."""
        ms = int(min(seconds, self.limits.pause_max_s) * 1000)
        if ms <= 0:
            return
        self.pauses += 1
        self._paused_until = max(self._paused_until, time.monotonic() + ms / 1000)
        try:
            current = await self.redis.pttl(names.LLM_PAUSE)
            if current < ms:
                await self.redis.set(names.LLM_PAUSE, "1", px=ms)
        except RedisError as exc:
            # This process pauses all the same; the others find the limit too.
            self._failed_open(exc)


class _LocalPacing:
    """The fleet's GCRA for one process alone, at the configured limits:
    what paces its calls while Redis does not answer."""

    def __init__(self, limits: Limits, share: float) -> None:
        self._rpm_ms = _interval_ms(limits.rpm, share)
        self._tpm_ms = _interval_ms(limits.tpm, share)
        self._rpm_tat = self._tpm_tat = 0.0

    def wait(self, tokens: int) -> float:
        """0 if a call may go now (and it is counted), else seconds to wait."""
        now = time.monotonic() * 1000
        wait_r, rpm_tat = _gcra(self._rpm_tat, now, self._rpm_ms, 1)
        wait_t, tpm_tat = _gcra(self._tpm_tat, now, self._tpm_ms, tokens)
        if max(wait_r, wait_t) > 0:
            return max(wait_r, wait_t) / 1000
        self._rpm_tat, self._tpm_tat = rpm_tat, tpm_tat
        return 0.0


def _gcra(tat: float, now: float, interval: float, cost: int) -> tuple[float, float]:
    """``_ACQUIRE``'s check in Python: (ms to wait, the new arrival time)."""
    if interval <= 0:
        return 0.0, tat
    tat = max(tat, now)
    burst = _burst_ms(interval)
    wait = tat - now if interval * cost > burst else tat + interval * cost - burst - now
    return (wait, tat) if wait > 0 else (0.0, tat + interval * cost)


class LimitedLLM:
    """Any ``LLM``, behind the fleet limiter. Waits that fit in the attempt's
    timeout are waited here; longer ones become a TransientError carrying the
    wait as Retry-After, so the retry policy (and the deadline) decide."""

    def __init__(self, llm: LLM, limiter: FleetLimiter) -> None:
        self.llm = llm
        self.limiter = limiter
        # The dialect of the adapter behind it (its ledger rows say it).
        self.dialect = dialect_of(llm)
        # And the lanes it takes (docs/lanes.md), and the answer's length a
        # batch line of its dialect asks (``anthropic``'s, which it needs).
        self.lanes = lanes_of(llm)
        self.max_tokens = max_tokens_of(llm)

    async def complete(
        self,
        messages: Sequence[Message],
        timeout: float,  # noqa: ASYNC109 (LLM protocol)
        *,
        schema: ResponseSchema | None = None,
        tools: Sequence[ToolSpec] = (),
        tool_choice: ToolChoice | None = None,
        on_text: Callable[[str], None] | None = None,
        reasoning: Reasoning | None = None,
        background: Background | None = None,
        service_tier: str | None = None,
    ) -> Completion:
        started = time.monotonic()
        # Re-attaching to a background response asks the provider for
        # nothing new: it was paced, and counted, when it was created.
        reattaching = background is not None and background.stored is not None
        reserved = 0 if reattaching else estimate_tokens(messages)
        while not reattaching and (wait := await self.limiter.acquire(reserved)) > 0:
            if time.monotonic() - started + wait >= timeout:
                raise FleetLimited("fleet rate limit", retry_after_s=wait)
            await asyncio.sleep(wait)
        left = timeout - (time.monotonic() - started)
        extra = call_options(tools, tool_choice, on_text, reasoning, background, service_tier)
        try:
            completion = await self.llm.complete(messages, left, schema=schema, **extra)
        except Exception as exc:
            # Adapters translate a provider's 429 into TransientError(status=429);
            # a 429 that says the account cannot pay (ProviderQuota) is no pace,
            # nor is a flex call's (the flex tier out of capacity says nothing
            # of the standard tier's pace: docs/lanes.md).
            if status_of(exc) == 429 and classify(exc) and service_tier is None:
                await self.limiter.pause(retry_after_s(exc) or 1.0)
            raise
        if not reattaching:
            used = completion.prompt_tokens + completion.completion_tokens
            await self.limiter.settle(reserved, used)
        return replace(completion, queued_s=timeout - left)
