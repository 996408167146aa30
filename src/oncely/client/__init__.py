"""A client for oncely's HTTP API that keeps the idempotency contract for you.

``Client`` (blocking) and ``AsyncClient`` (asyncio), both on httpx::

    with Client("https://oncely.example", api_key) as oncely:
        accepted = oncely.submit("/v1/triage", {"subject": ..., "body": ...})
        job = oncely.wait("/v1/triage", accepted.job_id, timeout_s=60, result_type=Triage)

- ``submit`` makes an idempotency key unless given one and sends that key on
  every retry, so a request the server accepted before the connection broke
  is accepted once. It retries connection errors, timeouts, 408, 409, 429
  and 5xx with full-jitter backoff, never sooner than ``Retry-After``, until
  ``deadline_s``; anything else raises at once.
- ``get`` reads a job; ``wait`` reads it until it is done, dead or
  cancelled (or, ``until_waiting=True``, until it waits for an event).
- ``send_event`` sends a waiting job its event with the same key contract as
  ``submit``; ``cancel`` cancels a job.
- ``stream`` follows a job live (``StreamEvent``s until ``end``), opening
  a dropped stream again after the last event seen.
- Errors are typed from the problem+json ``type``; each carries ``status``,
  ``type``, ``title``, ``detail`` and, from ``submit``, the idempotency key.
  The API key is never logged or put in a message.

The policy is written once, without I/O (``calls``, ``policy``); the two
clients only perform its steps.
"""

import warnings

from oncely.client.aio import AsyncClient
from oncely.client.errors import (
    BadRequest,
    EventAlreadyReceived,
    GaveUp,
    JobFinished,
    KeyReused,
    NotFound,
    OncelyClientError,
    PayloadTooLarge,
    Unauthorized,
    Unavailable,
    UnexpectedResponse,
    ValidationFailed,
    WaitTimedOut,
)
from oncely.client.jobs import (
    Accepted,
    Cancelled,
    Decision,
    EventReceived,
    Job,
    JobStep,
    JobUsage,
    PendingApproval,
    StreamEvent,
    Waiting,
    WaitingChildren,
)
from oncely.client.policy import Backoff, retry_delay_s
from oncely.client.sync import Client

# The names of ``GaveUp`` and ``JobUsage`` before 0.2: they still import, with
# a DeprecationWarning, because ``oncely`` has its own ``DeadlineExceeded``
# (a step's deadline) and ``Usage`` (a model's usage inside a step).
_OLD_NAMES = {"DeadlineExceeded": ("GaveUp", GaveUp), "Usage": ("JobUsage", JobUsage)}


def __getattr__(name: str) -> object:
    if name in _OLD_NAMES:
        new, value = _OLD_NAMES[name]
        warnings.warn(
            f"oncely.client.{name} is now oncely.client.{new}; the old name goes in 1.0",
            DeprecationWarning,
            stacklevel=2,
        )
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Accepted",
    "AsyncClient",
    "Backoff",
    "BadRequest",
    "Cancelled",
    "Client",
    "Decision",
    "EventAlreadyReceived",
    "EventReceived",
    "GaveUp",
    "Job",
    "JobFinished",
    "JobStep",
    "JobUsage",
    "KeyReused",
    "NotFound",
    "OncelyClientError",
    "PayloadTooLarge",
    "PendingApproval",
    "StreamEvent",
    "Unauthorized",
    "Unavailable",
    "UnexpectedResponse",
    "ValidationFailed",
    "WaitTimedOut",
    "Waiting",
    "WaitingChildren",
    "retry_delay_s",
]
