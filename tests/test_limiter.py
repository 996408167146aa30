"""Fleet-wide back-pressure through Redis: a 429 seen by one worker slows
every worker, and RPM/TPM limits pace calls across processes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

import pytest
from prometheus_client import REGISTRY

from oncely import names
from oncely.bootstrap import make_redis
from oncely.errors import TransientError
from oncely.llm.base import Background, Completion, Message, ResponseSchema
from oncely.llm.limiter import FleetLimiter, LimitedLLM, Limits, estimate_tokens
from oncely.redis_client import RedisClient
from tests.processes import free_port


def ask(prompt: str) -> list[Message]:
    return [Message("user", prompt)]


class RecordingLLM:
    """An in-process model: records when each call arrived; can answer 429
    (as adapters translate it) and report a token usage."""

    def __init__(
        self,
        calls: list[float],
        fail_first_with_429: float | None = None,
        used: tuple[int, int] = (0, 0),
    ) -> None:
        self.calls = calls
        self.fail_first_with_429 = fail_first_with_429
        self.used = used
        self.schemas: list[ResponseSchema | None] = []

    async def complete(
        self,
        messages: Sequence[Message],
        timeout: float,  # noqa: ASYNC109
        *,
        schema: ResponseSchema | None = None,
        background: Background | None = None,
    ) -> Completion:
        self.calls.append(time.monotonic())
        self.schemas.append(schema)
        if self.fail_first_with_429 is not None:
            retry_after, self.fail_first_with_429 = self.fail_first_with_429, None
            raise TransientError("model answered 429", status=429, retry_after_s=retry_after)
        return Completion("ok", *self.used)


async def redis_now_ms(redis) -> float:
    seconds, micros = await redis.time()
    return seconds * 1000 + micros // 1000


async def tpm_backlog_ms(redis) -> float:
    """How far the TPM state runs ahead of now (0: no state)."""
    tat = await redis.get(names.LLM_TPM)
    return 0.0 if tat is None else float(tat) - await redis_now_ms(redis)


@pytest.fixture
def limiter(redis) -> FleetLimiter:
    return FleetLimiter(redis, Limits())


async def test_a_429_seen_by_one_worker_pauses_every_worker(redis, limiter):
    calls_a: list[float] = []
    calls_b: list[float] = []
    worker_a = LimitedLLM(RecordingLLM(calls_a, fail_first_with_429=0.4), limiter)
    worker_b = LimitedLLM(RecordingLLM(calls_b), FleetLimiter(redis, Limits()))
    with pytest.raises(TransientError):
        await worker_a.complete(ask("prompt a"), timeout=5)
    failed_at = time.monotonic()
    assert 0 < await redis.pttl(names.LLM_PAUSE) <= 400
    assert (await worker_b.complete(ask("prompt b"), timeout=5)).text == "ok"
    assert calls_b[0] - failed_at >= 0.3, "worker B waited out worker A's Retry-After"


async def test_a_pause_longer_than_the_attempt_becomes_a_retry_after(redis, limiter):
    await limiter.pause(2.0)
    calls: list[float] = []
    worker = LimitedLLM(RecordingLLM(calls), FleetLimiter(redis, Limits()))
    with pytest.raises(TransientError) as raised:
        await worker.complete(ask("prompt"), timeout=0.5)
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
    await asyncio.gather(
        *(w.complete(ask(f"p{i}"), timeout=10) for i, w in enumerate(workers * 35))
    )
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


async def test_a_transient_error_without_429_does_not_pause(redis, limiter):
    class Unavailable(RecordingLLM):
        async def complete(self, messages, timeout, *, schema=None):  # noqa: ASYNC109
            raise TransientError("model answered 503", status=503, retry_after_s=5)

    with pytest.raises(TransientError):
        await LimitedLLM(Unavailable([]), limiter).complete(ask("p"), timeout=5)
    assert await redis.pttl(names.LLM_PAUSE) == -2
    assert limiter.pauses == 0


def test_token_estimate_counts_every_message_and_an_output_allowance():
    messages = [Message("system", "s" * 400), Message("user", "u" * 800)]
    assert estimate_tokens(messages) == 300 + 256
    assert estimate_tokens(messages, max_output=0) == 300


async def test_the_schema_is_passed_through(limiter):
    model = RecordingLLM([])
    schema = ResponseSchema("Answer", {"type": "object"})
    await LimitedLLM(model, limiter).complete(ask("p"), timeout=5, schema=schema)
    assert model.schemas == [schema]


async def test_reported_usage_below_the_estimate_gives_tokens_back(redis):
    """60000 tpm: 1 ms of state a token. A 1256-token reservation (1000 by
    size, 256 for the answer) that used 100 moves the state back by 1156."""
    limiter = FleetLimiter(redis, Limits(tpm=60_000))
    prompt = ask("x" * 4000)
    assert estimate_tokens(prompt) == 1256
    assert await limiter.acquire(400) == 0  # earlier traffic: 400 ms of state
    await LimitedLLM(RecordingLLM([], used=(60, 40)), limiter).complete(prompt, timeout=5)
    assert 450 <= await tpm_backlog_ms(redis) <= 500


async def test_reported_usage_above_the_estimate_costs_the_difference(redis):
    limiter = FleetLimiter(redis, Limits(tpm=60_000))  # burst: 6000 tokens
    prompt = ask("x" * 400)  # estimate: 100 + 256
    await LimitedLLM(RecordingLLM([], used=(3000, 2000)), limiter).complete(prompt, timeout=5)
    assert 4950 <= await tpm_backlog_ms(redis) <= 5000
    assert await limiter.acquire(1200) > 0, "the real usage, not the estimate, filled the burst"


async def test_the_correction_never_moves_the_state_below_now(redis):
    limiter = FleetLimiter(redis, Limits(tpm=60_000))
    assert await limiter.acquire(300) == 0
    await limiter.settle(reserved=5000, used=1)
    assert await redis.get(names.LLM_TPM) is None
    assert await limiter.acquire(6000) == 0, "the whole burst is available again"


async def test_no_reported_usage_keeps_the_estimate(redis):
    limiter = FleetLimiter(redis, Limits(tpm=60_000))
    await LimitedLLM(RecordingLLM([]), limiter).complete(ask("x" * 400), timeout=5)
    assert 306 <= await tpm_backlog_ms(redis) <= 356


async def test_without_a_tpm_limit_usage_writes_no_state(redis):
    limiter = FleetLimiter(redis, Limits(rpm=600))
    await LimitedLLM(RecordingLLM([], used=(5000, 5000)), limiter).complete(ask("p"), timeout=5)
    await limiter.settle(reserved=10, used=10_000)
    assert await redis.get(names.LLM_TPM) is None
    assert await redis.get(names.LLM_RPM) is not None


async def test_a_call_bigger_than_the_burst_goes_when_nothing_is_owed(redis):
    """It would otherwise wait forever; later calls pay for it instead."""
    limiter = FleetLimiter(redis, Limits(tpm=6000))  # burst: 600 tokens, 10 ms a token
    assert await limiter.acquire(2000) == 0
    wait = await limiter.acquire(10)
    assert 10 < wait <= 20.1, "the next call waits out the big one's debt"


async def test_a_call_reports_how_long_it_waited_on_the_limiter(redis, limiter):
    """So the model time in ``usage`` leaves limiter waits out."""
    await limiter.pause(0.3)
    completion = await LimitedLLM(RecordingLLM([]), limiter).complete(ask("x"), timeout=5)
    assert completion.queued_s >= 0.2
    unpaused = await LimitedLLM(RecordingLLM([]), limiter).complete(ask("y"), timeout=5)
    assert unpaused.queued_s < 0.2


@pytest.fixture
async def unreachable() -> AsyncIterator[RedisClient]:
    """A real client of a Redis node that is gone (nothing listens there)."""
    client = make_redis(f"redis://127.0.0.1:{free_port()}/0")
    yield client
    await client.aclose()


async def test_a_limiter_whose_redis_is_gone_fails_open_to_the_local_limit(unreachable):
    """No model call fails, or stalls, for the limiter's node: this process
    paces itself at the configured limits (a burst of 6 at 60 rpm, then one a
    second) and counts it."""
    before = metric("oncely_limiter_fail_open_total")
    limiter = FleetLimiter(unreachable, Limits(rpm=60))
    waits = [await limiter.acquire(10) for _ in range(7)]
    assert waits[:6] == [0.0] * 6
    assert 0 < waits[6] <= 1.0
    assert metric("oncely_limiter_fail_open_total") - before == 7

    # Without pacing: calls go, and a 429 still pauses this process.
    calls: list[float] = []
    llm = LimitedLLM(
        RecordingLLM(calls, fail_first_with_429=5.0), FleetLimiter(unreachable, Limits())
    )
    with pytest.raises(TransientError):
        await llm.complete(ask("p"), timeout=10)
    assert await llm.limiter.acquire(10) > 4


def metric(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


async def test_re_attaching_to_a_background_response_is_not_paced_again(redis) -> None:
    """It was paced and counted when it was created: after a crash, the
    delivery that re-attaches asks the provider for nothing new."""
    calls: list[float] = []
    limiter = FleetLimiter(redis, Limits(rpm=60))
    await limiter.pause(30)  # the fleet paused: a new call would wait
    llm = LimitedLLM(RecordingLLM(calls), limiter)

    async def keep(response_id: str) -> None:
        return None

    stored = Background(stored="resp_1", keep=keep)
    await llm.complete(ask("p"), timeout=2, background=stored)
    assert len(calls) == 1, "went at once"
    with pytest.raises(TransientError):  # a new call waits out the pause: longer than its time
        await llm.complete(ask("q"), timeout=2, background=Background(stored=None, keep=keep))
