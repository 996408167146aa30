"""What a workflow step gets as ``ctx.model``: the model under the delivery's
deadline and retry policy, counted per workflow.

Every call is a checkpoint of the job's run (``oncely.journal``): key
``model`` (then ``model#2``, …) or the ``step=`` name given. A call that
answered is stored with the job and never paid for again: a replay gets the
stored answer.

A call goes down its route (``oncely.llm.routing``): the primary model,
then each fallback in turn once the one before has used up its retries on a
transient failure, skipping models the fleet has cooling down. A permanent
failure ends the call where it is. The model that answered is recorded with
the checkpoint (``usage.model``).

Every attempt counts: in ``Model.usage`` (what this delivery spent), in the
model metrics labelled by workflow and model, and, when it reached a
provider, as a row of the usage ledger (``oncely.usage.ledger``) with its
cost. ``structured`` asks for JSON valid for a pydantic model and asks again
when the answer does not validate; those re-asks are separate from
transient retries (each gets its own retry loop), and all of them run under
the one deadline.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import structlog
from prometheus_client import Counter, Histogram
from pydantic import BaseModel, ValidationError

from oncely import tracing
from oncely.errors import OncelyError, PermanentError, ResumeLater, TransientError, short_errors
from oncely.journal import Journal, Recorded, check_name, current_checkpoint
from oncely.llm.base import (
    LLM,
    Completion,
    Message,
    ResponseSchema,
    ToolChoice,
    ToolRequest,
    ToolSpec,
    call_options,
)
from oncely.llm.cooldown import Caller, Cooldown
from oncely.llm.limiter import FleetLimited
from oncely.llm.routing import Target
from oncely.metrics import (
    MODEL_CALL_SECONDS,
    MODEL_CALLS,
    MODEL_COST,
    MODEL_INVALID_OUTPUTS,
    MODEL_RETRIES,
    MODEL_TOKENS,
)
from oncely.retry import Deadline, RetryEvent, RetryPolicy, call_with_retries, classify
from oncely.usage.ledger import Call, CallSite, Ledger, Outcome, Sending
from oncely.usage.prices import Prices

if TYPE_CHECKING:
    from oncely.live.events import LiveJob

M = TypeVar("M", bound=BaseModel)

log = structlog.get_logger(__name__)


@dataclass
class Usage:
    """What one delivery spent on the model: attempts made, tokens reported,
    the wall-clock time spent in model calls (``model_ms``, what shadow
    reports compare), the cost (``cost_usd``, None once a call's model has
    no price) and the model that answered last. Equality compares the
    counts that do not vary between two runs of the same work: not the
    time, the cost or the model."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    model_calls: int = 0
    model_ms: int = field(default=0, compare=False)
    # Of the prompt tokens, those the provider served from its cache; of
    # the completion tokens, those spent reasoning (reported by some only).
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    cost_usd: float | None = field(default=0.0, compare=False)
    model: str | None = field(default=None, compare=False)

    def to_json(self) -> dict[str, Any]:
        found: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "model_calls": self.model_calls,
            "model_ms": self.model_ms,
            "cost_usd": None if self.cost_usd is None else round(self.cost_usd, 10),
            "model": self.model,
        }
        if self.cached_tokens:
            found["cached_tokens"] = self.cached_tokens
        if self.reasoning_tokens:
            found["reasoning_tokens"] = self.reasoning_tokens
        return found

    def add_cost(self, cost: float | None) -> None:
        self.cost_usd = None if self.cost_usd is None or cost is None else self.cost_usd + cost


@dataclass(frozen=True)
class ToolCall:
    """A tool the model asked to call: ``arguments`` as a dict, or, when the
    provider sent something that is not a JSON object, None with what it
    sent in ``malformed`` (cut short): the caller answers the model with an
    error instead of failing. ``raw_arguments`` is the text as sent."""

    id: str
    name: str
    arguments: dict[str, Any] | None
    raw_arguments: str = ""
    malformed: str | None = None

    @classmethod
    def of(cls, request: ToolRequest) -> ToolCall:
        try:
            parsed = json.loads(request.arguments or "{}")
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            shown = request.arguments[:_MALFORMED_CHARS]
            return cls(request.id, request.name, None, request.arguments, shown or "(nothing)")
        return cls(request.id, request.name, parsed, request.arguments)


@dataclass(frozen=True)
class Reply:
    """One model turn (``ctx.model.respond``): its ``text``, the
    ``tool_calls`` it asked for, and ``usage`` (what the turn spent, its
    retries and fallbacks included)."""

    text: str
    tool_calls: tuple[ToolCall, ...] = ()
    usage: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """What the turn's checkpoint stores."""
        return {
            "text": self.text,
            "tool_calls": [
                {"id": c.id, "name": c.name, "arguments": c.raw_arguments} for c in self.tool_calls
            ],
            "usage": self.usage,
        }

    @classmethod
    def from_json(cls, value: Any) -> Reply:
        """A stored turn, read as the turn that was answered."""
        requests = [ToolRequest(c["id"], c["name"], c["arguments"]) for c in value["tool_calls"]]
        calls = tuple(ToolCall.of(r) for r in requests)
        return cls(value["text"], calls, dict(value.get("usage") or {}))


def conversation(messages: Sequence[Mapping[str, Any]]) -> list[Message]:
    """OpenAI-style message dicts as the model seam's messages; ValueError
    for a message that is none of system, user, assistant, tool."""
    found = []
    for message in messages:
        role = message.get("role")
        content = message.get("content") or ""
        if not isinstance(content, str):
            content = json.dumps(content)
        if role == "tool":
            found.append(Message("tool", content, tool_call_id=str(message.get("tool_call_id"))))
        elif role == "assistant":
            calls = tuple(_tool_request(c) for c in message.get("tool_calls") or ())
            found.append(Message("assistant", content, tool_calls=calls))
        elif role in ("system", "user"):
            found.append(Message(role, content))
        else:
            raise ValueError(f"a message's role must be system, user, assistant or tool: {role!r}")
    return found


def _tool_request(call: Mapping[str, Any]) -> ToolRequest:
    function = call.get("function") or {}
    arguments = function.get("arguments", "")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    return ToolRequest(str(call.get("id")), str(function.get("name")), arguments)


def _tool_spec(spec: ToolSpec | Mapping[str, Any]) -> ToolSpec:
    if isinstance(spec, ToolSpec):
        return spec
    return ToolSpec(str(spec["name"]), str(spec.get("description", "")), spec["parameters"])


@dataclass(frozen=True)
class _Request:
    """What one call asks: the conversation, and structured output or tools."""

    messages: Sequence[Message]
    schema: ResponseSchema | None = None
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice | None = None
    # Its tokens go to the job's live stream as they come.
    streamed: bool = False

    async def send(
        self, llm: LLM, timeout_s: float, on_text: Callable[[str], None] | None = None
    ) -> Completion:
        """Ask ``llm``; tools and streaming only when asked for."""
        extra = call_options(self.tools, self.tool_choice, on_text)
        return await llm.complete(self.messages, timeout_s, schema=self.schema, **extra)


# How much of a tool call's arguments that are not JSON the model is shown.
_MALFORMED_CHARS = 200


class InvalidOutput(PermanentError):
    """Every answer failed validation against the step's result model.
    ``errors`` is a short form of the last validation error."""

    def __init__(self, result: str, errors: str, *, asks: int) -> None:
        super().__init__(f"{result}: no valid answer in {asks} asks: {errors}")
        self.errors = errors


@dataclass(frozen=True)
class ModelRoute:
    """What every delivery's model gets from its worker: the models after
    its primary, the fleet's cooldown, the ledger its calls go to, and what
    they cost (``prices``; default: the ledger's, else unknown)."""

    fallbacks: tuple[Target, ...] = ()
    cooldown: Cooldown | None = None
    ledger: Ledger | None = None
    prices: Prices | None = None

    def pricing(self) -> Prices:
        if self.prices is not None:
            return self.prices
        return self.ledger.prices if self.ledger is not None else Prices()


@dataclass(frozen=True)
class _Answer:
    """A call's answer and what the ledger records of it once its caller
    knows whether the answer was usable."""

    completion: Completion
    model: str
    step: str | None
    attempt: int
    latency_ms: int
    sent: Sending | None = None


class _Skipped(OncelyError):
    """The model began cooling down between two attempts: the call moves on
    down the route. Neither transient nor permanent, so the retry loop hands
    it straight back."""


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
        route = route or ModelRoute()
        self._route = (Target(model_name, llm), *route.fallbacks)
        # Each model's metric children, bound once (a labels() lookup per
        # call shows up in profiles).
        self._meters = {t.name: _meters(workflow, t.name) for t in self._route}
        self._policy = policy
        self._deadline = deadline
        self._invalid_output_retries = invalid_output_retries
        self._workflow = workflow
        self._cooldown = route.cooldown
        self._ledger = route.ledger
        self._prices = route.pricing()
        self._site = site or CallSite(workflow)
        # Where streamed calls' tokens go (``stream_to``): none by default.
        self._live: LiveJob | None = None
        self._streaming = False
        self._redelivered = False
        # Whose calls these are, for the cooldown: a job's failures count once.
        self._caller = Caller(self._site.job_id or f"delivery:{id(self):x}", self._site.tenant)

    def stream_to(self, live: LiveJob, *, streaming: bool, redelivered: bool) -> None:
        """Stream calls' tokens to the job's live stream: every call when
        ``streaming`` (``Workflow(stream=True)``), else those asked to
        (``stream=True``). A redelivery's first attempt resets what the
        step streamed before (docs/streaming.md)."""
        self._live = live
        self._streaming = streaming
        self._redelivered = redelivered

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
    ) -> str:
        """The model's answer to ``user`` (after ``system``, when given): the
        checkpoint ``step`` (default ``model``, ``model#2``, …). ``stream``:
        its tokens go to the job's live stream as they come (default: the
        workflow's ``stream``); the checkpoint keeps the whole answer."""
        messages = _messages(user, system)
        request = _Request(messages, streamed=self._streaming if stream is None else stream)

        async def work() -> Recorded[str]:
            spent = Usage()
            answer = await self._ask(request, spent)
            self._bill(answer, "ok", spent)
            text = answer.completion.text
            return Recorded(text, text, spent.to_json())

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

    async def respond(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[ToolSpec | Mapping[str, Any]] = (),
        tool_choice: ToolChoice = "auto",
        output: type[BaseModel] | None = None,
        step: str | None = None,
    ) -> Reply:
        """One turn of a conversation with tools: the model's ``Reply``
        (its text, the tools it calls, what it spent). ``messages`` are
        OpenAI-style dicts (``system``, ``user``, ``assistant`` with
        ``tool_calls``, ``tool`` with ``tool_call_id``); ``tools`` are
        ``ToolSpec``s or ``{"name", "description", "parameters"}``;
        ``output`` asks for a final answer that is JSON of that model's
        schema. The checkpoint ``step`` (default ``model``, ``model#2``, …):
        a turn that answered is never paid for again."""
        request = _Request(
            conversation(messages),
            response_schema(output) if output is not None else None,
            tuple(_tool_spec(t) for t in tools),
            tool_choice if tools else None,
        )

        async def work() -> Recorded[Reply]:
            spent = Usage()
            answer = await self._ask(request, spent)
            self._bill(answer, "ok", spent)
            completion = answer.completion
            calls = tuple(ToolCall.of(r) for r in completion.tool_calls)
            reply = Reply(completion.text, calls, spent.to_json())
            return Recorded(reply.to_json(), reply, spent.to_json())

        return await self.journal.record(_checkpoint(step), "model", work, Reply.from_json)

    async def _structured(self, result: type[M], messages: list[Message], spent: Usage) -> M:
        schema = response_schema(result)
        asks = self._invalid_output_retries + 1
        for ask in range(1, asks + 1):
            answer = await self._ask(_Request(messages, schema), spent)
            try:
                value = result.model_validate_json(answer.completion.text)
            except ValidationError as exc:
                errors = short_errors(exc)
            else:
                self._bill(answer, "ok", spent)
                return value
            self._bill(answer, "invalid_output", spent)
            self._meters[answer.model].invalid_outputs.inc()
            log.info(
                "model.invalid_output",
                workflow=self._workflow,
                model=answer.model,
                result=result.__name__,
                ask=ask,
                errors=errors,
            )
        raise InvalidOutput(result.__name__, errors, asks=asks)

    async def _ask(self, request: _Request, spent: Usage) -> _Answer:
        """One answer, down the route: each model with transient retries
        under the delivery's deadline, the next once they are used up, the
        ones the fleet has cooling down skipped. Raises a permanent failure
        at once, and the last transient one when no model is left."""
        failure: BaseException | None = None
        wait_s: float | None = None
        for target in self._route:
            probe = ""
            if self._cooldown is not None:
                admission = await self._cooldown.admit(target.name, self._caller)
                if admission.verdict == "skip":
                    wait_s = admission.wait_s if wait_s is None else min(wait_s, admission.wait_s)
                    continue
                probe = admission.scope
            try:
                return await self._ask_one(target, probe, request, spent)
            except _Skipped:
                continue
            except Exception as exc:
                if not classify(exc):
                    raise
                failure = exc
            if target is not self._route[-1]:
                log.info(
                    "model.fallback",
                    workflow=self._workflow,
                    model=target.name,
                    reason=type(failure).__name__,
                )
        if isinstance(failure, OncelyError):
            raise failure
        if failure is not None:
            # A timeout or a connection error, as oncely's own transient
            # error: a step that catches it gets a failed checkpoint, and a
            # replay raises it again instead of paying for the call again.
            raise TransientError(f"model call failed: {type(failure).__name__}") from failure
        raise ResumeLater("every model of the route is cooling down", resume_in_s=wait_s or 1.0)

    async def _ask_one(
        self,
        target: Target,
        probe: str,
        request: _Request,
        spent: Usage,
    ) -> _Answer:
        """One model's answer, with transient retries; every attempt that
        reached the provider and failed is in the ledger (the answered one
        is the caller's to record)."""
        meters = self._meters[target.name]
        step = current_checkpoint()
        tries = 0

        async def attempt(timeout_s: float) -> _Answer:
            nonlocal tries, probe
            tries += 1
            cooldown = self._cooldown
            if tries > 1 and cooldown is not None and cooldown.cooling(target.name, self._caller):
                raise _Skipped(target.name)
            spent.model_calls += 1
            self.usage.model_calls += 1
            number = spent.model_calls
            started = time.monotonic()
            # GenAI semantic conventions: one client span per attempt.
            with tracing.span(
                f"chat {target.name}",
                kind="client",
                attributes={
                    "gen_ai.operation.name": "chat",
                    "gen_ai.request.model": target.name,
                    "oncely.attempt": self.usage.model_calls,
                },
            ) as span:
                sent = self._sending(target.name, step, number)
                try:
                    completion = await self._send(request, target, timeout_s, step, tries)
                except (Exception, asyncio.CancelledError) as exc:
                    took = _elapsed_ms(started)
                    self._count_ms(spent, took)
                    meters.failed(exc).inc()
                    # Cut off by its attempt's time (a cancellation here), or
                    # cancelled from outside: a job's cancel, a shutdown, a
                    # sibling branch. Only the first says the model is slow.
                    timed_out = took >= timeout_s * 1000 * _CUT_OFF_SHARE
                    await self._failed(target.name, step, number, exc, took, probe, timed_out, sent)
                    probe = ""
                    raise
                finally:
                    meters.seconds.observe(time.monotonic() - started)
                # Time waiting on the fleet limiter is not the model's.
                took = max(0, _elapsed_ms(started) - round(completion.queued_s * 1000))
                self._count_ms(spent, took)
                if span is not None:
                    span.set_attribute("gen_ai.usage.input_tokens", completion.prompt_tokens)
                    span.set_attribute("gen_ai.usage.output_tokens", completion.completion_tokens)
            meters.calls_ok.inc()
            answer = _Answer(completion, target.name, step, number, took, sent)
            if self._cooldown is not None:
                try:
                    await self._cooldown.answered(target.name, self._caller, probe=probe)
                except BaseException:
                    # Cancelled with its job before its caller got it: paid
                    # for, its answer lost (the ledger's ``timeout``).
                    self._bill(answer, "timeout", Usage())
                    raise
            return answer

        return await call_with_retries(
            attempt, policy=self._policy, deadline=self._deadline, on_retry=self._on_retry
        )

    async def _send(
        self, request: _Request, target: Target, timeout_s: float, step: str | None, tries: int
    ) -> Completion:
        """One attempt; a streamed one's tokens to the live stream."""
        if not request.streamed or self._live is None:
            return await request.send(target.llm, timeout_s)
        tokens = self._live.tokens(step, tries, reset=tries > 1 or self._redelivered)
        try:
            return await request.send(target.llm, timeout_s, tokens.feed)
        finally:
            tokens.flush()

    def _sending(self, model: str, step: str | None, attempt: int) -> Sending | None:
        """The call in the ledger from now on (a ``sent`` row until it ends)."""
        if self._ledger is None:
            return None
        return self._ledger.sending(self._site, step, model, attempt)

    def _count_ms(self, spent: Usage, ms: int) -> None:
        spent.model_ms += ms
        self.usage.model_ms += ms

    async def _failed(
        self,
        model: str,
        step: str | None,
        attempt: int,
        exc: BaseException,
        took_ms: int,
        probe: str,
        timed_out: bool,
        sent: Sending | None = None,
    ) -> None:
        """A failed attempt: in the ledger if it reached the provider, and
        against the model's cooldown if it says the model is unwell: a 5xx,
        a connection, its time running out (oncely.llm.cooldown). Never a
        429 (the limiter paces those) nor a cancellation from outside, which
        say nothing of the model's health; a probe that got either, or a
        permanent answer, found the model up."""
        if isinstance(exc, FleetLimited):
            if sent is not None and self._ledger is not None:
                self._ledger.withdraw(sent)  # held back by the fleet's limits: never sent
            return
        outcome = _outcome(exc)
        self._record(model, step, attempt, outcome, 0, 0, took_ms, sent=sent)
        if self._cooldown is None:
            return
        cancelled = isinstance(exc, asyncio.CancelledError) and not timed_out
        rate_limited = isinstance(exc, TransientError) and exc.status == 429
        if outcome in ("retryable", "timeout") and not (cancelled or rate_limited):
            retry_after = exc.retry_after_s if isinstance(exc, TransientError) else None
            failed = self._cooldown.failed(
                model, self._caller, probe=probe, retry_after_s=retry_after
            )
            await asyncio.shield(failed)
        elif probe and not cancelled:
            await self._cooldown.answered(model, self._caller, probe=probe)

    def _bill(self, answer: _Answer, outcome: Outcome, spent: Usage) -> None:
        """An answered call: its tokens and cost in the usage, the metrics
        and the ledger, and its model as the one that answered."""
        completion = answer.completion
        cost = self._record(
            answer.model,
            answer.step,
            answer.attempt,
            outcome,
            completion.prompt_tokens,
            completion.completion_tokens,
            answer.latency_ms,
            (completion.cached_tokens, completion.reasoning_tokens),
            answer.sent,
        )
        for usage in (spent, self.usage):
            usage.prompt_tokens += completion.prompt_tokens
            usage.completion_tokens += completion.completion_tokens
            usage.cached_tokens += completion.cached_tokens
            usage.reasoning_tokens += completion.reasoning_tokens
            usage.add_cost(cost)
            usage.model = answer.model
        meters = self._meters[answer.model]
        if completion.prompt_tokens:
            meters.prompt_tokens.inc(completion.prompt_tokens)
        if completion.completion_tokens:
            meters.completion_tokens.inc(completion.completion_tokens)
        if cost:
            meters.cost.inc(cost)

    def _record(
        self,
        model: str,
        step: str | None,
        attempt: int,
        outcome: Outcome,
        prompt_tokens: int,
        completion_tokens: int,
        latency_ms: int,
        details: tuple[int, int] = (0, 0),
        sent: Sending | None = None,
    ) -> float | None:
        """The call's row in the ledger, in place of its ``sent`` one; what
        it cost (None: unknown). ``details``: its cached and reasoning tokens."""
        cost = self._prices.cost(model, prompt_tokens, completion_tokens, details[0])
        if self._ledger is None:
            return cost
        self._ledger.record(
            Call(
                self._site,
                step,
                model,
                attempt,
                outcome,
                prompt_tokens,
                completion_tokens,
                latency_ms,
                cost,
                cached_tokens=details[0],
                reasoning_tokens=details[1],
            ),
            sent,
        )
        return cost

    async def _on_retry(self, event: RetryEvent) -> None:
        # Off the hot path (a failure and a backoff came first): labels() is fine.
        MODEL_RETRIES.labels(workflow=self._workflow, reason=event.reason).inc()


# An attempt that failed after this share of its time was cut off by it.
_CUT_OFF_SHARE = 0.95


def _outcome(exc: BaseException) -> Outcome:
    """A failed call's ledger outcome. Cut off by its wall-clock timeout (a
    cancellation here) or cancelled with its job: made, maybe paid for, its
    answer lost."""
    if isinstance(exc, TimeoutError | asyncio.CancelledError):
        return "timeout"
    return "retryable" if classify(exc) else "permanent"


def _elapsed_ms(started: float) -> int:
    return round((time.monotonic() - started) * 1000)


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


@dataclass(frozen=True)
class _Meters:
    """One (workflow, model)'s metric children, bound once: a labels() lookup
    per model call shows up in profiles."""

    calls_ok: Counter
    calls_transient: Counter
    calls_permanent: Counter
    prompt_tokens: Counter
    completion_tokens: Counter
    invalid_outputs: Counter
    cost: Counter
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
        calls_ok=calls("ok"),
        calls_transient=calls("transient"),
        calls_permanent=calls("permanent"),
        prompt_tokens=tokens("prompt"),
        completion_tokens=tokens("completion"),
        invalid_outputs=MODEL_INVALID_OUTPUTS.labels(workflow=workflow, model=model),
        cost=MODEL_COST.labels(workflow=workflow, model=model),
        seconds=MODEL_CALL_SECONDS.labels(workflow=workflow, model=model),
    )
