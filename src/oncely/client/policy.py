"""When the client tries again, and how long it waits first.

A try is worth repeating when it may succeed later: no answer (connection
error, timeout: the server may have accepted it, and the same idempotency
key makes repeating it safe) or 408, 409, 429 and 5xx. Anything else is
the answer. Waits are full-jitter exponential backoff
(``oncely.retry.backoff_s``, as the worker and relay use), never shorter
than a ``Retry-After`` the server sent, and never past the deadline.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from oncely.retry import backoff_s, retry_after_from_headers, retryable_status

# Transport failures after which the request may or may not have reached the
# server; a bad URL or an unsupported scheme is a mistake to raise, not retry.
RETRIED_TRANSPORT_ERRORS: tuple[type[httpx.TransportError], ...] = (
    httpx.TimeoutException,
    httpx.NetworkError,
    httpx.RemoteProtocolError,
    httpx.ProxyError,
)


@dataclass(frozen=True)
class Backoff:
    """Try n + 1 waits uniformly in [0, min(max_s, base_s × 2**(n-1))].

    ``base_s`` is also the least time worth a try: no wait ends within
    ``base_s`` of the deadline, and no try starts there.
    """

    base_s: float = 0.25
    max_s: float = 5.0


RETRY_BACKOFF = Backoff()
POLL_BACKOFF = Backoff(base_s=0.2, max_s=2.0)


@dataclass(frozen=True)
class Policy:
    """How one client calls the API.

    - ``timeout_s``: one try's limit (shorter when the deadline leaves less;
      the async client enforces it on the wall clock).
    - ``deadline_s``: everything ``submit`` or ``get`` does, retries and
      waits included; ``wait`` has its own ``timeout_s`` instead.
    - ``retry``: backoff between tries of one request; ``poll``: between
      reads of a job that is still queued.
    """

    timeout_s: float = 10.0
    # Outlives the server's idempotency lock (30 s): a submit that meets the
    # claim of a crashed API process still gets its answer.
    deadline_s: float = 60.0
    retry: Backoff = RETRY_BACKOFF
    poll: Backoff = POLL_BACKOFF
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    rand: Callable[[], float] = field(default=random.random, repr=False)

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.deadline_s <= 0:
            raise ValueError("timeout_s and deadline_s must be positive")


def retry_delay_s(
    attempt: int,
    *,
    remaining_s: float,
    backoff: Backoff,
    retry_after_s: float | None = None,
    rand: Callable[[], float] = random.random,
) -> float | None:
    """Seconds to wait after try ``attempt`` failed, or None to give up.

    Full jitter, raised to the server's ``Retry-After`` (a minimum, so a
    ``Retry-After: 0`` server still gets backoff rather than a tight loop),
    and cut short so the next try still has ``backoff.base_s`` before the
    deadline: that try is then the last. None when no wait allows one.
    """
    room_s = remaining_s - backoff.base_s  # waiting longer leaves the next try too little
    floor_s = retry_after_s or 0.0
    if room_s < 0 or floor_s > room_s:
        return None
    return min(room_s, max(floor_s, backoff_s(attempt, backoff.base_s, backoff.max_s, rand)))


# 409s that no retry changes: the job is finished, or the event came before.
FINAL_CONFLICTS = frozenset(
    {
        "https://oncely.dev/problems/job-finished",
        "https://oncely.dev/problems/event-already-received",
    }
)


def worth_retrying(outcome: httpx.Response | Exception) -> bool:
    """No answer, or an answer that can change: 408, 409 (a request with the
    key still running, not a finished job or an event already received), 429,
    5xx."""
    if isinstance(outcome, httpx.Response):
        if outcome.status_code == 409 and _problem_type(outcome) in FINAL_CONFLICTS:
            return False
        return retryable_status(outcome.status_code)
    return isinstance(outcome, RETRIED_TRANSPORT_ERRORS)


def _problem_type(response: httpx.Response) -> str | None:
    if not response.headers.get("content-type", "").startswith("application/problem+json"):
        return None
    try:
        body = response.json()
    except ValueError:
        return None
    return str(body.get("type")) if isinstance(body, dict) else None


def retry_after_of(outcome: httpx.Response | Exception) -> float | None:
    """The server's ``Retry-After`` (seconds or an HTTP-date), if it sent one."""
    if isinstance(outcome, httpx.Response):
        return retry_after_from_headers(outcome.headers)
    return None


def reason_of(outcome: httpx.Response | Exception) -> str:
    """A short label for logs: the status, or the exception's class."""
    if isinstance(outcome, httpx.Response):
        return str(outcome.status_code)
    return type(outcome).__name__
