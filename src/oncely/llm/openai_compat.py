"""Any OpenAI-compatible chat endpoint (OpenAI, vLLM, Ollama, llama.cpp server,
the fake model) through the official ``openai`` SDK.

The SDK runs on its aiohttp transport: it costs less than half the client CPU
per call of the default one (DESIGN §6). Its own retries are off
(``max_retries=0``): ``oncely.retry`` owns the policy, and two retry layers
would multiply each other's attempts.
"""

from __future__ import annotations

from types import TracebackType

import openai
from openai.types.chat import ChatCompletion

from oncely.errors import PermanentError
from oncely.settings import Settings


class OpenAICompatible:
    """The ``LLM`` protocol over chat completions: one user message in, its answer out."""

    def __init__(self, client: openai.AsyncOpenAI, model: str) -> None:
        self._client = client
        self._model = model

    @classmethod
    def connect(cls, base_url: str, api_key: str, model: str) -> OpenAICompatible:
        """Build the client; no connection opens until the first call."""
        client = openai.AsyncOpenAI(
            base_url=base_url,
            api_key=api_key,
            max_retries=0,
            http_client=openai.DefaultAioHttpClient(),
        )
        return cls(client, model)

    @classmethod
    def from_settings(cls, settings: Settings) -> OpenAICompatible:
        return cls.connect(
            settings.llm_base_url, settings.llm_api_key.get_secret_value(), settings.llm_model
        )

    async def complete(self, prompt: str, timeout: float) -> str:  # noqa: ASYNC109 (LLM protocol)
        # The SDK's timeout bounds each socket read, not the call: a server that
        # drips a byte a second would never trip it. The wall-clock limit is the
        # caller's (``call_with_retries`` runs every attempt under one).
        completion = await self._client.chat.completions.create(
            model=self._model,
            messages=[{"role": "user", "content": prompt}],
            timeout=timeout,
        )
        return _answer(completion)

    async def aclose(self) -> None:
        await self._client.close()

    async def __aenter__(self) -> OpenAICompatible:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


def _answer(completion: ChatCompletion) -> str:
    """The message text. A 200 without one will not change on a retry."""
    if not completion.choices or not completion.choices[0].message.content:
        reason = completion.choices[0].finish_reason if completion.choices else "no choices"
        raise PermanentError(f"model returned no content ({reason})")
    return completion.choices[0].message.content
