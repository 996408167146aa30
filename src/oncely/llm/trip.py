"""A call's trip down its route, every attempt accounted for
(docs/model-routing.md).

A call goes down its route (``oncely.llm.routing``): the primary model,
then each fallback in turn once the one before has used up its retries on a
transient failure, skipping models the fleet has cooling down. A permanent
failure ends the call where it is. Each model of the route is a ``Target``:
its name and the adapter of its dialect (``chat``, ``responses``,
``anthropic``; one adapter module each, e.g. ``oncely.llm.openai_compat``),
so a route may mix providers.

A ``responses`` attempt whose time is longer than the route's
``background_s`` goes in background mode (docs/providers.md, Background
calls): the response's id is kept as an ``intent`` checkpoint in the model
call's scope (``model/response``, ``model/response#2`` for the next such
attempt), written before the attempt waits, with the ledger's name for the
call's ``sent`` row. A delivery after a crash reaches the same intent and
re-attaches to the response by its id instead of asking again; its row
replaces the ``sent`` one the crashed delivery left, so the ledger counts
one call.

Every attempt counts: in the delivery's ``Usage``, in the model metrics
labelled by workflow and model, and, when it reached a provider, as a row
of the usage ledger (``oncely.usage.ledger``) with its dialect and cost. An
answer the provider's account cannot pay for (``ProviderQuota``) ends the
call at once and never counts against the model's cooldown: one log line
(``model.provider_quota``) and ``oncely_model_provider_quota_total`` say so.
A refusal (``Refused``) ends it too, recorded as ``refused``.

A call on the ``flex`` lane (docs/lanes.md) goes to each model whose
adapter takes it (OpenAI's ``chat`` and ``responses``: ``Target.lanes``)
with ``service_tier: "flex"`` and the route's longer ``flex_timeout_s``
per attempt; once its retries there are used on a 429 (the flex tier out
of capacity), the same model is asked again at the standard tier, with its
own retries, before the route moves on (``model.flex_fallback``,
``oncely_model_flex_fallbacks_total``). Every attempt's ledger row names
its lane, priced at that lane's price.

A call on the ``batch`` lane whose primary model's adapter takes it
(``chat``, ``responses``, ``anthropic``) and that has a job goes through
the provider's batch API (``oncely.llm.batches``): its line's intent
stored with its ``custom_id`` (``oncely.llm.lines.line_id`` of its job
and its checkpoint key, ``#n`` after the key for a structured call's n-th
ask), its tokens held in the tenant's budget at each look,
then the job waits holding no slot (``ResumeLater``) until a look finds
the line answered; that answer is the call's, recorded on lane ``batch``.
A failed line is classified as any call: transient, it goes in the next
batch; permanent, the call fails. Any other call on the batch lane (a
shadow run, a stream, a dialect without a batch API) goes standard.

This is the only part of the model seam that imports the ledger, the
cooldown and the fleet limiter; the step's face is ``oncely.llm.model``.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass, replace
from typing import TYPE_CHECKING

import structlog
from prometheus_client import Counter, Histogram

from oncely import tracing
from oncely.errors import (
    FleetLimited,
    OncelyError,
    ProviderQuota,
    Refused,
    ResumeLater,
    TransientError,
)
from oncely.journal import Journal, asked_digest, current_checkpoint
from oncely.llm import wire
from oncely.llm.base import (
    FLEX_TIER,
    LLM,
    Background,
    Completion,
    Message,
    Reasoning,
    ResponseSchema,
    ToolChoice,
    ToolSpec,
    call_options,
)
from oncely.llm.lines import line_answer, line_body, line_id
from oncely.llm.reply import Usage
from oncely.llm.routing import Caller, Target, max_tokens_of
from oncely.metrics import (
    MODEL_CALL_SECONDS,
    MODEL_CALLS,
    MODEL_COST,
    MODEL_FLEX_FALLBACKS,
    MODEL_INVALID_OUTPUTS,
    MODEL_PROVIDER_QUOTA,
    MODEL_RETRIES,
    MODEL_TOKENS,
)
from oncely.retry import Deadline, RetryEvent, RetryPolicy, call_with_retries, classify
from oncely.usage.calls import Call, CallSite, Lane, Outcome, Sending
from oncely.usage.prices import Prices

if TYPE_CHECKING:
    from oncely.live.events import LiveJob
    from oncely.llm.batches import BatchLines
    from oncely.llm.cooldown import Cooldown
    from oncely.usage.ledger import Ledger

log = structlog.get_logger("oncely.llm.model")


@dataclass(frozen=True)
class Request:
    """What one call asks: the conversation, and structured output or tools."""

    messages: Sequence[Message]
    schema: ResponseSchema | None = None
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice | None = None
    # Its tokens go to the job's live stream as they come.
    streamed: bool = False
    # How hard a reasoning model thinks (``responses`` only; the other
    # dialects are not sent it: docs/providers.md).
    reasoning: Reasoning | None = None
    # How it goes (docs/lanes.md); None: the route's lane. Not part of what
    # it asks: a replay on another lane asks the same question.
    lane: Lane | None = None

    def digest(self) -> str:
        """What the call asks, as a digest its checkpoint keeps: a replay
        asked with another conversation, tools, schema or reasoning effort
        is told apart."""
        asked = [
            [[m.role, m.content, [list(astuple(t)) for t in m.tool_calls], m.tool_call_id]
             for m in self.messages],
            None if self.schema is None else [self.schema.name, self.schema.schema],
            [[t.name, t.description, t.parameters] for t in self.tools],
            self.tool_choice,
        ]  # fmt: skip
        if self.reasoning is not None:
            asked.append(self.reasoning)
        return asked_digest(asked)

    async def send(
        self,
        target: Target,
        timeout_s: float,
        on_text: Callable[[str], None] | None = None,
        background: Background | None = None,
        lane: Lane = "standard",
    ) -> Completion:
        """Ask ``target``; tools and streaming only when asked for, the
        reasoning effort and background mode only to the dialect that takes
        them, the flex tier on the ``flex`` lane (only ever given a dialect
        that takes it: ``Trip``)."""
        takes = target.dialect == _BACKGROUND_DIALECT
        extra = call_options(
            self.tools,
            self.tool_choice,
            on_text,
            self.reasoning if takes else None,
            background if takes else None,
            FLEX_TIER if lane == "flex" else None,
        )
        return await target.llm.complete(self.messages, timeout_s, schema=self.schema, **extra)


@dataclass(frozen=True)
class ModelRoute:
    """What every delivery's model gets from its worker: the models after
    its primary, the fleet's cooldown, the ledger its calls go to, and what
    they cost (``prices``; default: the ledger's, else unknown).
    ``background_s``: a ``responses`` attempt with more time than this goes
    in background mode (ONCELY_LLM_BACKGROUND_S; 0: never). ``lane``: the
    lane of a call that names none (the workflow's, docs/lanes.md);
    ``flex_timeout_s``: a flex attempt's time (ONCELY_LLM_FLEX_TIMEOUT_S)."""

    fallbacks: tuple[Target, ...] = ()
    cooldown: Cooldown | None = None
    ledger: Ledger | None = None
    prices: Prices | None = None
    background_s: float = 0.0
    lane: Lane = "standard"
    flex_timeout_s: float = 900.0
    # Where batch-lane calls' lines go (None: the batch lane goes standard).
    batches: BatchLines | None = None

    def pricing(self) -> Prices:
        if self.prices is not None:
            return self.prices
        return self.ledger.prices if self.ledger is not None else Prices()


@dataclass(frozen=True)
class Answer:
    """A call's answer and what the ledger records of it once its caller
    knows whether the answer was usable."""

    completion: Completion
    model: str
    step: str | None
    attempt: int
    latency_ms: int
    sent: Sending | None = None
    lane: Lane = "standard"
    # A batch line's ledger id (``oncely.llm.batches.Line.call_id``).
    call_id: str | None = None


@dataclass
class _Tried:
    """One model's attempts so far in a call, and the probe it carries (the
    cooldown's token, spent by the first attempt that fails)."""

    probe: str
    attempts: int = 0


class _Skipped(OncelyError):
    """The model began cooling down between two attempts: the call moves on
    down the route. Neither transient nor permanent, so the retry loop hands
    it straight back."""


class Trip:
    """One delivery's calls down the route that starts at ``llm``
    (``model_name``) and goes on with ``route``'s fallbacks, each attempt
    counted in ``usage`` (the delivery's), the metrics and the ledger, for
    ``site``."""

    def __init__(
        self,
        llm: LLM,
        *,
        policy: RetryPolicy,
        deadline: Deadline,
        workflow: str,
        model_name: str,
        usage: Usage,
        route: ModelRoute | None = None,
        site: CallSite | None = None,
        journal: Journal | None = None,
    ) -> None:
        self.usage = usage
        route = route or ModelRoute()
        # Where a background call's response id is kept (none: never in
        # background mode), and whether its job was cancelled (``cancelled_when``).
        self._journal = journal
        self._background_s = route.background_s
        self._lane = route.lane
        self._flex_timeout_s = route.flex_timeout_s
        self._batches = route.batches
        # Each checkpoint's batch-lane asks so far (a structured call's re-asks).
        self._batch_asks: dict[str, int] = {}
        self._job_cancelled: Callable[[], bool] = _never
        self._route = (Target(model_name, llm), *route.fallbacks)
        # Each model's metric children, bound once (a labels() lookup per
        # call shows up in profiles).
        self._meters = {t.name: _meters(workflow, t.name) for t in self._route}
        # Each model's dialect, for its ledger rows.
        self._dialects = {t.name: t.dialect for t in self._route}
        self._policy = policy
        self._deadline = deadline
        self._workflow = workflow
        self._cooldown = route.cooldown
        self._ledger = route.ledger
        self._prices = route.pricing()
        self._site = site or CallSite(workflow)
        # Where streamed calls' tokens go (``stream_to``): none by default.
        self._live: LiveJob | None = None
        self._delivery = 1
        # Whose calls these are, for the cooldown: a job's failures count once.
        self._caller = Caller(self._site.job_id or f"delivery:{id(self):x}", self._site.tenant)

    def stream_to(self, live: LiveJob, *, delivery: int = 1) -> None:
        """Streamed calls' tokens go to ``live`` (``Model.stream_to``)."""
        self._live = live
        self._delivery = delivery

    def cancelled_when(self, cancelled: Callable[[], bool]) -> None:
        """``cancelled()`` says whether the delivery's job was cancelled: a
        background response it waits for is then cancelled at the provider."""
        self._job_cancelled = cancelled

    def invalid_output(self, model: str) -> None:
        """An answer of ``model`` failed validation (``structured``)."""
        self._meters[model].invalid_outputs.inc()

    def lane_of(self, request: Request) -> Lane:
        """The lane ``request`` goes on: its own, else the route's."""
        return self._lane if request.lane is None else request.lane

    async def ask(self, request: Request, spent: Usage) -> Answer:
        """One answer, down the route: each model with transient retries
        under the delivery's deadline, the next once they are used up, the
        ones the fleet has cooling down skipped. Raises a permanent failure
        at once, and the last transient one when no model is left. On the
        flex lane, each model that takes it is asked at the flex tier, then
        at the standard one once the flex tier's retries met no capacity
        (module doc)."""
        lane = self.lane_of(request)
        if lane == "batch":
            batched = await self._ask_batch(request, spent)
            if batched is not None:
                return batched
            lane = "standard"
        return await self._down_the_route(request, spent, lane)

    async def _down_the_route(self, request: Request, spent: Usage, lane: Lane) -> Answer:
        """``ask`` on the ``standard`` or ``flex`` lane."""
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
                return await self._ask_model(target, probe, request, spent, lane)
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
        # The job waits until a model's cooldown ends or wants its probe:
        # the worker lets it out then; the cooldown's length is the most.
        cooldown = self._cooldown
        raise ResumeLater(
            "every model of the route is cooling down",
            resume_in_s=max(wait_s or 0.0, cooldown.policy.cooldown_s if cooldown else 1.0),
            models=tuple(target.name for target in self._route),
            scope=self._caller.scope,
        )

    async def _ask_batch(self, request: Request, spent: Usage) -> Answer | None:
        """The call's answer through its line of a batch (module doc); None
        when the batch lane cannot take it. Raises ``ResumeLater`` while it
        waits, a failed line's error once it is the call's."""
        target = self._route[0]
        lines, job_id = self._batches, self._site.job_id
        if lines is None or job_id is None or request.streamed or "batch" not in target.lanes:
            return None
        step = current_checkpoint() or "model"
        asks = self._batch_asks[step] = self._batch_asks.get(step, 0) + 1
        key = step if asks == 1 else f"{step}#{asks}"
        custom_id = line_id(job_id, key, target.dialect)
        line = await lines.line(custom_id)
        waiting = ResumeLater("waiting for its batch", resume_in_s=lines.poll_s)
        if line is None or line.status not in ("answered", "failed"):
            await self._hold_budget(job_id, request)
        if line is None:
            body = line_body(
                target.dialect,
                target.name,
                request.messages,
                request.schema,
                request.tools,
                request.tool_choice,
                max_tokens=max_tokens_of(target.llm),
            )
            await lines.intend(
                custom_id,
                job_id=job_id,
                key=key,
                workflow=self._workflow,
                tenant=self._site.tenant,
                model=target.name,
                dialect=target.dialect,
                body=body,
            )
            raise waiting
        if line.status == "dropped":
            await lines.retry(custom_id)
            raise waiting
        if line.status not in ("answered", "failed"):
            raise waiting
        spent.model_calls += 1
        self.usage.model_calls += 1
        number, took = spent.model_calls, round(line.waited_s * 1000)
        meters = self._meters[target.name]
        try:
            if line.status == "failed":
                error = line.error or {}
                status = error.get("status")
                raise wire.status_error(
                    status if isinstance(status, int) else 500, error.get("code"), {}
                )
            completion = line_answer(target.dialect, line.answer)
        except OncelyError as exc:
            meters.failed(exc).inc()
            tokens = (exc.prompt_tokens, exc.completion_tokens) if isinstance(exc, Refused) else ()
            self._record(target.name, step, number, _outcome(exc), *(tokens or (0, 0)), took,
                         lane="batch", call_id=line.call_id)  # fmt: skip
            if classify(exc):
                await lines.retry(custom_id)
                raise waiting from exc
            raise
        meters.calls_ok.inc()
        return Answer(completion, target.name, step, number, took, None, "batch", line.call_id)

    async def _hold_budget(self, job_id: str, request: Request) -> None:
        """A waiting line's tokens held in its tenant's budget (the job's
        hold, renewed at each look: a batch may outlast the hold its job
        got at intake); the answer's spend releases it, as any call's.
        Refused or not, the line is out: an accepted job still runs."""
        budgets = self._ledger.budgets if self._ledger is not None else None
        if budgets is None or not budgets.limits.enabled or not self._site.tenant:
            return
        size = sum(len(m.content) for m in request.messages)
        await budgets.reserve(self._site.tenant, job_id, budgets.estimate(size))

    async def _ask_model(
        self, target: Target, probe: str, request: Request, spent: Usage, lane: Lane
    ) -> Answer:
        """One model's answer: on the flex lane at its flex tier first when
        it takes it, then at the standard one if that had no capacity."""
        if lane == "flex" and "flex" in target.lanes:
            try:
                return await self._ask_one(target, probe, request, spent, "flex")
            except Exception as exc:
                if not _no_capacity(exc):
                    raise
            # The flex attempts answered the probe, if any (``_failed``).
            self._flex_fallback(target.name)
            probe = ""
        return await self._ask_one(target, probe, request, spent)

    async def _ask_one(
        self,
        target: Target,
        probe: str,
        request: Request,
        spent: Usage,
        lane: Lane = "standard",
    ) -> Answer:
        """One model's answer on ``lane`` (``standard`` or ``flex``), with
        transient retries; every attempt that reached the provider and
        failed is in the ledger (the answered one is the caller's to
        record)."""
        step = current_checkpoint()
        tried = _Tried(probe)

        async def attempt(timeout_s: float) -> Answer:
            tried.attempts += 1
            cooldown = self._cooldown
            if (
                tried.attempts > 1
                and cooldown is not None
                and cooldown.cooling(target.name, self._caller)
            ):
                raise _Skipped(target.name)
            answer = await self._attempt(target, request, spent, step, lane, timeout_s, tried)
            await self._answered(answer, tried.probe)
            return answer

        policy, useful_s = self._lane_policy(lane)
        return await call_with_retries(
            attempt,
            policy=policy,
            deadline=self._deadline,
            on_retry=self._on_retry,
            min_attempt_s=useful_s,
        )

    async def _attempt(
        self,
        target: Target,
        request: Request,
        spent: Usage,
        step: str | None,
        lane: Lane,
        timeout_s: float,
        tried: _Tried,
    ) -> Answer:
        """One attempt in a client span of its own (GenAI semantic
        conventions): counted, sent; a failure timed, metered and in the
        ledger, after which the probe is spent."""
        meters = self._meters[target.name]
        spent.model_calls += 1
        self.usage.model_calls += 1
        number = spent.model_calls
        started = time.monotonic()
        with tracing.span(
            f"chat {target.name}",
            kind="client",
            attributes={
                "gen_ai.operation.name": "chat",
                "gen_ai.request.model": target.name,
                "oncely.attempt": self.usage.model_calls,
            },
        ) as span:
            sent = self._sending(target.name, step, number, lane)
            try:
                completion = await self._send(request, target, timeout_s, step, number, sent, lane)
            except (Exception, asyncio.CancelledError) as exc:
                took = _elapsed_ms(started)
                self._count_ms(spent, took)
                meters.failed(exc).inc()
                # Cut off by its attempt's time (a cancellation here), or
                # cancelled from outside: a job's cancel, a shutdown, a
                # sibling branch. Only the first says the model is slow.
                timed_out = took >= timeout_s * 1000 * _CUT_OFF_SHARE
                await self._failed(
                    target.name, step, number, exc, took, tried.probe, timed_out, sent, lane
                )
                tried.probe = ""
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
        return Answer(completion, target.name, step, number, took, sent, lane)

    async def _answered(self, answer: Answer, probe: str) -> None:
        """The cooldown told the model answered (a probe's answer ends its
        cooling). Cancelled with its job before its caller got it: paid
        for, its answer lost (the ledger's ``timeout``)."""
        if self._cooldown is None:
            return
        try:
            await self._cooldown.answered(answer.model, self._caller, probe=probe)
        except BaseException:
            self.bill(answer, "timeout", Usage())
            raise

    def _lane_policy(self, lane: Lane) -> tuple[RetryPolicy, float | None]:
        """The retry policy of a call on ``lane``, and the least time an
        attempt is still worth making with (None: any). A flex attempt
        gets up to the flex timeout, within the deadline; one is still
        worth making with what a standard attempt would need."""
        policy = self._policy
        if lane != "flex":
            return policy, None
        longer = max(policy.per_call_timeout_s, self._flex_timeout_s)
        useful_s = policy.per_call_timeout_s * _USEFUL_SHARE
        return replace(policy, per_call_timeout_s=longer), useful_s

    def _flex_fallback(self, model: str) -> None:
        """The flex tier had no capacity for a call through its retries: it
        goes on at the standard tier."""
        MODEL_FLEX_FALLBACKS.labels(workflow=self._workflow, model=model).inc()
        log.info("model.flex_fallback", workflow=self._workflow, model=model)

    async def _send(
        self,
        request: Request,
        target: Target,
        timeout_s: float,
        step: str | None,
        attempt: int,
        sent: Sending | None = None,
        lane: Lane = "standard",
    ) -> Completion:
        """One attempt (the call's ``attempt``-th, fallbacks included) on
        ``lane``; a streamed one's tokens to the live stream; a long
        ``responses`` one in background mode."""
        background = self._background(target, timeout_s, sent, request)
        if not request.streamed or self._live is None:
            return await request.send(target, timeout_s, background=background, lane=lane)
        # A stored background response goes on where its text reached the
        # view: no reset, and no piece streamed twice.
        after = None
        if background is not None and background.stored is not None:
            after = await self._live.streamed_to(step, background.name)
        reset = after is None and (attempt > 1 or self._delivery > 1)
        tokens = self._live.tokens(step, attempt, reset=reset, delivery=self._delivery)
        if background is not None:
            tokens.response = background.name
            background = replace(background, after=after, seen=tokens.mark)
        try:
            return await request.send(target, timeout_s, tokens.feed, background, lane=lane)
        finally:
            tokens.flush()

    def _background(
        self, target: Target, timeout_s: float, sent: Sending | None, request: Request
    ) -> Background | None:
        """Background mode for an attempt that takes it (module doc): its
        intent reached now, in the model call's scope; the id a delivery
        before this one kept there, if it kept one for this model."""
        journal = self._journal
        if (
            journal is None
            or self._background_s <= 0
            or timeout_s <= self._background_s
            or target.dialect != _BACKGROUND_DIALECT
        ):
            return None
        reached = journal.reach(_INTENT, "intent")
        asked = request.digest()
        kept = reached.stored.value if reached.stored is not None else None
        same = reached.stored is not None and reached.stored.request in (None, asked)
        stored: str | None = None
        if same and isinstance(kept, dict) and kept.get("model") == target.name:
            stored = kept.get("id") if isinstance(kept.get("id"), str) else None
            if sent is not None and isinstance(kept.get("call_id"), str):
                # This attempt's row replaces the ``sent`` one the delivery
                # that created the response left: one call in the ledger.
                sent.call_id = kept["call_id"]
        if sent is not None and sent.call_id is None:
            sent.call_id = str(uuid.uuid4())
        call_id = sent.call_id if sent is not None else None
        started = time.monotonic()

        async def keep(response_id: str) -> None:
            value = {"id": response_id, "model": target.name, "call_id": call_id}
            if reached.stored is None:  # else kept for another model or question: not re-attached
                await journal.intend(_INTENT, asked, value=value, reached=reached)

        def cancels() -> bool:
            cut_off = time.monotonic() - started >= timeout_s * _CUT_OFF_SHARE
            return cut_off or self._job_cancelled()

        return Background(stored, keep, cancels, name=reached.key)

    def _sending(
        self, model: str, step: str | None, attempt: int, lane: Lane = "standard"
    ) -> Sending | None:
        """The call in the ledger from now on (a ``sent`` row until it ends)."""
        if self._ledger is None:
            return None
        dialect = self._dialects.get(model, "chat")
        return self._ledger.sending(self._site, step, model, attempt, dialect, lane)

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
        lane: Lane = "standard",
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
        tokens = (exc.prompt_tokens, exc.completion_tokens) if isinstance(exc, Refused) else (0, 0)
        self._record(model, step, attempt, outcome, *tokens, took_ms, sent=sent, lane=lane)
        if isinstance(exc, ProviderQuota):
            # Permanent, so never against the cooldown below: a dry account
            # says nothing of the model's health (docs/providers.md).
            _dry_account(self._workflow, model, exc)
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

    def bill(self, answer: Answer, outcome: Outcome, spent: Usage) -> None:
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
            (completion.cached_tokens, completion.reasoning_tokens, completion.cache_write_tokens),
            answer.sent,
            answer.lane,
            answer.call_id,
        )
        for usage in (spent, self.usage):
            usage.prompt_tokens += completion.prompt_tokens
            usage.completion_tokens += completion.completion_tokens
            usage.cached_tokens += completion.cached_tokens
            usage.reasoning_tokens += completion.reasoning_tokens
            usage.cache_write_tokens += completion.cache_write_tokens
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
        details: tuple[int, int, int] = (0, 0, 0),
        sent: Sending | None = None,
        lane: Lane = "standard",
        call_id: str | None = None,
    ) -> float | None:
        """The call's row in the ledger, in place of its ``sent`` one; what
        it cost on its ``lane`` (None: unknown). ``details``: its cached,
        reasoning and cache-write tokens; ``call_id``: a row written once
        however often it is recorded (a batch line's answer)."""
        tokens = (prompt_tokens, completion_tokens, details[0], details[2])
        cost = self._prices.cost(model, *tokens, lane=lane)
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
                cache_write_tokens=details[2],
                dialect=self._dialects.get(model, "chat"),
                cache_saved_usd=self._prices.cache_saved(
                    model, prompt_tokens, details[0], details[2], lane
                ),
                lane=lane,
                lane_saved_usd=(None if cost is None else 0.0)
                if lane == "standard"
                else self._prices.lane_saved(model, lane, *tokens),
                call_id=call_id,
            ),
            sent,
        )
        return cost

    async def _on_retry(self, event: RetryEvent) -> None:
        # Off the hot path (a failure and a backoff came first): labels() is fine.
        MODEL_RETRIES.labels(workflow=self._workflow, reason=event.reason).inc()


# Of a standard attempt's time, what a flex attempt needs left to be made
# (as ``oncely.retry`` asks of any attempt).
_USEFUL_SHARE = 0.25
# An attempt that failed after this share of its time was cut off by it.
_CUT_OFF_SHARE = 0.95
# The dialect with background calls and reasoning effort, and the intent a
# background call keeps its response id in.
_BACKGROUND_DIALECT = "responses"
_INTENT = "response"


def _never() -> bool:
    return False


def _no_capacity(exc: BaseException) -> bool:
    """A flex call's last failure said the flex tier had no capacity: a
    transient 429 (an account that cannot pay is ``ProviderQuota``,
    permanent, and never falls back)."""
    return isinstance(exc, TransientError) and exc.status == 429


def _outcome(exc: BaseException) -> Outcome:
    """A failed call's ledger outcome. Cut off by its wall-clock timeout (a
    cancellation here) or cancelled with its job: made, maybe paid for, its
    answer lost."""
    if isinstance(exc, TimeoutError | asyncio.CancelledError):
        return "timeout"
    if isinstance(exc, Refused):
        return "refused"
    return "retryable" if classify(exc) else "permanent"


def _dry_account(workflow: str, model: str, exc: ProviderQuota) -> None:
    """One line and the alert metric for a call the account could not pay."""
    MODEL_PROVIDER_QUOTA.labels(model=model).inc()
    log.error(
        "model.provider_quota",
        workflow=workflow,
        model=model,
        status=exc.status,
        action="the provider account's credit or spend limit is exhausted: add credit or"
        " raise the limit; the job is dead (provider-quota), the model not cooled down",
    )


def _elapsed_ms(started: float) -> int:
    return round((time.monotonic() - started) * 1000)


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
