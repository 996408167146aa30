"""Classified in-process retries under a deadline (DESIGN §4).

The only module that imports tenacity. One layer owns the retry policy: the
SDK's own retries are off, and the worker redelivers what this gives up on.

- ``classify`` says whether an error can succeed later. Unknown errors are
  permanent: retrying a bug only burns money and time.
- ``call_with_retries`` runs every attempt under a wall-clock timeout, sleeps
  with full-jitter exponential backoff (a provider's ``Retry-After`` wins,
  capped) and stops early rather than start an attempt the deadline would cut.
"""

from __future__ import annotations

import asyncio
import email.utils
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Generic, NoReturn, TypeVar

import aiohttp
import httpx
import openai
import structlog
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_random_exponential

from oncely.errors import DeadlineExceeded, PermanentError, TransientError
from oncely.metrics import MODEL_CALLS, MODEL_RETRIES

T = TypeVar("T")

log = structlog.get_logger(__name__)

# Bound once: a labels() lookup per model call shows up in profiles.
_CALLS_OK = MODEL_CALLS.labels(outcome="ok")
_CALLS_TRANSIENT = MODEL_CALLS.labels(outcome="transient")
_CALLS_PERMANENT = MODEL_CALLS.labels(outcome="permanent")

_RETRYABLE_STATUSES = frozenset({408, 409, 429})
_TIMEOUTS: tuple[type[BaseException], ...] = (
    TimeoutError,  # asyncio.timeout around each attempt; aiohttp.ServerTimeoutError too
    openai.APITimeoutError,
    httpx.TimeoutException,
)
# ClientPayloadError is a connection that died mid-body: as retryable as one that
# never opened. The openai SDK wraps its transport errors in APIConnectionError.
_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    aiohttp.ClientConnectionError,
    aiohttp.ClientPayloadError,
    httpx.TransportError,
    openai.APIConnectionError,
)
# An attempt with less than this share of the per-call timeout left is unlikely
# to finish a call that the operator sized the timeout for; don't pay for it.
_USEFUL_ATTEMPT_SHARE = 0.25


@dataclass(frozen=True)
class Deadline:
    """A delivery's budget on the monotonic clock (wall-clock jumps can't move it)."""

    expires_at: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + seconds)

    def remaining(self) -> float:
        return max(0.0, self.expires_at - time.monotonic())

    @property
    def expired(self) -> bool:
        return self.remaining() <= 0.0


@dataclass(frozen=True)
class RetryEvent:
    """What ``on_retry`` hears before each backoff sleep."""

    attempt: int
    reason: str
    sleep_s: float
    error: BaseException


def status_of(exc: BaseException) -> int | None:
    """The HTTP status an error carries, on itself or on its ``.response``."""
    for holder in (exc, getattr(exc, "response", None)):
        for attr in ("status_code", "status"):
            value = getattr(holder, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def classify(exc: BaseException) -> bool:
    """True if ``exc`` may succeed on a later attempt."""
    if isinstance(exc, DeadlineExceeded | PermanentError):
        return False
    if isinstance(exc, (TransientError, *_TIMEOUTS, *_CONNECTION_ERRORS)):
        return True
    status = status_of(exc)
    return status is not None and (status in _RETRYABLE_STATUSES or status >= 500)


def retry_reason(exc: BaseException) -> str:
    """A short, bounded label for metrics and logs: "429", "5xx", "timeout", ..."""
    if isinstance(exc, TransientError):
        return "transient"
    if isinstance(exc, _TIMEOUTS):
        return "timeout"
    status = status_of(exc)
    if status is None:
        return "connection" if isinstance(exc, _CONNECTION_ERRORS) else "other"
    return "5xx" if status >= 500 else str(status)


def retry_after_s(exc: BaseException) -> float | None:
    """The provider's requested wait, from ``retry-after-ms`` or ``Retry-After``."""
    if isinstance(exc, TransientError):
        return exc.retry_after_s
    headers = _headers_of(exc)
    if not headers:
        return None
    millis = _finite(headers.get("retry-after-ms"))
    if millis is not None:
        return max(0.0, millis / 1000)
    value = headers.get("retry-after")
    return None if value is None else _parse_retry_after(value)


def _headers_of(exc: BaseException) -> dict[str, str]:
    """Response headers, lower-cased: httpx, aiohttp and plain dicts all fit."""
    response = getattr(exc, "response", None)
    headers = getattr(response, "headers", None) or getattr(exc, "headers", None)
    if not isinstance(headers, Mapping):
        return {}
    return {str(key).lower(): str(value) for key, value in headers.items()}


def _finite(value: str | None) -> float | None:
    try:
        number = float(value) if value is not None else None
    except ValueError:
        return None
    return number if number is not None and math.isfinite(number) else None


def _parse_retry_after(value: str) -> float | None:
    """Delay-seconds or an HTTP-date (RFC 9110 §10.2.3)."""
    seconds = _finite(value)
    if seconds is not None:
        return max(0.0, seconds)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - datetime.now(UTC)).total_seconds())


async def call_with_retries(
    fn: Callable[[float], Awaitable[T]],
    *,
    deadline: Deadline,
    per_call_timeout_s: float,
    max_attempts: int,
    backoff_base_s: float,
    backoff_max_s: float,
    retry_after_max_s: float,
    on_retry: Callable[[RetryEvent], Awaitable[None]] | None = None,
    min_attempt_s: float | None = None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> T:
    """Call ``fn(attempt_timeout)`` until it succeeds, fails permanently or time is up.

    Raises the permanent error at once, the last transient error after
    ``max_attempts``, and ``DeadlineExceeded`` (chained from the last error)
    when the next sleep would leave less than ``min_attempt_s`` (default: a
    quarter of the per-call timeout) before the deadline. ``sleep`` is
    injectable so tests can observe backoff without waiting for it.
    """
    if max_attempts < 1:
        raise ValueError("max_attempts must be at least 1")
    loop = _RetryLoop(
        fn=fn,
        deadline=deadline,
        per_call_timeout_s=per_call_timeout_s,
        max_attempts=max_attempts,
        retry_after_max_s=retry_after_max_s,
        useful_s=per_call_timeout_s * _USEFUL_ATTEMPT_SHARE
        if min_attempt_s is None
        else min_attempt_s,
        jitter=wait_random_exponential(multiplier=backoff_base_s, max=backoff_max_s),
        on_retry=on_retry,
    )
    # The common case (success on the first call) pays for no retry machinery.
    try:
        return await loop.attempt()
    except Exception as exc:
        if not classify(exc):
            raise
        first_failure = exc
    retrying = AsyncRetrying(
        sleep=sleep,
        stop=loop.stop,
        wait=loop.wait,
        retry=retry_if_exception(classify),
        before_sleep=loop.before_sleep,
        retry_error_callback=loop.give_up,
    )
    result: T = await retrying(_replaying_first(first_failure, loop.attempt))
    return result


def _replaying_first(
    failure: Exception, attempt: Callable[[], Awaitable[T]]
) -> Callable[[], Awaitable[T]]:
    """tenacity's attempts, the first of which already happened and failed:
    it is replayed (not called again), so numbering, waits and stops are
    exactly as if tenacity had made it."""
    replayed = False

    async def attempts() -> T:
        nonlocal replayed
        if not replayed:
            replayed = True
            raise failure
        return await attempt()

    return attempts


@dataclass(frozen=True)
class _RetryLoop(Generic[T]):
    """The policy of one ``call_with_retries``, as the hooks tenacity calls."""

    fn: Callable[[float], Awaitable[T]]
    deadline: Deadline
    per_call_timeout_s: float
    max_attempts: int
    retry_after_max_s: float
    useful_s: float
    jitter: wait_random_exponential
    on_retry: Callable[[RetryEvent], Awaitable[None]] | None

    async def attempt(self) -> T:
        timeout_s = min(self.per_call_timeout_s, self.deadline.remaining())
        return await _timed_attempt(self.fn, timeout_s)

    def wait(self, state: RetryCallState) -> float:
        hinted = retry_after_s(_last_error(state))
        return self.jitter(state) if hinted is None else min(hinted, self.retry_after_max_s)

    def stop(self, state: RetryCallState) -> bool:
        if state.attempt_number >= self.max_attempts:
            return True
        # Sleeping into a deadline that then cuts the attempt short costs a paid
        # call for nothing; hand the job back for redelivery with a fresh budget.
        return self.deadline.remaining() - state.upcoming_sleep < self.useful_s

    def give_up(self, state: RetryCallState) -> NoReturn:
        error = _last_error(state)
        if state.attempt_number < self.max_attempts:
            raise DeadlineExceeded(
                f"deadline leaves no room for attempt {state.attempt_number + 1}"
            ) from error
        raise error

    async def before_sleep(self, state: RetryCallState) -> None:
        error = _last_error(state)
        event = RetryEvent(state.attempt_number, retry_reason(error), state.upcoming_sleep, error)
        MODEL_RETRIES.labels(reason=event.reason).inc()
        log.info(
            "model.retrying",
            attempt=event.attempt,
            reason=event.reason,
            sleep_s=round(event.sleep_s, 3),
        )
        if self.on_retry is not None:
            await self.on_retry(event)


async def _timed_attempt(fn: Callable[[float], Awaitable[T]], timeout_s: float) -> T:
    """One call under a wall-clock timeout: a server dripping bytes is cut off too."""
    if timeout_s <= 0:
        raise DeadlineExceeded("deadline expired before the call")
    try:
        async with asyncio.timeout(timeout_s):
            result = await fn(timeout_s)
    except Exception as exc:
        (_CALLS_TRANSIENT if classify(exc) else _CALLS_PERMANENT).inc()
        raise
    _CALLS_OK.inc()
    return result


def _last_error(state: RetryCallState) -> BaseException:
    error = state.outcome.exception() if state.outcome is not None else None
    if error is None:  # tenacity only waits, stops and sleeps after a failure
        raise RuntimeError("retry state without a failed attempt")
    return error
