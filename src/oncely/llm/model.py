"""What a workflow step gets as ``ctx.model``: the model under the delivery's
deadline and retry policy, counted per workflow.

Every call is a checkpoint of the job's run (``oncely.journal``): key
``model`` (then ``model#2``, …) or the ``step=`` name given. A call that
answered is stored with the job and never paid for again: a replay gets the
stored answer.

Every attempt counts: in ``Model.usage`` (what this delivery spent) and in the
model metrics labelled by workflow and model. ``structured`` asks for JSON
valid for a pydantic model and asks again when the answer does not validate;
those re-asks are separate from transient retries (each gets its own retry
loop), and all of them run under the one deadline.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import structlog
from prometheus_client import Counter, Histogram
from pydantic import BaseModel, ValidationError

from oncely import tracing
from oncely.errors import PermanentError
from oncely.journal import Journal, Recorded, check_name
from oncely.llm.base import LLM, Completion, Message, ResponseSchema
from oncely.metrics import (
    MODEL_CALL_SECONDS,
    MODEL_CALLS,
    MODEL_INVALID_OUTPUTS,
    MODEL_RETRIES,
    MODEL_TOKENS,
)
from oncely.retry import Deadline, RetryEvent, RetryPolicy, call_with_retries, classify

M = TypeVar("M", bound=BaseModel)

log = structlog.get_logger(__name__)

# Enough of a validation error to act on; the answer itself is never quoted.
_ERRORS_SHOWN = 3
_ERROR_CHARS = 300


@dataclass
class Usage:
    """What one delivery spent on the model: attempts made, tokens reported,
    and the wall-clock time spent in model calls (``model_ms``, what shadow
    reports compare; left out of equality, as no two runs take the same time)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    model_calls: int = 0
    model_ms: int = field(default=0, compare=False)

    def to_json(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "model_calls": self.model_calls,
            "model_ms": self.model_ms,
        }

    def add(self, other: Usage) -> None:
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.model_calls += other.model_calls
        self.model_ms += other.model_ms


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
    one that keeps nothing)."""

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
    ) -> None:
        if invalid_output_retries < 0:
            raise ValueError("invalid_output_retries must not be negative")
        self.usage = Usage()
        self.journal = journal if journal is not None else Journal(workflow=workflow)
        self._llm = llm
        self._policy = policy
        self._deadline = deadline
        self._invalid_output_retries = invalid_output_retries
        self._meters = _meters(workflow, model_name)
        self._model_name = model_name

    @property
    def deadline(self) -> Deadline:
        """The delivery's deadline, which every call and step runs under."""
        return self._deadline

    @property
    def policy(self) -> RetryPolicy:
        """The retry policy of this delivery's calls."""
        return self._policy

    async def complete(
        self, user: str, *, system: str | None = None, step: str | None = None
    ) -> str:
        """The model's answer to ``user`` (after ``system``, when given): the
        checkpoint ``step`` (default ``model``, ``model#2``, …)."""
        messages = _messages(user, system)

        async def work() -> Recorded[str]:
            spent = Usage()
            completion = await self._ask(messages, None, spent)
            return Recorded(completion.text, completion.text, spent.to_json())

        return await self.journal.record(_checkpoint(step), "model", work, str)

    async def structured(
        self, result: type[M], user: str, *, system: str | None = None, step: str | None = None
    ) -> M:
        """The answer as ``result``: asked for as JSON of its schema, validated,
        and asked again up to ``invalid_output_retries`` times when invalid.
        Raises ``InvalidOutput`` (permanent) when no answer validates. The
        checkpoint ``step`` (default ``model``, ``model#2``, …)."""
        messages = _messages(user, system)

        async def work() -> Recorded[M]:
            spent = Usage()
            value = await self._structured(result, messages, spent)
            return Recorded(value.model_dump(mode="json"), value, spent.to_json())

        return await self.journal.record(_checkpoint(step), "model", work, result.model_validate)

    async def _structured(self, result: type[M], messages: list[Message], spent: Usage) -> M:
        schema = response_schema(result)
        asks = self._invalid_output_retries + 1
        for ask in range(1, asks + 1):
            completion = await self._ask(messages, schema, spent)
            try:
                return result.model_validate_json(completion.text)
            except ValidationError as exc:
                errors = short_errors(exc)
            self._meters.invalid_outputs.inc()
            log.info(
                "model.invalid_output",
                workflow=self._meters.workflow,
                result=result.__name__,
                ask=ask,
                errors=errors,
            )
        raise InvalidOutput(result.__name__, errors, asks=asks)

    async def _ask(
        self, messages: Sequence[Message], schema: ResponseSchema | None, spent: Usage
    ) -> Completion:
        """One answer, with transient retries under the delivery's deadline;
        what it costs goes into ``spent`` (the checkpoint's) and ``usage``."""

        async def attempt(timeout_s: float) -> Completion:
            spent.model_calls += 1
            started = time.monotonic()
            # GenAI semantic conventions: one client span per attempt.
            with tracing.span(
                f"chat {self._model_name}",
                kind="client",
                attributes={
                    "gen_ai.operation.name": "chat",
                    "gen_ai.request.model": self._model_name,
                    "oncely.attempt": self.usage.model_calls,
                },
            ) as span:
                try:
                    completion = await self._llm.complete(messages, timeout_s, schema=schema)
                except (Exception, asyncio.CancelledError) as exc:
                    self._meters.failed(exc).inc()
                    spent.model_ms += round((time.monotonic() - started) * 1000)
                    raise
                finally:
                    self._meters.seconds.observe(time.monotonic() - started)
                # Time waiting on the fleet limiter is not the model's.
                took = time.monotonic() - started - completion.queued_s
                spent.model_ms += max(0, round(took * 1000))
                if span is not None:
                    span.set_attribute("gen_ai.usage.input_tokens", completion.prompt_tokens)
                    span.set_attribute("gen_ai.usage.output_tokens", completion.completion_tokens)
            self._meters.calls_ok.inc()
            self._add_usage(completion, spent)
            return completion

        before = Usage()
        before.add(spent)
        try:
            return await call_with_retries(
                attempt, policy=self._policy, deadline=self._deadline, on_retry=self._on_retry
            )
        finally:
            # The delivery spent what this call spent, answered or not.
            self.usage.add(_minus(spent, before))

    def _add_usage(self, completion: Completion, spent: Usage) -> None:
        spent.prompt_tokens += completion.prompt_tokens
        spent.completion_tokens += completion.completion_tokens
        if completion.prompt_tokens:
            self._meters.prompt_tokens.inc(completion.prompt_tokens)
        if completion.completion_tokens:
            self._meters.completion_tokens.inc(completion.completion_tokens)

    async def _on_retry(self, event: RetryEvent) -> None:
        # Off the hot path (a failure and a backoff came first): labels() is fine.
        MODEL_RETRIES.labels(workflow=self._meters.workflow, reason=event.reason).inc()


def _minus(after: Usage, before: Usage) -> Usage:
    return Usage(
        after.prompt_tokens - before.prompt_tokens,
        after.completion_tokens - before.completion_tokens,
        after.model_calls - before.model_calls,
        after.model_ms - before.model_ms,
    )


def _checkpoint(step: str | None) -> str:
    return "model" if step is None else check_name(step)


def _messages(user: str, system: str | None) -> list[Message]:
    if system is None:
        return [Message("user", user)]
    return [Message("system", system), Message("user", user)]


@functools.cache
def response_schema(result: type[BaseModel]) -> ResponseSchema:
    """The structured-output request for ``result``, worked out once per class."""
    return ResponseSchema(name=result.__name__, schema=result.model_json_schema())


def short_errors(exc: ValidationError) -> str:
    """Where and why an answer failed validation, without quoting the answer."""
    details = exc.errors(include_url=False, include_context=False, include_input=False)
    parts = [
        f"{'.'.join(str(part) for part in error['loc']) or '<answer>'}: {error['msg']}"
        for error in details[:_ERRORS_SHOWN]
    ]
    if len(details) > _ERRORS_SHOWN:
        parts.append(f"and {len(details) - _ERRORS_SHOWN} more")
    text = "; ".join(parts)
    return text if len(text) <= _ERROR_CHARS else text[: _ERROR_CHARS - 1] + "…"


@dataclass(frozen=True)
class _Meters:
    """One (workflow, model)'s metric children, bound once: a labels() lookup
    per model call shows up in profiles."""

    workflow: str
    calls_ok: Counter
    calls_transient: Counter
    calls_permanent: Counter
    prompt_tokens: Counter
    completion_tokens: Counter
    invalid_outputs: Counter
    seconds: Histogram

    def failed(self, exc: BaseException) -> Counter:
        """The outcome child for a failed attempt. One cut off by its wall-clock
        timeout arrives here as a cancellation: made, maybe paid for, and tried
        again (in process or by redelivery), so transient like any timeout."""
        if isinstance(exc, asyncio.CancelledError) or classify(exc):
            return self.calls_transient
        return self.calls_permanent


@functools.cache
def _meters(workflow: str, model: str) -> _Meters:
    def calls(outcome: str) -> Counter:
        return MODEL_CALLS.labels(workflow=workflow, model=model, outcome=outcome)

    def tokens(kind: str) -> Counter:
        return MODEL_TOKENS.labels(workflow=workflow, model=model, kind=kind)

    return _Meters(
        workflow=workflow,
        calls_ok=calls("ok"),
        calls_transient=calls("transient"),
        calls_permanent=calls("permanent"),
        prompt_tokens=tokens("prompt"),
        completion_tokens=tokens("completion"),
        invalid_outputs=MODEL_INVALID_OUTPUTS.labels(workflow=workflow, model=model),
        seconds=MODEL_CALL_SECONDS.labels(workflow=workflow, model=model),
    )
