"""Webhooks per Standard Webhooks (https://www.standardwebhooks.com), and the
check a receiver runs on what it gets.

Each POST carries the body ``{"type", "timestamp", "data"}`` (compact JSON)
and three headers:

- ``webhook-id``: the outbox row's dedupe key, the same on every resend, so
  the receiver dedupes on it (``Idempotency-Key`` carries it too, for plain
  HTTP receivers);
- ``webhook-timestamp``: unix seconds of this attempt;
- ``webhook-signature``: ``v1,`` + base64(HMAC-SHA256(key, "{id}.{timestamp}.{body}")).

Signing the id and the time with the body lets a receiver reject a forged body
and a replay of an old, genuinely signed one. The key is the secret after
``whsec_`` base64-decoded (the standard's format), or any other secret's UTF-8
bytes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import time
from collections.abc import Callable, Mapping
from typing import Any

from oncely.effects import Event
from oncely.errors import PermanentError
from oncely.senders.base import SendResult
from oncely.senders.http import (
    DEFAULT_MAX_CONNECTIONS,
    IDEMPOTENCY_KEY,
    JsonPoster,
    message_id_from,
)

WEBHOOK_ID = "webhook-id"
WEBHOOK_TIMESTAMP = "webhook-timestamp"
WEBHOOK_SIGNATURE = "webhook-signature"
SECRET_PREFIX = "whsec_"
DEFAULT_TOLERANCE_S = 300.0


def secret_key(secret: str) -> bytes:
    """The HMAC key a secret stands for; ValueError if it is empty or a bad ``whsec_``."""
    if not secret.startswith(SECRET_PREFIX):
        key = secret.encode()
    else:
        try:
            key = base64.b64decode(secret.removeprefix(SECRET_PREFIX), validate=True)
        except binascii.Error as exc:
            raise ValueError(f"a {SECRET_PREFIX} webhook secret must be base64") from exc
    if not key:
        # An HMAC with an empty key proves nothing: refuse rather than send
        # webhooks no receiver can trust.
        raise ValueError("a webhook secret must not be empty")
    return key


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` value for one message: ``v1,<base64 signature>``."""
    return _signature(secret_key(secret), msg_id, timestamp, body)


def _signature(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    signed = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(key, signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def verify(
    secret: str,
    headers: Mapping[str, str],
    body: bytes | str,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
    now: float | None = None,
) -> bool:
    """True if ``headers`` sign ``body`` with ``secret`` at a time within
    ``tolerance_s`` seconds of ``now`` (default: the clock).

    ``secret``: ``ONCELY_WEBHOOK_SECRET`` as configured (``whsec_…`` or raw).
    ``headers``: the request's headers, any mapping of names to values (a
    framework's headers object will do); names are matched
    case-insensitively. ``body``: the request's body exactly as received,
    bytes or text (text is taken as UTF-8; verify before parsing it, as
    any re-serialisation changes the bytes). ``webhook-signature`` may list
    several space-separated ``v1,<signature>`` entries (a sender rotating
    its secret signs with both); any one matching passes.

    ::

        from oncely.senders import verify

        @app.post("/hooks/oncely")
        async def hook(request: Request) -> Response:
            body = await request.body()
            if not verify(SECRET, request.headers, body):
                return Response(status_code=401)
            event = json.loads(body)
            ...
    """
    if isinstance(body, str):
        body = body.encode()
    lowered = {name.lower(): value for name, value in headers.items()}
    msg_id, timestamp, signatures = (
        lowered.get(name) for name in (WEBHOOK_ID, WEBHOOK_TIMESTAMP, WEBHOOK_SIGNATURE)
    )
    if msg_id is None or timestamp is None or signatures is None:
        return False
    if not (timestamp.isascii() and timestamp.isdigit()):
        return False
    current = time.time() if now is None else now
    if abs(current - int(timestamp)) > tolerance_s:
        return False
    expected = sign(secret, msg_id, int(timestamp), body).encode()
    return any(hmac.compare_digest(expected, entry.encode()) for entry in signatures.split())


class WebhookSender:
    """POSTs events to one URL, signed per Standard Webhooks.

    ``poster`` shares another sender's session (its timeout and connection
    limit then apply); ``clock`` gives the unix time of a send.
    """

    def __init__(
        self,
        url: str,
        secret: str,
        timeout_s: float,
        *,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        poster: JsonPoster | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._url = url
        self._key = secret_key(secret)
        self._clock = clock
        self._poster = poster or JsonPoster(timeout_s, max_connections=max_connections)

    async def send(self, event: Event, dedupe_key: str) -> SendResult:
        timestamp = int(self._clock())
        body = _body(event, timestamp)
        headers = {
            WEBHOOK_ID: dedupe_key,
            WEBHOOK_TIMESTAMP: str(timestamp),
            WEBHOOK_SIGNATURE: _signature(self._key, dedupe_key, timestamp, body),
            IDEMPOTENCY_KEY: dedupe_key,
        }
        answer = await self._poster.post(self._url, body, headers)
        return SendResult(provider_message_id=message_id_from(answer), body=answer)

    async def aclose(self) -> None:
        await self._poster.aclose()


def _body(event: Event, timestamp: int) -> bytes:
    data = event.data if isinstance(event.data, dict) else dict(event.data)
    envelope: dict[str, Any] = {
        "type": event.type,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(timestamp)),
        "data": data,
    }
    try:
        return json.dumps(envelope, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        raise PermanentError(f"{event.type} event data is not JSON: {exc}") from exc
