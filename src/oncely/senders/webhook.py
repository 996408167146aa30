"""Signed webhook sender, and the check a receiver runs on what it gets.

The signature covers ``f"{timestamp}.{body}"`` so a receiver can reject both a
forged body and a replay of an old, genuinely signed one.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Callable
from typing import Any

from oncely.senders.base import SendResult
from oncely.senders.http import (
    DEFAULT_MAX_CONNECTIONS,
    IDEMPOTENCY_KEY,
    JsonPoster,
    message_id_from,
)

SIGNATURE_HEADER = "X-Oncely-Signature"
TIMESTAMP_HEADER = "X-Oncely-Timestamp"
DEFAULT_TOLERANCE_S = 300.0


def sign(secret: str, timestamp: str, body: bytes) -> str:
    """The ``X-Oncely-Signature`` value: ``v1=<hex hmac-sha256(secret, "{timestamp}.{body}")>``."""
    mac = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256)
    return f"v1={mac.hexdigest()}"


def verify_signature(
    secret: str,
    timestamp: str,
    body: bytes,
    header: str,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
    *,
    now: float | None = None,
) -> bool:
    """True if ``header`` signs ``body`` at ``timestamp`` and that is within ``tolerance_s``.

    ``header`` may list several comma-separated signatures, so a receiver can
    accept the old and the new secret's while rotating.
    """
    if not timestamp.isdigit():
        return False
    current = time.time() if now is None else now
    if abs(current - int(timestamp)) > tolerance_s:
        return False
    expected = sign(secret, timestamp, body).encode()
    return any(hmac.compare_digest(expected, part.strip().encode()) for part in header.split(","))


class WebhookSender:
    """POSTs ``{"topic", "payload", "dedupe_key"}`` signed with a shared secret."""

    def __init__(
        self,
        url: str,
        secret: str,
        timeout_s: float,
        *,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not secret:
            # An HMAC with an empty key proves nothing; refuse at startup rather
            # than send webhooks a receiver cannot trust.
            raise ValueError("the webhook sender needs a secret (ONCELY_WEBHOOK_SECRET)")
        self._url = url
        self._secret = secret
        self._clock = clock
        self._poster = JsonPoster(timeout_s, max_connections=max_connections)

    async def send(self, topic: str, payload: dict[str, Any], dedupe_key: str) -> SendResult:
        event = {"topic": topic, "payload": payload, "dedupe_key": dedupe_key}
        body = json.dumps(event, separators=(",", ":")).encode()
        timestamp = str(int(self._clock()))
        headers = {
            IDEMPOTENCY_KEY: dedupe_key,
            TIMESTAMP_HEADER: timestamp,
            SIGNATURE_HEADER: sign(self._secret, timestamp, body),
        }
        answer = await self._poster.post(self._url, body, headers)
        return SendResult(provider_message_id=message_id_from(answer))

    async def aclose(self) -> None:
        await self._poster.aclose()
