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
from oncely.senders.base import AnswerTooLarge, SendResult, check_recipient, classify_status

IDEMPOTENCY_KEY = "Idempotency-Key"

# Room for the relay's default 64 concurrent sends plus headroom, so a burst
# never queues behind the pool and eats into its own timeout.
DEFAULT_MAX_CONNECTIONS = 128

_DETAIL_CHARS = 200

# The most of an answer's body read (ONCELY_CALL_ANSWER_MAX_BYTES): a call's
# answer is stored, and any answer is held in memory while it is read.
DEFAULT_MAX_ANSWER_BYTES = 1_048_576


class JsonPoster:
    """POSTs JSON bodies over one session and classifies every failure.

    Several senders may share one poster (and so one connection pool); each
    may close it, and a poster used again after closing opens a new session.
    """

    def __init__(
        self,
        timeout_s: float,
        *,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES,
    ) -> None:
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._max_connections = max_connections
        self._max_answer_bytes = max_answer_bytes
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        # Created on first use: aiohttp binds a session to the running loop, and
        # the composition root builds senders before any loop may exist.
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self._max_connections)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        return self._session

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> bytes:
        """The answer body of a 2xx; raises TransientError or PermanentError
        otherwise, and ``AnswerTooLarge`` for a 2xx whose body passes the
        bound (the receiver acted; the rest of its answer is never read)."""
        all_headers = {"Content-Type": "application/json", **headers}
        try:
            async with self._client().post(
                url, data=body, headers=all_headers, allow_redirects=False
            ) as response:
                answer = await _read_bounded(response, self._max_answer_bytes)
                status, retry_after = response.status, response.headers.get("Retry-After")
        except aiohttp.InvalidURL as exc:
            raise PermanentError(f"invalid provider URL {url!r}") from exc
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            # Timeouts included: the provider may have acted, and the resend
            # carries the same idempotency key, so retrying is safe.
            raise TransientError(f"POST {url} failed: {type(exc).__name__}: {exc}") from exc
        if answer is None:
            classify_status(status, retry_after, detail="an answer too large to read")
            raise AnswerTooLarge(
                f"POST {url}: an answer over {self._max_answer_bytes} bytes", status=status
            )
        detail = answer[:_DETAIL_CHARS].decode("utf-8", "replace")
        classify_status(status, retry_after, detail=detail)
        return answer

    async def aclose(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()


async def _read_bounded(response: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The answer's body, or None once it passes ``limit`` bytes: read as it
    streams in, so an endless or huge answer costs at most ``limit`` bytes
    (leaving the rest unread closes the connection)."""
    if response.content_length is not None and response.content_length > limit:
        return None
    chunks, size = [], 0
    async for chunk in response.content.iter_any():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


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
