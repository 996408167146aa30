"""HTTP email API sender, and the aiohttp plumbing the webhook sender shares.

aiohttp rather than httpx: at 64 concurrent sends on these machines httpx
costs several ms of CPU per request and aiohttp about 0.3 ms, and the relay's
throughput on a small box is bounded by exactly that.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import aiohttp

from oncely.effects import Email
from oncely.errors import PermanentError, TransientError
from oncely.senders.base import SendResult, check_recipient, classify_status

IDEMPOTENCY_KEY = "Idempotency-Key"

# Room for the relay's default 64 concurrent sends plus headroom, so a burst
# never queues behind the pool and eats into its own timeout.
DEFAULT_MAX_CONNECTIONS = 128

_DETAIL_CHARS = 200


class JsonPoster:
    """POSTs JSON bodies over one session and classifies every failure.

    Several senders may share one poster (and so one connection pool); each
    may close it, and a poster used again after closing opens a new session.
    """

    def __init__(self, timeout_s: float, *, max_connections: int = DEFAULT_MAX_CONNECTIONS) -> None:
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        # Created on first use: aiohttp binds a session to the running loop, and
        # the composition root builds senders before any loop may exist.
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self._max_connections)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        return self._session

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> bytes:
        """The answer body of a 2xx; raises TransientError or PermanentError otherwise."""
        all_headers = {"Content-Type": "application/json", **headers}
        try:
            async with self._client().post(
                url, data=body, headers=all_headers, allow_redirects=False
            ) as response:
                answer = await response.read()
                status, retry_after = response.status, response.headers.get("Retry-After")
        except aiohttp.InvalidURL as exc:
            raise PermanentError(f"invalid provider URL {url!r}") from exc
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            # Timeouts included: the provider may have acted, and the resend
            # carries the same idempotency key, so retrying is safe.
            raise TransientError(f"POST {url} failed: {type(exc).__name__}: {exc}") from exc
        detail = answer[:_DETAIL_CHARS].decode("utf-8", "replace")
        classify_status(status, retry_after, detail=detail)
        return answer

    async def aclose(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()


def message_id_from(answer: bytes) -> str | None:
    """The ``id`` of a JSON answer, if any.

    The provider has already accepted the message, so an odd answer body must
    not turn a delivered email into a failed send.
    """
    try:
        data: Any = json.loads(answer)
    except ValueError:
        return None
    value = data.get("id") if isinstance(data, dict) else None
    return None if value is None else str(value)


class HttpEmailSender:
    """Sends emails to an HTTP email API as JSON ``{to, subject, text}``.

    The dedupe key goes in ``Idempotency-Key``. ``poster`` shares another
    sender's session (its timeout and connection limit then apply).
    """

    def __init__(
        self,
        url: str,
        timeout_s: float,
        *,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        poster: JsonPoster | None = None,
    ) -> None:
        self._url = url
        self._poster = poster or JsonPoster(timeout_s, max_connections=max_connections)

    async def send(self, email: Email, dedupe_key: str) -> SendResult:
        check_recipient(email)
        fields = {"to": email.to, "subject": email.subject, "text": email.text}
        body = json.dumps(fields).encode()
        answer = await self._poster.post(self._url, body, {IDEMPOTENCY_KEY: dedupe_key})
        return SendResult(provider_message_id=message_id_from(answer))

    async def aclose(self) -> None:
        await self._poster.aclose()
