"""The sender seams and the classification of a provider's answers.

Three protocols, one per direction of knowledge:

- ``Sender`` is what the relay calls: ``send(topic, payload, dedupe_key)``.
  ``oncely.senders.routing.EffectRouter`` implements it by looking the topic up
  among the effects workflows declared.
- ``EmailSender`` delivers an already rendered ``Email``; ``EventSender`` an
  ``Event`` (a webhook). Neither knows any topic.

Every adapter passes the outbox row's dedupe key to the provider as its
idempotency key, so a resend after a crash or a timeout is one effect.
"""

from __future__ import annotations

import email.utils
import math
import time
from dataclasses import dataclass
from datetime import UTC
from typing import Any, Protocol

from oncely.effects import Email, Event
from oncely.errors import PermanentError, TransientError

# 408/429/5xx are the usual "try again"; 409 is what idempotent APIs answer
# while a request with the same key is still in flight (Stripe does), so the
# retry finds the finished result.
_TRANSIENT_4XX = frozenset({408, 409, 429})


@dataclass(frozen=True)
class SendResult:
    """A provider's acceptance: its message id, the answer's body as sent
    (``body``), and, for a call that answers, that answer as validated
    JSON (``answer``)."""

    provider_message_id: str | None
    body: bytes = b""
    answer: Any = None


class AnswerTooLarge(PermanentError):
    """A 2xx whose body passed the bound on answers: the provider acted,
    but its answer was not read (``status``: the 2xx). A plain effect is
    sent all the same; a call that answers fails (``invalid_answer``)."""


class Sender(Protocol):
    """The relay's view: deliver one outbox row."""

    async def send(self, topic: str, payload: dict[str, Any], dedupe_key: str) -> SendResult:
        """Deliver once per dedupe key; raises TransientError or PermanentError."""
        ...

    async def aclose(self) -> None: ...


class EmailSender(Protocol):
    """Delivers a rendered email; the provider dedupes on ``dedupe_key``."""

    async def send(self, email: Email, dedupe_key: str) -> SendResult:
        """Raises TransientError or PermanentError."""
        ...

    async def aclose(self) -> None: ...


class EventSender(Protocol):
    """Delivers an event (a webhook); the receiver dedupes on ``dedupe_key``."""

    async def send(self, event: Event, dedupe_key: str) -> SendResult:
        """Raises TransientError or PermanentError."""
        ...

    async def aclose(self) -> None: ...


def check_recipient(email: Email) -> None:
    """Refuse, permanently, an address that can never deliver.

    An empty one never does, and a line break would smuggle headers (a Bcc)
    into the message; every path that sends an email calls this first.
    """
    to = email.to
    if not to.strip() or "\r" in to or "\n" in to:
        raise PermanentError(f"unusable email recipient {to!r}")


def classify_status(status: int, retry_after: str | None = None, *, detail: str = "") -> None:
    """Return on 2xx; otherwise raise TransientError or PermanentError.

    ``detail`` (a snippet of the answer body) only enriches the message, which
    ends up in the outbox row's ``last_error`` for an operator.
    """
    if 200 <= status < 300:
        return
    message = f"provider answered {status}" + (f": {detail}" if detail else "")
    if status in _TRANSIENT_4XX or status >= 500:
        raise TransientError(message, retry_after_s=parse_retry_after(retry_after), status=status)
    # 3xx lands here too: we never follow redirects with a POST, so a redirect
    # means the provider URL is misconfigured.
    raise PermanentError(message, status=status)


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
