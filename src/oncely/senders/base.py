"""The sender seam: the protocol, the email payload, and error classification.

Every adapter passes the outbox row's dedupe key to the provider as its
idempotency key, so a resend after a crash or a timeout is one effect.
"""

from __future__ import annotations

import email.utils
import math
import time
from dataclasses import dataclass
from datetime import UTC
from typing import Any, NamedTuple, Protocol

from oncely.errors import PermanentError, TransientError

SUMMARY_READY = "email.summary_ready"

# 408/429/5xx are the usual "try again"; 409 is what idempotent APIs answer
# while a request with the same key is still in flight (Stripe does), so the
# retry finds the finished result.
_TRANSIENT_4XX = frozenset({408, 409, 429})


@dataclass(frozen=True)
class SendResult:
    provider_message_id: str | None


class Sender(Protocol):
    async def send(self, topic: str, payload: dict[str, Any], dedupe_key: str) -> SendResult:
        """Deliver once per dedupe key; raises TransientError or PermanentError."""
        ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True)
class SummaryReady:
    """Payload of the ``email.summary_ready`` outbox row."""

    job_id: str
    to: str
    summary: str

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> SummaryReady:
        job_id, to, summary = (payload.get(name) for name in ("job_id", "to", "summary"))
        if not (isinstance(job_id, str) and isinstance(to, str) and isinstance(summary, str)):
            raise PermanentError(f"{SUMMARY_READY} payload needs string job_id, to, summary")
        # An empty address never delivers; a line break would smuggle headers in.
        if not to or "\r" in to or "\n" in to:
            raise PermanentError(f"{SUMMARY_READY} has an unusable recipient {to!r}")
        return cls(job_id=job_id, to=to, summary=summary)

    def to_payload(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "to": self.to, "summary": self.summary}


class Email(NamedTuple):
    to: str
    subject: str
    text: str


def render_email(topic: str, payload: dict[str, Any]) -> Email:
    """The email for an outbox row; deterministic, so a resend is the same message."""
    if topic != SUMMARY_READY:
        raise PermanentError(f"no email for topic {topic!r}")
    event = SummaryReady.from_payload(payload)
    return Email(
        to=event.to,
        subject=f"Your summary is ready (job {event.job_id})",
        text=f"{event.summary}\n\n-- oncely, job {event.job_id}\n",
    )


def classify_status(status: int, retry_after: str | None = None, *, detail: str = "") -> None:
    """Return on 2xx; otherwise raise TransientError or PermanentError.

    ``detail`` (a snippet of the answer body) only enriches the message, which
    ends up in the outbox row's ``last_error`` for an operator.
    """
    if 200 <= status < 300:
        return
    message = f"provider answered {status}" + (f": {detail}" if detail else "")
    if status in _TRANSIENT_4XX or status >= 500:
        raise TransientError(message, retry_after_s=parse_retry_after(retry_after))
    # 3xx lands here too: we never follow redirects with a POST, so a redirect
    # means the provider URL is misconfigured.
    raise PermanentError(message)


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or HTTP-date); None if absent or garbled."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return _seconds_until_http_date(value, time.time() if now is None else now)
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def _seconds_until_http_date(value: str, now: float) -> float | None:
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:  # "-0000" parses naive; HTTP-dates are always GMT
        when = when.replace(tzinfo=UTC)
    return max(0.0, when.timestamp() - now)
