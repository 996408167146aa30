"""Unit tests of the retry policy: classification, Retry-After, deadlines, backoff.

Backoff sleeps are recorded by an injected ``sleep`` instead of waited for, so
these run in milliseconds; only the hanging-call test uses the real clock.
"""

from __future__ import annotations

import ast
import asyncio
import email.utils
import inspect
import random
import time
from dataclasses import FrozenInstanceError
from typing import Any

import aiohttp
import httpx
import pytest
from structlog.testing import capture_logs

from oncely import retry
from oncely.errors import DeadlineExceeded, PermanentError, TransientError
from oncely.retry import (
    Deadline,
    RetryEvent,
    RetryPolicy,
    call_with_retries,
    classify,
    retry_after_s,
    retry_reason,
)


class StatusError(Exception):
    """Some client library's HTTP error: it only exposes a status."""

    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


class Flaky:
    """Raises the given errors in order, then answers "ok"; records every call."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.timeouts: list[float] = []

    @property
    def calls(self) -> int:
        return len(self.timeouts)

    async def __call__(self, timeout_s: float) -> str:
        self.timeouts.append(timeout_s)
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


class RecordedSleep:
    def __init__(self) -> None:
        self.slept: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.slept.append(seconds)


def policy(deadline: Deadline | None = None, **overrides: Any) -> dict[str, Any]:
    """``call_with_retries`` keywords: a test policy, fields overridden by name."""
    fields: dict[str, Any] = {
        "per_call_timeout_s": 1.0,
        "max_attempts": 4,
        "backoff_base_s": 0.1,
        "backoff_max_s": 1.0,
        "retry_after_max_s": 5.0,
    }
    return {
        "policy": RetryPolicy(**(fields | overrides)),
        "deadline": deadline or Deadline.after(30),
    }


def http_error(status: int, headers: dict[str, str]) -> httpx.HTTPStatusError:
    request = httpx.Request("POST", "http://model.test/v1/chat/completions")
    response = httpx.Response(status, headers=headers, request=request)
    return httpx.HTTPStatusError("error", request=request, response=response)


def test_deadline_counts_down_on_the_monotonic_clock() -> None:
    deadline = Deadline.after(0.5)
    assert 0.4 < deadline.remaining() <= 0.5
    assert not deadline.expired
    assert Deadline.after(0).expired
    assert Deadline.after(-1).remaining() == 0.0


def test_deadline_exceeded_is_not_a_timeout_and_is_never_retried() -> None:
    assert not isinstance(DeadlineExceeded("out of budget"), TimeoutError)
    assert classify(DeadlineExceeded("out of budget")) is False


RETRYABLE = [
    TransientError("later"),
    TransientError("rate limited", status=429),
    TimeoutError(),
    ConnectionResetError(),
    OSError("network unreachable"),
    aiohttp.ClientOSError(),  # an OSError
    aiohttp.ServerTimeoutError(),  # a TimeoutError
    StatusError(408),
    StatusError(409),
    StatusError(429),
    StatusError(500),
    StatusError(503),
    http_error(502, {}),
]
PERMANENT = [
    PermanentError("never"),
    PermanentError("bad request", status=400),
    PermanentError("even with a retryable status", status=503),
    ValueError("bug"),
    KeyError("bug"),
    RuntimeError("unknown"),
    StatusError(400),
    StatusError(401),
    StatusError(404),
    StatusError(422),
    http_error(400, {}),
]


@pytest.mark.parametrize(
    ("error", "retryable"),
    [(e, True) for e in RETRYABLE] + [(e, False) for e in PERMANENT],
    ids=repr,
)
def test_retryable_errors_are_classified_retryable_and_everything_else_permanent(
    error: BaseException, retryable: bool
) -> None:
    assert classify(error) is retryable


def test_retry_reasons_are_bounded_labels() -> None:
    assert retry_reason(StatusError(429)) == "429"
    assert retry_reason(StatusError(503)) == "5xx"
    assert retry_reason(TimeoutError()) == "timeout"
    assert retry_reason(ConnectionResetError()) == "connection"
    assert retry_reason(TransientError("x")) == "transient"
    assert retry_reason(TransientError("x", status=429)) == "429"
    assert retry_reason(TransientError("x", status=502)) == "5xx"


def test_retry_imports_no_sdk_and_no_metrics() -> None:
    """SDK errors are translated by adapters; callers count their own calls."""
    tree = ast.parse(inspect.getsource(retry))
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    roots = {name.split(".")[0] for name in imported}
    assert not roots & {"openai", "httpx", "httpx2", "aiohttp"}
    assert "oncely.metrics" not in imported


def test_retry_policy_defaults_and_validation() -> None:
    assert RetryPolicy() == RetryPolicy(
        per_call_timeout_s=20.0,
        max_attempts=4,
        backoff_base_s=0.5,
        backoff_max_s=10.0,
        retry_after_max_s=30.0,
    )
    with pytest.raises(FrozenInstanceError):
        RetryPolicy().max_attempts = 9  # type: ignore[misc]
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(max_attempts=0)


def test_retry_after_is_read_from_headers_and_transient_errors() -> None:
    assert retry_after_s(TransientError("x", retry_after_s=3.0)) == 3.0
    assert retry_after_s(TransientError("x", status=503)) is None
    assert retry_after_s(http_error(429, {"Retry-After": "2"})) == 2.0
    both = {"retry-after-ms": "1500", "Retry-After": "9"}
    assert retry_after_s(http_error(429, both)) == 1.5
    assert retry_after_s(http_error(429, {"Retry-After": "soon"})) is None
    assert retry_after_s(http_error(503, {})) is None
    assert retry_after_s(ValueError("no response")) is None


def test_retry_after_accepts_an_http_date() -> None:
    future = email.utils.formatdate(time.time() + 30, usegmt=True)
    past = email.utils.formatdate(time.time() - 30, usegmt=True)
    assert 28 < (retry_after_s(http_error(429, {"Retry-After": future})) or 0) <= 30
    assert retry_after_s(http_error(429, {"Retry-After": past})) == 0.0


async def test_success_needs_no_retry() -> None:
    fn, sleep = Flaky(), RecordedSleep()
    assert await call_with_retries(fn, sleep=sleep, **policy()) == "ok"
    assert fn.calls == 1
    assert sleep.slept == []


async def test_permanent_error_is_raised_after_exactly_one_call() -> None:
    fn, sleep = Flaky(StatusError(400)), RecordedSleep()
    with pytest.raises(StatusError):
        await call_with_retries(fn, sleep=sleep, **policy())
    assert fn.calls == 1
    assert sleep.slept == []


async def test_transient_errors_are_retried_until_success() -> None:
    fn, sleep = Flaky(StatusError(503), TimeoutError()), RecordedSleep()
    assert await call_with_retries(fn, sleep=sleep, **policy()) == "ok"
    assert fn.calls == 3
    assert len(sleep.slept) == 2


async def test_last_transient_error_is_raised_after_max_attempts() -> None:
    fn = Flaky(*(TransientError(f"attempt {n}") for n in (1, 2, 3, 4)))
    with pytest.raises(TransientError, match="attempt 3"):
        await call_with_retries(fn, sleep=RecordedSleep(), **policy(max_attempts=3))
    assert fn.calls == 3


async def test_backoff_is_full_jitter_under_an_exponential_cap() -> None:
    random.seed(7)
    base, cap, retries = 0.1, 0.5, 5
    by_retry: list[list[float]] = [[] for _ in range(retries)]
    for _ in range(40):
        fn, sleep = Flaky(*(StatusError(503) for _ in range(retries))), RecordedSleep()
        options = policy(max_attempts=retries + 1, backoff_base_s=base, backoff_max_s=cap)
        await call_with_retries(fn, sleep=sleep, **options)
        for n, slept in enumerate(sleep.slept):
            by_retry[n].append(slept)
    for n, sleeps in enumerate(by_retry):
        ceiling = min(cap, base * 2**n)
        assert all(0 <= s <= ceiling for s in sleeps)
        # Full jitter spreads over the whole window rather than sitting at its top.
        assert min(sleeps) < ceiling * 0.25 and max(sleeps) > ceiling * 0.75


async def test_retry_after_wins_over_backoff_and_is_capped() -> None:
    fn = Flaky(http_error(429, {"Retry-After": "30"}), TransientError("x", retry_after_s=0.05))
    sleep = RecordedSleep()
    options = policy(backoff_base_s=10, backoff_max_s=10, retry_after_max_s=0.25)
    assert await call_with_retries(fn, sleep=sleep, **options) == "ok"
    assert sleep.slept == [0.25, 0.05]
    assert fn.calls == 3


async def test_stops_before_the_deadline_when_the_next_sleep_leaves_no_useful_attempt() -> None:
    hinted = TransientError("busy", retry_after_s=0.9)
    fn, sleep = Flaky(hinted), RecordedSleep()
    options = policy(deadline=Deadline.after(1.0), per_call_timeout_s=1.0)
    with pytest.raises(DeadlineExceeded) as raised:
        await call_with_retries(fn, sleep=sleep, **options)
    assert raised.value.__cause__ is hinted
    assert fn.calls == 1
    assert sleep.slept == []


async def test_expired_deadline_raises_without_calling() -> None:
    fn = Flaky()
    with pytest.raises(DeadlineExceeded):
        await call_with_retries(fn, sleep=RecordedSleep(), **policy(Deadline.after(0)))
    assert fn.calls == 0


async def test_attempt_timeout_is_the_smaller_of_per_call_timeout_and_remaining_budget() -> None:
    short_budget = Flaky()
    await call_with_retries(short_budget, **policy(Deadline.after(0.3)))
    long_budget = Flaky()
    await call_with_retries(long_budget, **policy(per_call_timeout_s=0.5))
    assert 0 < short_budget.timeouts[0] <= 0.3
    assert long_budget.timeouts == [0.5]


async def test_hanging_call_gives_up_before_the_deadline() -> None:
    calls = 0

    async def hang(timeout_s: float) -> str:
        nonlocal calls
        calls += 1
        await asyncio.Event().wait()
        return "never"

    options = policy(
        deadline=Deadline.after(0.5), per_call_timeout_s=0.2, max_attempts=10, backoff_base_s=0.01
    )
    with pytest.raises(DeadlineExceeded) as raised:
        await call_with_retries(hang, **options)
    # Ended by the deadline, not by running out of attempts: a hang would
    # have met the test's own timeout instead.
    assert isinstance(raised.value.__cause__, TimeoutError)
    assert 1 <= calls <= 3


async def test_cancellation_is_never_retried() -> None:
    calls = 0

    async def slow(timeout_s: float) -> str:
        nonlocal calls
        calls += 1
        await asyncio.sleep(10)
        return "late"

    task = asyncio.create_task(call_with_retries(slow, **policy()))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert calls == 1


async def test_each_retry_is_reported_and_logged_with_its_reason() -> None:
    events: list[RetryEvent] = []

    async def on_retry(event: RetryEvent) -> None:
        events.append(event)

    fn = Flaky(StatusError(429), StatusError(503), TransientError("x", status=429))
    with capture_logs() as logs:
        await call_with_retries(fn, sleep=RecordedSleep(), on_retry=on_retry, **policy())
    assert [(e.attempt, e.reason) for e in events] == [(1, "429"), (2, "5xx"), (3, "429")]
    retrying = [entry for entry in logs if entry["event"] == "model.retrying"]
    assert [(entry["attempt"], entry["reason"]) for entry in retrying] == [
        (1, "429"),
        (2, "5xx"),
        (3, "429"),
    ]


async def test_a_retry_names_what_it_retries() -> None:
    """A step's retries are logged as a step's, not a model call's."""
    fn = Flaky(StatusError(503))
    with capture_logs() as logs:
        await call_with_retries(fn, sleep=RecordedSleep(), what="step", **policy())
    assert [e["event"] for e in logs if e["event"].endswith(".retrying")] == ["step.retrying"]
