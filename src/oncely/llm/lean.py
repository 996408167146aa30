"""The lean model client (``ONCELY_LLM_CLIENT=lean``): the same chat
completions as ``oncely.llm.openai_compat``, straight over aiohttp, with no
SDK between the worker and the socket.

Why it exists: the SDK builds typed request and response objects for every
call, and with a fast model that is most of a worker's CPU per job
(docs/performance.md). This client writes the request body as a dict and
reads the answer's few fields from the parsed JSON.

What a call means does not depend on the client. Both send the same body
(``oncely.llm.wire.request_body``: messages in order with their tool calls and
tool results, ``response_format: json_schema`` for structured output,
``tools`` and ``tool_choice``),
bound every socket read by the attempt's timeout, and read statuses, usage
and empty answers through ``oncely.llm.wire``. Errors translate here:

- a status of 400 or more: ``wire.status_error`` (408, 409, 429, 5xx
  transient with ``Retry-After``; the rest permanent), the body's
  ``error.code`` when it is JSON;
- a read or connect timeout: a plain ``TimeoutError`` (the retry policy's
  "timeout", like the wall-clock one around every attempt);
- any other aiohttp error (refused, reset, a truncated body): ``TransientError``;
- a 200 that is not JSON, or has no content: ``PermanentError``.

With ``on_text``, the answer comes streamed (``stream: true``): each piece
of its text goes to ``on_text`` as it arrives, and the pieces are gathered
into the same ``Completion`` (``wire.StreamedAnswer``). A stream cut off
before its end is a ``TransientError``: the retry starts over.

tests/test_llm_adapter.py runs the same tests against both clients.
"""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence

import aiohttp

from oncely.errors import OncelyError, TransientError
from oncely.llm import wire
from oncely.llm.base import (
    ClosedOnExit,
    Completion,
    Message,
    ResponseSchema,
    ToolChoice,
    ToolSpec,
)

# As many connections to one endpoint as the SDK's aiohttp transport allows.
CONNECTIONS = 1000


class _Endpoint:
    """One base URL and key: the session every model name on it shares,
    opened by the first call (inside the event loop that makes it). A proxy
    named by ``HTTPS_PROXY`` / ``HTTP_PROXY`` (and not bypassed by
    ``NO_PROXY``) is used, read once."""

    def __init__(self, base_url: str, api_key: str) -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.proxy = _proxy_for(self.url)
        self._headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=CONNECTIONS)
            self._session = aiohttp.ClientSession(connector=connector, headers=self._headers)
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class LeanOpenAICompatible(ClosedOnExit):
    """The ``LLM`` protocol over chat completions, without the SDK."""

    dialect = "chat"
    # It takes OpenAI's flex tier and Batch API (docs/lanes.md).
    lanes = ("standard", "flex", "batch")

    def __init__(self, endpoint: _Endpoint, model: str) -> None:
        self._endpoint = endpoint
        self.model = model

    @classmethod
    def connect(cls, base_url: str, api_key: str, model: str) -> LeanOpenAICompatible:
        """No connection opens until the first call."""
        return cls(_Endpoint(base_url, api_key), model)

    def with_model(self, model: str) -> LeanOpenAICompatible:
        """The same endpoint and connections, asking for another model."""
        return self if model == self.model else LeanOpenAICompatible(self._endpoint, model)

    async def complete(
        self,
        messages: Sequence[Message],
        timeout: float,  # noqa: ASYNC109 (LLM protocol)
        *,
        schema: ResponseSchema | None = None,
        tools: Sequence[ToolSpec] = (),
        tool_choice: ToolChoice | None = None,
        on_text: Callable[[str], None] | None = None,
        service_tier: str | None = None,
    ) -> Completion:
        body = wire.request_body(self.model, messages, schema, tools, tool_choice, service_tier)
        if on_text is not None:
            body = wire.stream_body(body)
        endpoint = self._endpoint
        try:
            async with endpoint.session().post(
                endpoint.url,
                data=json.dumps(body),
                # Every connect and socket read within the attempt's budget
                # (the SDK's ``timeout=``); its wall clock is the caller's.
                timeout=aiohttp.ClientTimeout(
                    total=None, connect=timeout, sock_connect=timeout, sock_read=timeout
                ),
                proxy=endpoint.proxy,
            ) as response:
                if on_text is not None and response.status < 400:
                    return await _read_stream(response, on_text)
                raw = await response.read()
                status, headers = response.status, response.headers
        except aiohttp.ClientError as exc:
            raise translate_error(exc) from exc
        if status >= 400:
            raise wire.status_error(status, wire.error_code(_json(raw)), headers)
        data = _json(raw)
        if data is None:
            raise wire.no_content("not JSON")
        return wire.read_answer(data)

    async def aclose(self) -> None:
        await self._endpoint.aclose()


async def _read_stream(
    response: aiohttp.ClientResponse, on_text: Callable[[str], None]
) -> Completion:
    """A streamed answer, each piece of its text to ``on_text`` as it comes."""
    answer = wire.StreamedAnswer()
    async for chunk in wire.stream_chunks(response.content.iter_any()):
        if text := answer.add(chunk):
            on_text(text)
    return answer.completion()


def translate_error(exc: aiohttp.ClientError) -> OncelyError | TimeoutError:
    """The oncely error an aiohttp error stands for (see the module doc)."""
    if isinstance(exc, aiohttp.ServerTimeoutError):  # connect or socket read
        return TimeoutError("model call timed out")
    return TransientError(f"model unreachable ({type(exc).__name__})")


def _proxy_for(url: str) -> str | None:
    """The environment's proxy for ``url`` (None: connect directly)."""
    parts = urllib.parse.urlsplit(url)
    if urllib.request.proxy_bypass(parts.hostname or ""):
        return None
    return urllib.request.getproxies().get(parts.scheme)


def _json(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except ValueError:  # not JSON, or not UTF-8
        return None
