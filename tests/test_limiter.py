"""Fleet-wide back-pressure through Redis: a 429 seen by one worker slows
every worker, and RPM/TPM limits pace calls across processes."""

from __future__ import annotations

import asyncio
import time

import pytest

from oncely import names
from oncely.errors import TransientError
from oncely.llm.limiter import FleetLimiter, LimitedLLM, Limits


class RecordingLLM:
    """An in-process model: records when each call arrived; can answer 429."""

    def __init__(self, calls: list[float], fail_first_with_429: float | None = None) -> None:
        self.calls = calls
        self.fail_first_with_429 = fail_first_with_429

    async def complete(self, prompt: str, timeout: float) -> str:  # noqa: ASYNC109
        self.calls.append(time.monotonic())
        if self.fail_first_with_429 is not None:
            retry_after, self.fail_first_with_429 = self.fail_first_with_429, None
            raise RateLimited(retry_after)
        return "ok"


class RateLimited(Exception):
    """Looks like the SDK's 429: a status and a Retry-After header."""

    status_code = 429

    def __init__(self, retry_after: float) -> None:
        super().__init__("429")
        self.headers = {"retry-after": str(retry_after)}


@pytest.fixture
def limiter(redis) -> FleetLimiter:
    return FleetLimiter(redis, Limits())


async def test_a_429_seen_by_one_worker_pauses_every_worker(redis, limiter):
    calls_a: list[float] = []
    calls_b: list[float] = []
    worker_a = LimitedLLM(RecordingLLM(calls_a, fail_first_with_429=0.4), limiter)
    worker_b = LimitedLLM(RecordingLLM(calls_b), FleetLimiter(redis, Limits()))
    with pytest.raises(RateLimited):
        await worker_a.complete("prompt a", timeout=5)
    failed_at = time.monotonic()
    assert 0 < await redis.pttl(names.LLM_PAUSE) <= 400
    assert await worker_b.complete("prompt b", timeout=5) == "ok"
    assert calls_b[0] - failed_at >= 0.3, "worker B waited out worker A's Retry-After"


async def test_a_pause_longer_than_the_attempt_becomes_a_retry_after(redis, limiter):
    await limiter.pause(2.0)
    calls: list[float] = []
    worker = LimitedLLM(RecordingLLM(calls), FleetLimiter(redis, Limits()))
    with pytest.raises(TransientError) as raised:
        await worker.complete("prompt", timeout=0.5)
    assert raised.value.retry_after_s is not None
    assert 1.5 < raised.value.retry_after_s <= 2.0
    assert calls == [], "no call is made into a known rate limit"


async def test_pause_is_capped_and_never_shortened(redis):
    limiter = FleetLimiter(redis, Limits(pause_max_s=1.0))
    await limiter.pause(60)
    assert 900 < await redis.pttl(names.LLM_PAUSE) <= 1000
    await limiter.pause(0.1)
    assert await redis.pttl(names.LLM_PAUSE) > 500


async def test_rpm_paces_calls_across_workers(redis):
    """600 rpm = one call per 100 ms fleet-wide, after a burst of 60."""
    limits = Limits(rpm=600)
    calls: list[float] = []
    workers = [LimitedLLM(RecordingLLM(calls), FleetLimiter(redis, limits)) for _ in range(2)]
    await asyncio.gather(*(w.complete(f"p{i}", timeout=10) for i, w in enumerate(workers * 35)))
    assert len(calls) == 70
    # 60 go at once (the burst), the other 10 are spaced 100 ms apart.
    assert calls[-1] - calls[0] >= 0.9
    waits = sum(w.limiter.waits for w in workers)
    assert waits >= 10


async def test_tpm_counts_prompt_tokens(redis):
    limiter = FleetLimiter(redis, Limits(tpm=6000))  # burst: 600 tokens
    assert await limiter.acquire(500) == 0
    wait = await limiter.acquire(500)
    assert wait > 0, "the second 500-token call would exceed the burst"
    assert await redis.get(names.LLM_RPM) is None, "no rpm limit, no rpm state"


async def test_no_limits_means_no_waiting(limiter):
    for _ in range(100):
        assert await limiter.acquire(10_000) == 0
    assert limiter.waits == 0


async def test_a_pause_set_elsewhere_is_seen_within_the_refresh_interval(redis):
    here = FleetLimiter(redis, Limits())
    assert await here.acquire(1) == 0  # this process has a fresh "not paused" view
    await FleetLimiter(redis, Limits()).pause(1.0)  # another worker saw a 429
    await asyncio.sleep(0.15)
    assert await here.acquire(1) > 0.5
