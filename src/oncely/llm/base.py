"""The model-provider seam: what a step sends a model and what comes back."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
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
    # Of the prompt tokens, those written to the provider's cache (Anthropic's
    # cache_creation_input_tokens; 0 when not reported).
    cache_write_tokens: int = 0


class LLM(Protocol):
    """A model provider. ``timeout`` is the attempt's budget in seconds; the
    caller enforces it on the wall clock (``oncely.retry.call_with_retries``
    runs every attempt under ``asyncio.timeout``). Errors are oncely's own:
    ``TransientError`` (with ``retry_after_s`` and ``status`` when the provider
    sent them) or ``PermanentError``; adapters translate their SDK's errors.

    ``tools`` and ``on_text`` are passed only to calls that use them, so an
    ``LLM`` without them still answers every other call. With ``on_text``
    the answer is streamed: each piece of its text goes to ``on_text`` as it
    arrives, and the ``Completion`` is still the whole answer. ``reasoning``
    (a ``Reasoning`` effort) and ``background`` (a ``Background``) go only
    to adapters whose dialect takes them (``responses``), ``service_tier``
    (``flex``) only to the OpenAI dialects' (``chat``, ``responses``):
    never to these."""

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


# What a ``flex`` attempt asks for, where the dialect takes it (``chat``,
# ``responses``: docs/lanes.md).
FLEX_TIER = "flex"


# How hard a reasoning model thinks, where the dialect takes it (``responses``:
# ``reasoning.effort``; docs/providers.md): ``minimal``, ``low``, ``medium``,
# ``high``, or another word the provider knows.
Reasoning = str


@dataclass(frozen=True)
class Background:
    """A call the provider runs in background mode (the ``responses``
    dialect, docs/providers.md, Background calls), so that a delivery after
    a crash re-attaches to it instead of asking again. ``stored``: the
    response id a delivery before this one stored for this attempt (None:
    create it); ``keep``: stores a new response's id durably, awaited before
    the adapter waits for the answer; ``cancels``: whether a cancellation
    that reaches the waiting adapter now ends the call for good (the job was
    cancelled, or the attempt's time ran out), so the adapter cancels the
    response at the provider; any other (a shutdown) leaves it running for
    the next delivery. A streamed one (``on_text``) re-attached to goes on
    ``after`` the event of that number (the last whose text the caller
    already has; None: from the first), and ``seen`` is told each text
    piece's event number just before the piece goes to ``on_text``.
    ``name``: what keeps it (its intent's key)."""

    stored: str | None
    keep: Callable[[str], Awaitable[None]]
    cancels: Callable[[], bool] = lambda: False
    after: int | None = None
    seen: Callable[[int], None] = lambda number: None
    name: str = ""


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
    reasoning: Reasoning | None = None,
    background: Background | None = None,
    service_tier: str | None = None,
) -> dict[str, Any]:
    """The keyword options of ``LLM.complete`` a call uses, and only those:
    an ``LLM`` written before tools, streaming, reasoning effort, background
    calls or the flex tier still answers the rest."""
    options: dict[str, Any] = {}
    if tools:
        options = {"tools": tools, "tool_choice": tool_choice}
    if on_text is not None:
        options["on_text"] = on_text
    if reasoning is not None:
        options["reasoning"] = reasoning
    if background is not None:
        options["background"] = background
    if service_tier is not None:
        options["service_tier"] = service_tier
    return options
