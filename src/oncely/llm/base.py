"""The model-provider seam: what a step sends a model and what comes back."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, Protocol, Self, runtime_checkable


@dataclass(frozen=True)
class ToolRequest:
    """A tool call a model asked for: its ``id`` (the provider's), the tool's
    ``name``, and its ``arguments`` as the provider sent them (JSON text,
    which may not be JSON at all: the caller decides what that means)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Message:
    """One message of a conversation: ``system``, ``user``, ``assistant``
    (with the ``tool_calls`` it made, if any) or ``tool`` (the result of the
    call ``tool_call_id``)."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str
    tool_calls: tuple[ToolRequest, ...] = ()
    tool_call_id: str | None = None


@dataclass(frozen=True)
class ToolSpec:
    """A tool as a model is told it: name, description, JSON schema of its
    arguments."""

    name: str
    description: str
    parameters: Mapping[str, Any]


# "auto" (the model decides), "none", "required", or a tool's name.
ToolChoice = str


@dataclass(frozen=True)
class ResponseSchema:
    """Ask for structured output: the answer must be JSON valid for ``schema``
    (OpenAI ``response_format: {"type": "json_schema", ...}``)."""

    name: str
    schema: Mapping[str, Any]


@dataclass(frozen=True)
class Completion:
    """The answer's text (or the tools it calls) and the tokens the provider
    reported (0 when it did not); ``queued_s``: how long the call waited on
    the fleet limiter before it went."""

    text: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    queued_s: float = field(default=0.0, compare=False)
    # The tools the model asked to call (the text may then be empty).
    tool_calls: tuple[ToolRequest, ...] = ()
    # Of the prompt tokens, those served from the provider's cache; of the
    # completion tokens, those spent reasoning (0 when not reported).
    cached_tokens: int = 0
    reasoning_tokens: int = 0


class LLM(Protocol):
    """A model provider. ``timeout`` is the attempt's budget in seconds; the
    caller enforces it on the wall clock (``oncely.retry.call_with_retries``
    runs every attempt under ``asyncio.timeout``). Errors are oncely's own:
    ``TransientError`` (with ``retry_after_s`` and ``status`` when the provider
    sent them) or ``PermanentError``; adapters translate their SDK's errors.

    ``tools`` and ``on_text`` are passed only to calls that use them, so an
    ``LLM`` without them still answers every other call. With ``on_text``
    the answer is streamed: each piece of its text goes to ``on_text`` as it
    arrives, and the ``Completion`` is still the whole answer."""

    async def complete(
        self,
        messages: Sequence[Message],
        timeout: float,  # noqa: ASYNC109 (the contract)
        *,
        schema: ResponseSchema | None = None,
        tools: Sequence[ToolSpec] = (),
        tool_choice: ToolChoice | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> Completion: ...


class ClosedOnExit:
    """``async with client:`` closes it (``aclose``) at the block's end."""

    async def aclose(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


@runtime_checkable
class ModelClient(LLM, Protocol):
    """An OpenAI-compatible endpoint's client (``ONCELY_LLM_CLIENT``: the
    SDK's ``OpenAICompatible`` or ``LeanOpenAICompatible``): one model name,
    others on the same connections by ``with_model``, closed once."""

    model: str

    def with_model(self, model: str) -> ModelClient: ...

    async def aclose(self) -> None: ...

    async def __aenter__(self) -> ModelClient: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


def call_options(
    tools: Sequence[ToolSpec],
    tool_choice: ToolChoice | None,
    on_text: Callable[[str], None] | None,
) -> dict[str, Any]:
    """The keyword options of ``LLM.complete`` a call uses, and only those:
    an ``LLM`` written before tools or streaming still answers the rest."""
    options: dict[str, Any] = {}
    if tools:
        options = {"tools": tools, "tool_choice": tool_choice}
    if on_text is not None:
        options["on_text"] = on_text
    return options
