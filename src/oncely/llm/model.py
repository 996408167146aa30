"""What a workflow step gets as ``ctx.model``: the model under the delivery's
deadline and retry policy, counted per workflow.

Every call is a checkpoint of the job's run (``oncely.journal``): key
``model`` (then ``model#2``, …) or the ``step=`` name given. A call that
answered is stored with the job and never paid for again: a replay gets the
stored answer. The model that answered is recorded with the checkpoint
(``usage.model``).

This module is the step's face: ``complete``, ``structured`` and
``respond``, what each asks and what its checkpoint keeps. A call's trip
down its route, with each attempt's retries, fallbacks, cooldown, ledger
row and metrics, is ``oncely.llm.trip``; the reply types, which need no
driver, are ``oncely.llm.reply`` (re-exported here). ``structured`` asks
for JSON valid for a pydantic model and asks again when the answer does not
validate; those re-asks are separate from transient retries (each gets its
own trip), and all of them run under the one deadline.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import structlog
from pydantic import BaseModel, ValidationError

from oncely.errors import PermanentError, short_errors
from oncely.journal import Journal, Recorded, check_name
from oncely.llm.base import (
    LLM,
    Message,
    Reasoning,
    ResponseSchema,
    ToolChoice,
    ToolSpec,
)
from oncely.llm.reply import Reply, ToolCall, Usage, conversation, response_schema, tool_spec
from oncely.llm.trip import ModelRoute, Request, Trip
from oncely.retry import Deadline, RetryPolicy
from oncely.usage.calls import LANES, CallSite, Lane

if TYPE_CHECKING:
    from oncely.live.events import LiveJob

__all__ = [
    "InvalidOutput",
    "Model",
    "ModelRoute",
    "Reply",
    "ToolCall",
    "Usage",
    "conversation",
    "response_schema",
]

M = TypeVar("M", bound=BaseModel)

log = structlog.get_logger(__name__)


class InvalidOutput(PermanentError):
    """Every answer failed validation against the step's result model.
    ``errors`` is a short form of the last validation error."""

    def __init__(self, result: str, errors: str, *, asks: int) -> None:
        super().__init__(f"{result}: no valid answer in {asks} asks: {errors}")
        self.errors = errors


class Model:
    """The model for one delivery. Not shared between deliveries: ``usage``
    (everything this delivery spent) and the deadline are the delivery's own.
    ``journal``: the job's run, whose checkpoints the calls are (by default
    one that keeps nothing). ``route``: the models after ``llm``, the
    cooldown and the ledger; ``site``: whom the ledger's rows are for
    (module docstring)."""

    def __init__(
        self,
        llm: LLM,
        *,
        policy: RetryPolicy,
        deadline: Deadline,
        workflow: str,
        model_name: str,
        invalid_output_retries: int = 2,
        journal: Journal | None = None,
        route: ModelRoute | None = None,
        site: CallSite | None = None,
    ) -> None:
        if invalid_output_retries < 0:
            raise ValueError("invalid_output_retries must not be negative")
        self.usage = Usage()
        self.journal = journal if journal is not None else Journal(workflow=workflow)
        self._trip = Trip(
            llm,
            policy=policy,
            deadline=deadline,
            workflow=workflow,
            model_name=model_name,
            usage=self.usage,
            route=route,
            site=site,
            journal=self.journal,
        )
        self._policy = policy
        self._deadline = deadline
        self._invalid_output_retries = invalid_output_retries
        self._workflow = workflow
        self._streaming = False

    def stream_to(self, live: LiveJob, *, streaming: bool, delivery: int = 1) -> None:
        """Stream calls' tokens to the job's live stream: every call when
        ``streaming`` (``Workflow(stream=True)``), else those asked to
        (``stream=True``). Events name the ``delivery`` and the call's
        attempt in it (across fallbacks): every attempt but a first
        delivery's first resets what the step streamed before
        (docs/streaming.md)."""
        self._streaming = streaming
        self._trip.stream_to(live, delivery=delivery)

    def cancelled_when(self, cancelled: Callable[[], bool]) -> None:
        """``cancelled()`` says whether the delivery's job was cancelled: a
        background response a call waits for is then cancelled at the
        provider (docs/providers.md, Background calls)."""
        self._trip.cancelled_when(cancelled)

    @property
    def deadline(self) -> Deadline:
        """The delivery's deadline, which every call and step runs under."""
        return self._deadline

    @property
    def policy(self) -> RetryPolicy:
        """The retry policy of this delivery's calls."""
        return self._policy

    async def complete(
        self,
        user: str,
        *,
        system: str | None = None,
        step: str | None = None,
        stream: bool | None = None,
        reasoning: Reasoning | None = None,
        lane: Lane | None = None,
    ) -> str:
        """The model's answer to ``user`` (after ``system``, when given): the
        checkpoint ``step`` (default ``model``, ``model#2``, …). ``stream``:
        its tokens go to the job's live stream as they come (default: the
        workflow's ``stream``); the checkpoint keeps the whole answer.
        ``reasoning``: how hard a reasoning model thinks (``low``, ``medium``,
        ``high``…), sent where the dialect takes it (``responses``), left
        out for the others (docs/providers.md). ``lane``: ``standard``,
        ``flex`` or ``batch`` (docs/lanes.md; default: the workflow's)."""
        messages = _messages(user, system)
        streamed = self._streaming if stream is None else stream
        request = Request(messages, streamed=streamed, reasoning=reasoning, lane=_lane(lane))

        async def work() -> Recorded[str]:
            spent = Usage()
            answer = await self._trip.ask(request, spent)
            self._trip.bill(answer, "ok", spent)
            text = answer.completion.text
            return Recorded(text, text, spent.to_json())

        return await self.journal.record(
            _checkpoint(step), "model", work, str, request=request.digest()
        )

    async def structured(
        self,
        result: type[M],
        user: str,
        *,
        system: str | None = None,
        step: str | None = None,
        reasoning: Reasoning | None = None,
        lane: Lane | None = None,
    ) -> M:
        """The answer as ``result``: asked for as JSON of its schema, validated,
        and asked again up to ``invalid_output_retries`` times when invalid.
        Raises ``InvalidOutput`` (permanent) when no answer validates. The
        checkpoint ``step`` (default ``model``, ``model#2``, …);
        ``reasoning`` and ``lane`` as for ``complete``."""
        messages = _messages(user, system)
        asked = Request(messages, response_schema(result), reasoning=reasoning, lane=_lane(lane))

        async def work() -> Recorded[M]:
            spent = Usage()
            value = await self._structured(result, asked, spent)
            return Recorded(value.model_dump(mode="json"), value, spent.to_json())

        return await self.journal.record(
            _checkpoint(step), "model", work, result.model_validate, request=asked.digest()
        )

    async def respond(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[ToolSpec | Mapping[str, Any]] = (),
        tool_choice: ToolChoice = "auto",
        output: type[BaseModel] | ResponseSchema | None = None,
        step: str | None = None,
        stream: bool | None = None,
        reasoning: Reasoning | None = None,
        lane: Lane | None = None,
    ) -> Reply:
        """One turn of a conversation with tools: the model's ``Reply``
        (its text, the tools it calls, what it spent). ``messages`` are
        OpenAI-style dicts (``system``, ``user``, ``assistant`` with
        ``tool_calls``, ``tool`` with ``tool_call_id``); ``tools`` are
        ``ToolSpec``s or ``{"name", "description", "parameters"}``;
        ``output`` asks for a final answer that is JSON of that model's
        schema (or of a ``ResponseSchema``'s, a framework's output type).
        The checkpoint ``step`` (default ``model``, ``model#2``, …): a turn
        that answered is never paid for again. ``stream``: its text goes to
        the job's live stream as it comes (default: the workflow's
        ``stream``); the checkpoint keeps the whole turn. ``reasoning`` and
        ``lane`` as for ``complete``."""
        request = Request(
            conversation(messages),
            output if isinstance(output, ResponseSchema | None) else response_schema(output),
            tuple(tool_spec(t) for t in tools),
            tool_choice if tools else None,
            streamed=self._streaming if stream is None else stream,
            reasoning=reasoning,
            lane=_lane(lane),
        )

        async def work() -> Recorded[Reply]:
            spent = Usage()
            answer = await self._trip.ask(request, spent)
            self._trip.bill(answer, "ok", spent)
            completion = answer.completion
            calls = tuple(ToolCall.of(r) for r in completion.tool_calls)
            reply = Reply(completion.text, calls, spent.to_json())
            return Recorded(reply.to_json(), reply, spent.to_json())

        return await self.journal.record(
            _checkpoint(step), "model", work, Reply.from_json, request=request.digest()
        )

    async def _structured(self, result: type[M], request: Request, spent: Usage) -> M:
        asks = self._invalid_output_retries + 1
        for ask in range(1, asks + 1):
            answer = await self._trip.ask(request, spent)
            try:
                value = result.model_validate_json(answer.completion.text)
            except ValidationError as exc:
                errors = short_errors(exc)
            else:
                self._trip.bill(answer, "ok", spent)
                return value
            self._trip.bill(answer, "invalid_output", spent)
            self._trip.invalid_output(answer.model)
            log.info(
                "model.invalid_output",
                workflow=self._workflow,
                model=answer.model,
                result=result.__name__,
                ask=ask,
                errors=errors,
            )
        raise InvalidOutput(result.__name__, errors, asks=asks)


def _lane(lane: Lane | None) -> Lane | None:
    """A call's lane as asked, checked (a step's typo fails at once)."""
    if lane is not None and lane not in LANES:
        raise ValueError(f"lane {lane!r}: expected one of {', '.join(LANES)}")
    return lane


def _checkpoint(step: str | None) -> str:
    return "model" if step is None else check_name(step)


def _messages(user: str, system: str | None) -> list[Message]:
    if system is None:
        return [Message("user", user)]
    return [Message("system", system), Message("user", user)]
