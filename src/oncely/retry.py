"""Classified in-process retries under a deadline (docs/guarantees.md).

The only module that imports tenacity, and a generic one: it knows no SDK
and no workflow. Adapters translate their client's errors into oncely's
(``TransientError`` with ``status`` and ``retry_after_s``, ``PermanentError``)
where they enter; callers that count calls or retries do it in their own
attempt function and ``on_retry`` (``oncely.llm.model.Model`` does). One
layer owns the retry policy: the SDK's own retries are off, and the worker
redelivers what this gives up on.

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
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Generic, NoReturn, TypeVar

import structlog
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_random_exponential

from oncely.errors import DeadlineExceeded, PermanentError, TransientError

T = TypeVar("T")

log = structlog.get_logger(__name__)

_RETRYABLE_STATUSES = frozenset({408, 409, 429})
# An attempt with less than this share of the per-call timeout left is unlikely
# to finish a call that the operator sized the timeout for; don't pay for it.
_USEFUL_ATTEMPT_SHARE = 0.25


@dataclass(frozen=True)
class RetryPolicy:
    """How hard one call is tried, always within the delivery's ``Deadline``.

    - ``per_call_timeout_s``: wall-clock limit of one attempt (shorter when
      the deadline leaves less); a server dripping bytes is cut off too.
    - ``max_attempts``: attempts in all, the first included (1: no retry).
    - ``backoff_base_s`` / ``backoff_max_s``: full-jitter exponential backoff,
      retry n sleeps uniformly in [0, min(max, base × 2**(n-1))].
    - ``retry_after_max_s``: a provider's ``Retry-After`` replaces the backoff;
      this only bounds a bogus one.
    """

    per_call_timeout_s: float = 20.0
    max_attempts: int = 4
    backoff_base_s: float = 0.5
    backoff_max_s: float = 10.0
    retry_after_max_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if self.per_call_timeout_s <= 0:
            raise ValueError("per_call_timeout_s must be positive")


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
    """The HTTP status an error carries, on itself or on its ``.response``:
    oncely's errors (``.status``) and most clients' (``.status_code``) fit."""
    for holder in (exc, getattr(exc, "response", None)):
        for attr in ("status_code", "status"):
            value = getattr(holder, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def retryable_status(status: int) -> bool:
    """408, 409, 429 and every 5xx can succeed later; other statuses never will."""
    return status in _RETRYABLE_STATUSES or status >= 500


def classify(exc: BaseException) -> bool:
    """True if ``exc`` may succeed on a later attempt."""
    if isinstance(exc, DeadlineExceeded | PermanentError):
        return False
    # TimeoutError: asyncio.timeout around each attempt. OSError covers
    # ConnectionError and the socket errors an unwrapped client lets through.
    if isinstance(exc, TransientError | TimeoutError | OSError):
        return True
    status = status_of(exc)
    return status is not None and retryable_status(status)


def retry_reason(exc: BaseException) -> str:
    """A short, bounded label for metrics and logs: "429", "5xx", "timeout", ..."""
    if isinstance(exc, TimeoutError):
        return "timeout"
    status = status_of(exc)
    if status is not None:
        return "5xx" if status >= 500 else str(status)
    if isinstance(exc, TransientError):
        return "transient"
    return "connection" if isinstance(exc, OSError) else "other"


def retry_after_s(exc: BaseException) -> float | None:
    """The wait the provider asked for: a ``TransientError``'s own, else read
    from the ``retry-after-ms`` / ``Retry-After`` headers the error carries."""
    if isinstance(exc, TransientError):
        return exc.retry_after_s
    headers = _headers_of(exc)
    return retry_after_from_headers(headers) if headers else None


def retry_after_from_headers(headers: Mapping[str, str]) -> float | None:
    """``retry-after-ms`` (OpenAI's) wins over ``Retry-After`` (seconds or an
    HTTP-date, RFC 9110 §10.2.3); header names in any case."""
    lowered = {str(key).lower(): str(value) for key, value in headers.items()}
    millis = _finite(lowered.get("retry-after-ms"))
    if millis is not None:
        return max(0.0, millis / 1000)
    value = lowered.get("retry-after")
    return None if value is None else _parse_retry_after(value)


def _headers_of(exc: BaseException) -> Mapping[str, str]:
    """Response headers on the error or its ``.response`` (httpx, aiohttp, dicts)."""
    response = getattr(exc, "response", None)
    headers = getattr(response, "headers", None) or getattr(exc, "headers", None)
    return headers if isinstance(headers, Mapping) else {}


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
    policy: RetryPolicy,
    deadline: Deadline,
    on_retry: Callable[[RetryEvent], Awaitable[None]] | None = None,
    min_attempt_s: float | None = None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    what: str = "model",
) -> T:
    """Call ``fn(attempt_timeout)`` until it succeeds, fails permanently or time is up.

    Raises the permanent error at once, the last transient error after
    ``policy.max_attempts``, and ``DeadlineExceeded`` (chained from the last
    error) when the next sleep would leave less than ``min_attempt_s``
    (default: a quarter of the per-call timeout) before the deadline.
    ``on_retry`` hears every retry before its sleep. ``sleep`` is injectable
    so tests can observe backoff without waiting for it. ``what`` names what
    is retried in the log (``<what>.retrying``: ``model``, ``step``,
    ``mcp``).
    """
    loop = _RetryLoop(
        fn=fn,
        deadline=deadline,
        policy=policy,
        useful_s=policy.per_call_timeout_s * _USEFUL_ATTEMPT_SHARE
        if min_attempt_s is None
        else min_attempt_s,
        jitter=wait_random_exponential(multiplier=policy.backoff_base_s, max=policy.backoff_max_s),
        on_retry=on_retry,
        what=what,
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
    policy: RetryPolicy
    useful_s: float
    jitter: wait_random_exponential
    on_retry: Callable[[RetryEvent], Awaitable[None]] | None
    what: str = "model"

    async def attempt(self) -> T:
        timeout_s = min(self.policy.per_call_timeout_s, self.deadline.remaining())
        return await _timed_attempt(self.fn, timeout_s)

    def wait(self, state: RetryCallState) -> float:
        hinted = retry_after_s(_last_error(state))
        return self.jitter(state) if hinted is None else min(hinted, self.policy.retry_after_max_s)

    def stop(self, state: RetryCallState) -> bool:
        if state.attempt_number >= self.policy.max_attempts:
            return True
        # Sleeping into a deadline that then cuts the attempt short costs a paid
        # call for nothing; hand the job back for redelivery with a fresh budget.
        return self.deadline.remaining() - state.upcoming_sleep < self.useful_s

    def give_up(self, state: RetryCallState) -> NoReturn:
        error = _last_error(state)
        if state.attempt_number < self.policy.max_attempts:
            raise DeadlineExceeded(
                f"deadline leaves no room for attempt {state.attempt_number + 1}"
            ) from error
        raise error

    async def before_sleep(self, state: RetryCallState) -> None:
        error = _last_error(state)
        event = RetryEvent(state.attempt_number, retry_reason(error), state.upcoming_sleep, error)
        log.info(
            f"{self.what}.retrying",
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
    async with asyncio.timeout(timeout_s):
        return await fn(timeout_s)


def _last_error(state: RetryCallState) -> BaseException:
    error = state.outcome.exception() if state.outcome is not None else None
    if error is None:  # tenacity only waits, stops and sleeps after a failure
        raise RuntimeError("retry state without a failed attempt")
    return error


def backoff_s(
    attempts: int, base_s: float, max_s: float, rand: Callable[[], float] = random.random
) -> float:
    """Full jitter: uniform in [0, min(max_s, base_s * 2**(attempts - 1))].

    The one backoff between tries that are not in-process retries: the
    relay's resends and the worker's redeliveries. Full rather than equal
    jitter so work that failed together (a provider outage) comes back spread
    out instead of in one burst.
    """
    return _backoff_cap(attempts, base_s, max_s) * rand()


def resume_s(
    wait_s: float,
    attempts: int,
    base_s: float,
    max_s: float,
    rand: Callable[[], float] = random.random,
) -> float:
    """When work that waits for something with a known end (a model's
    cooldown, ``wait_s`` from now) is tried again: at that end, spread by up
    to a tenth of the wait (at least half a second) so that what waited
    together does not come back in one burst, and never later than the
    backoff of attempt ``attempts`` could have drawn (``backoff_s``)."""
    spread = max(0.5, wait_s / 10) * rand()
    return min(wait_s + spread, _backoff_cap(attempts, base_s, max_s))


def _backoff_cap(attempts: int, base_s: float, max_s: float) -> float:
    exponent = min(max(attempts - 1, 0), 32)  # past the cap anyway; avoids float overflow
    return min(max_s, base_s * 2.0**exponent)
