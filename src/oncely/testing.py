"""Unit-testing a workflow's step: no Redis, no PostgreSQL, no network.

``run_step`` runs a step as a worker would (its model calls, side steps,
waits and sleeps are checkpoints of one run) against a scripted model, and
tells what it did::

    from oncely.testing import ProviderError, run_step

    async def test_an_unclear_refund_waits_for_a_person():
        run = await run_step(
            refunds,
            {"order_id": "A1", "amount_cents": 1200, "reason": "It is odd."},
            answers=[{"decision": "escalate", "note": "unclear"}],
            events={"approval": Approval(approved=True, by="ada")},
        )
        assert run.result.decided_by == "person"
        assert [e.topic for e in run.emitted] == ["refund.approval_requested", "refund.decided"]

- ``answers``: what the model answers, in call order: a string (text), a
  dict, a list or a pydantic model (structured output, sent as its JSON),
  or an exception to raise: ``ProviderError(503)`` (retried, then the next
  model of the workflow's ``fallbacks``), ``ProviderError(400)`` (never
  retried), ``TimeoutError()``. A call with no answer left fails the test.
  Retries and fallbacks take no time.
  ``ToolCalls(("lookup_order", {"order_id": "A1"}), ...)`` is a turn that
  calls those tools (``ctx.model.respond``, an ``oncely.Agent``).
- ``events``: what each ``ctx.wait_for_event`` receives, at once. A wait for
  an event not given times out (the step gets None); sleeps end at once.
- ``calls``: what the receiver of each call topic answers (``ctx.call``, a
  call tool), by topic: the answer's JSON, or ``ProviderError(400)`` (the
  call is refused: ``CallFailed``). A call with no answer scripted fails
  the test.
- ``approvals``: the decision on each approval tool, by tool name: True,
  False, or an ``ApprovalDecision`` (edited arguments, a reason). A tool
  with no decision given times out (``on_approval_timeout`` decides).
- ``uncertain``: what a person decides on each at-most-once call whose
  outcome is unknown (docs/at-most-once.md), by tool or step name:
  ``"resend"``, ``"failed"``, ``{"result": ...}``, ``{"failed": "reason"}``
  or an ``UncertainDecision``. Use it with ``crash_after="<key>/intent"``:
  the run stops after the call ran and before its result is stored, as if
  its worker died mid-call (the effect happened, its result is lost). A
  call asked about with no decision scripted fails the test.
- ``tools``: what a tool answers, by the name the model calls it by,
  in place of running it: its result (JSON: a dict, a list, a string, a
  pydantic model), or an exception it raises
  (``PermanentError("declined")``: the model is told). Any function tool,
  an MCP server's, a framework's; its arguments are still checked against
  its schema, and its checkpoint is stored as a worker stores it (at most
  once: the intent first). A call tool's receiver is scripted with
  ``calls=``.
- ``toolsets``: what an MCP toolset lists, by its ``name=``, instead of
  asking its server: the tools as ``tools/list`` answers them (dicts with
  ``name``, ``inputSchema``, ``annotations``; or a name alone: a tool with
  no annotations, at most once, that takes any object), or ``{"tools":
  [...], "idempotent": True}`` for a server that dedupes on the key. With
  every tool the model calls in ``tools=`` too, no server is needed.
- ``prices``: what the models cost, as ONCELY_LLM_PRICES reads them
  (``"test-model=0.4/1.6"``) or ``Prices``: usage then has a cost, and an
  agent's ``max_cost_usd`` counts it. Unpriced by default.
- ``resume_from=run.until("key")``: the run starts over the checkpoints of
  an earlier run (of this step, or of the step before a deploy), as a job
  in flight would resume: ``ctx.patched`` then says which path it takes.
- ``ctx.map``: the children run in memory, one after another in item
  order, on the same scripted model (their answers come in the script
  after the parent's before the map); ``run.children`` has their runs. A
  child that raises is ``dead`` in the map's results.
- ``crash_after="key"``: the run stops right after checkpoint ``key`` is
  stored, as if its worker died, and runs again from the top as a
  redelivery would, over the stored checkpoints. The test fails
  (``ReplayError``) when the second run pays again for a stored model call,
  asks for another key than the one stored at a position (the step is not
  deterministic: docs/durable-steps.md), or emits an effect written before
  the crash differently.

The step's own side calls (``ctx.step(name, fn)``) really run: pass ``fn``
something harmless, or patch it as any unit test would.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel

from oncely.decisions import ApprovalDecision, UncertainDecision
from oncely.errors import CallFailed, Diverged, Nondeterministic, PermanentError, TransientError
from oncely.identity import child_id
from oncely.jobs.kit import run_step_function, step_context
from oncely.journal import (
    Checkpoint,
    Emitted,
    Journal,
    MapStart,
    Wait,
    Writes,
    current_checkpoint,
    failure_value,
)
from oncely.llm.base import Completion, Message, ResponseSchema, ToolChoice, ToolRequest, ToolSpec
from oncely.llm.model import Model, ModelRoute
from oncely.llm.routing import Target, parse_models
from oncely.retry import Deadline, RetryPolicy, retryable_status
from oncely.tools import ToolScript, scripted
from oncely.usage.prices import Prices
from oncely.workflow import Workflow

__all__ = ["ModelCall", "ProviderError", "ReplayError", "StepRun", "ToolCalls", "run_step"]

ResultT = TypeVar("ResultT", bound=BaseModel)

# Retries as a worker makes them, without the waiting.
_POLICY = RetryPolicy(
    per_call_timeout_s=60.0,
    max_attempts=4,
    backoff_base_s=0.0001,
    backoff_max_s=0.0001,
    retry_after_max_s=0.0,
)
_BUDGET_S = 600.0


class ProviderError(Exception):
    """What a provider answers instead of an answer: a 429 or 5xx is retried
    (then the call falls back), any other status never is."""

    def __init__(self, status: int, *, retry_after_s: float | None = None) -> None:
        super().__init__(f"the provider answered {status}")
        self.status = status
        self.retry_after_s = retry_after_s


class ToolCalls:
    """A scripted turn that calls tools: each ``(name, arguments)``; the
    arguments a dict, or a string sent as it is (to script arguments that
    are not JSON)."""

    def __init__(self, *calls: tuple[str, Mapping[str, Any] | str]) -> None:
        self.calls = calls


class ReplayError(AssertionError):
    """The step did something on its replay after a crash that a worker's
    redelivery would make wrong (module docstring)."""


@dataclass(frozen=True)
class ModelCall:
    """One call the step's model made: to which model, for which
    checkpoint, with what, and what it got (``outcome``: ``ok`` or the
    error's type)."""

    model: str
    step: str | None
    messages: tuple[Message, ...]
    schema: str | None
    outcome: str
    replay: bool = False

    @property
    def prompt(self) -> str:
        """The last user message."""
        return next((m.content for m in reversed(self.messages) if m.role == "user"), "")


@dataclass(frozen=True)
class StepRun(Generic[ResultT]):
    """What a step did. ``steps``: the keys of its checkpoints in the order
    it reached them; ``emitted``: its effects (topic, payload, dedupe key);
    ``model_calls``: calls made, retries, fallbacks and re-asks included
    (``calls`` has each); ``replayed``: checkpoints a replay found stored."""

    result: ResultT
    emitted: tuple[Emitted, ...]
    steps: tuple[str, ...]
    model_calls: int
    calls: tuple[ModelCall, ...] = ()
    replayed: int = 0
    usage: Mapping[str, Any] = field(default_factory=dict)
    # Every checkpoint of the run, in order, as a worker would have stored it.
    checkpoints: tuple[Checkpoint, ...] = ()
    # The runs of its maps' children (``ctx.map``), in item order.
    children: tuple[StepRun[Any], ...] = ()

    def until(self, key: str) -> tuple[Checkpoint, ...]:
        """The checkpoints up to ``key``: what a job stopped right after it
        had stored, to resume with ``run_step(..., resume_from=...)`` (a
        run started before a deploy, say)."""
        keys = [c.key for c in self.checkpoints]
        if key not in keys:
            raise KeyError(f"no checkpoint {key!r}; the run has {keys}")
        return self.checkpoints[: keys.index(key) + 1]


async def run_step(
    workflow: Workflow[Any, Any],
    request: BaseModel | Mapping[str, Any],
    *,
    answers: Sequence[Any] = (),
    events: Mapping[str, BaseModel | Mapping[str, Any]] | None = None,
    calls: Mapping[str, Any] | None = None,
    approvals: Mapping[str, bool | ApprovalDecision | Mapping[str, Any]] | None = None,
    uncertain: Mapping[str, str | UncertainDecision | Mapping[str, Any]] | None = None,
    tools: Mapping[str, Any] | None = None,
    toolsets: Mapping[str, Any] | None = None,
    crash_after: str | None = None,
    resume_from: Sequence[Checkpoint] = (),
    model: str = "test-model",
    fallbacks: Sequence[str] | None = None,
    job_id: str | None = None,
    tenant: str = "test",
    prices: Prices | str | None = None,
) -> StepRun[Any]:
    """Run ``workflow``'s step on ``request`` against scripted ``answers``
    (module docstring). ``model`` names the primary model and ``fallbacks``
    the models after it (default: the workflow's own ``fallbacks``; what
    ONCELY_LLM_FALLBACKS would add is not read). Raises what the step
    raises; ``ReplayError`` when a replay after ``crash_after`` goes wrong."""
    if not isinstance(workflow, Workflow):
        raise TypeError(
            f"run_step runs a Workflow's step, got {type(workflow).__name__}: give it the"
            " workflow whose step runs the agent"
        )
    body = workflow.request.model_validate(
        request.model_dump() if isinstance(request, BaseModel) else request
    )
    script = _Script(list(answers))
    received = {name: _json(value) for name, value in (events or {}).items()}
    route = tuple(fallbacks if fallbacks is not None else workflow.fallbacks or ())
    priced = Prices.parse(prices) if isinstance(prices, str) else prices or Prices()
    harness = _Harness(workflow, script, model, route, job_id or str(uuid.uuid4()), tenant, priced)
    stored = list(resume_from)
    store = _Memory(received, crash_after, _answers(calls), _decisions(approvals), stored)
    store.uncertain = _uncertain(uncertain)
    store.children = harness.run_children
    with scripted(_tool_script(tools, toolsets)):
        return await _runs(harness, body, store, stored, crash_after)


async def _runs(
    harness: _Harness,
    body: BaseModel,
    store: _Memory,
    stored: list[Checkpoint],
    crash_after: str | None,
) -> StepRun[Any]:
    """The run, and the replay after its crash when there is one."""
    task = asyncio.current_task()
    cancels = task.cancelling() if task is not None else 0
    try:
        journal, result = await harness.run(
            body, Journal(stored, store=store, workflow=harness.workflow.name)
        )
    except _Crashed:
        # A task group the crash went through asks this task to stop and, on
        # Python 3.11 when the crash comes while it waits for its children,
        # never takes the request back: the replay (and the caller) would be
        # cancelled at their next await.
        while task is not None and task.cancelling() > cancels:
            task.uncancel()
        return await _replay(harness, body, store, crash_after)
    if store.armed:
        # The worker died after the call's attempt: nothing after it is kept.
        return await _replay(harness, body, store, crash_after)
    if crash_after is not None:
        pending = journal.unwritten()
        if crash_after not in {c.key for c in pending.checkpoints}:
            raise ReplayError(_never_reached(crash_after, journal.reached))
        # It would have been stored with the result: the crash comes just before.
        store.keep(pending)
        return await _replay(harness, body, store, crash_after)
    return harness.outcome(journal, result)


async def _replay(
    harness: _Harness, body: BaseModel, crashed: _Memory, key: str | None
) -> StepRun[Any]:
    """The second run, over what the first stored; checked against it."""
    first_calls = len(harness.script.calls)
    store = _Memory(crashed.events, None, crashed.calls, crashed.approvals, list(crashed.stored))
    store.uncertain = crashed.uncertain
    store.children = harness.run_children
    journal = Journal(crashed.stored, store, workflow=harness.workflow.name)
    harness.script.replaying = True
    try:
        journal, result = await harness.run(body, journal)
    except Nondeterministic as exc:
        asked = "another payload for the same call" if isinstance(exc, Diverged) else "another key"
        raise ReplayError(f"after a crash past {key!r}, the replay asked {asked}: {exc}") from exc
    if journal.diverged:
        raise ReplayError(
            f"after a crash past {key!r}, the replay asked model turn {journal.diverged[0]!r}"
            " with another request than the first run: what a step asks may depend only on"
            " its request and its checkpoints' values"
        )
    stored = {c.key for c in crashed.stored}
    again = [c for c in harness.script.calls[first_calls:] if c.step in stored]
    if again:
        raise ReplayError(f"the replay paid again for stored checkpoint {again[0].step!r}")
    emitted = {e.dedupe_key: e for e in journal.emitted}
    for effect in crashed.effects:
        replayed = emitted.get(effect.dedupe_key)
        if replayed != effect:
            raise ReplayError(
                f"effect {effect.dedupe_key!r} was written before the crash as "
                f"{effect.payload!r} and the replay emitted {replayed!r}: what a step "
                "emits may depend only on its request and its checkpoints' values"
            )
    return harness.outcome(journal, result)


@dataclass
class _Harness:
    """What both runs of one ``run_step`` share."""

    workflow: Workflow[Any, Any]
    script: _Script
    model_name: str
    fallbacks: tuple[str, ...]
    job_id: str
    tenant: str
    prices: Prices = field(default_factory=Prices)
    children: list[StepRun[Any]] = field(default_factory=list)

    async def run_children(self, key: str, start: MapStart) -> list[dict[str, Any]]:
        """A map's children, one after another in item order, each a run of
        its workflow's step on the same scripted model: their outcomes as
        the map stores them (a child that raises is dead)."""
        outcomes = []
        for position, item in enumerate(start.items):
            child = _Harness(
                start.declaration,
                self.script,
                self.model_name,
                tuple(start.declaration.fallbacks or ()),
                child_id(self.job_id, key, position),
                self.tenant,
                self.prices,
            )
            body = start.declaration.request.model_validate(item)
            store = _Memory({}, None)
            store.children = child.run_children
            try:
                journal, result = await child.run(
                    body, Journal([], store, workflow=start.declaration.name)
                )
            except Exception as exc:
                reason = getattr(exc, "dead_reason", None)
                reason = reason or ("permanent" if isinstance(exc, PermanentError) else "failed")
                outcomes.append(
                    {"job_id": child.job_id, "status": "dead", "result": None, "error": reason}
                )
                continue
            run = child.outcome(journal, result)
            self.children.append(run)
            outcomes.append(
                {
                    "job_id": child.job_id,
                    "status": "done",
                    "result": result.model_dump(mode="json"),
                    "error": None,
                }
            )
        return outcomes

    async def run(self, body: BaseModel, journal: Journal) -> tuple[Journal, BaseModel]:
        fallbacks = tuple(
            Target(spec.name, self.script.as_model(spec.name))
            for spec in parse_models(self.fallbacks)
        )
        model = Model(
            self.script.as_model(self.model_name),
            policy=_POLICY,
            deadline=Deadline.after(_BUDGET_S),
            workflow=self.workflow.name,
            model_name=self.model_name,
            journal=journal,
            route=ModelRoute(fallbacks, prices=self.prices),
        )
        ctx = step_context(self.workflow, self.job_id, self.tenant, model, 1, journal=journal)
        return journal, await run_step_function(
            self.workflow, self.workflow.step, body, ctx, journal
        )

    def outcome(self, journal: Journal, result: BaseModel) -> StepRun[Any]:
        calls = tuple(self.script.calls)
        return StepRun(
            result=result,
            emitted=journal.emitted,
            steps=tuple(journal.reached),
            model_calls=len(calls),
            calls=calls,
            replayed=journal.replayed,
            usage=journal.usage(),
            checkpoints=tuple(journal.checkpoints()),
            children=tuple(self.children),
        )


# How many of the keys a step reached a ReplayError names.
_KEYS_SHOWN = 5


def _never_reached(key: str, reached: Sequence[str]) -> str:
    """What to say when ``crash_after`` names a key the run never reached:
    a few of the keys it did, and the scoped keys that end in the one asked
    for (a checkpoint in a branch or in another's work is ``[2]/model`` or
    ``enrich/model``: docs/testing.md)."""
    shown = ", ".join(repr(k) for k in reached[:_KEYS_SHOWN]) or "none"
    if len(reached) > _KEYS_SHOWN:
        shown += f" and {len(reached) - _KEYS_SHOWN} more"
    message = f"the step never reached checkpoint {key!r}; it reached {shown}"
    scoped = [k for k in reached if k.endswith(f"/{key}")]
    if scoped:
        message += f"; did you mean {scoped[0]!r}"
        if len(scoped) > 1:
            message += f" (one of {len(scoped)} keys ending in '/{key}')"
        message += "?"
    return message


class _Crashed(BaseException):
    """The worker died right after a checkpoint was stored."""


@dataclass
class _Memory:
    """A run's store: keeps what is written, and stops the run (``_Crashed``)
    once checkpoint ``crash_after`` is stored."""

    events: Mapping[str, Any]
    crash_after: str | None
    calls: Mapping[str, Any] = field(default_factory=dict)
    approvals: Mapping[str, Any] = field(default_factory=dict)
    stored: list[Checkpoint] = field(default_factory=list)
    uncertain: Mapping[str, Any] = field(default_factory=dict)
    # ``crash_after`` named an intent that is stored: the next write crashes.
    armed: bool = False
    effects: list[Emitted] = field(default_factory=list)
    # Runs a map's children in memory: their outcomes, as a map stores them.
    children: Callable[[str, MapStart], Awaitable[list[dict[str, Any]]]] | None = None

    async def write(self, writes: Writes) -> None:
        self._crash_if_armed()
        self.keep(writes)
        self._crash_if_stored(writes)

    async def wait(self, writes: Writes, wait: Wait) -> Checkpoint | None:
        self._crash_if_armed()
        self.keep(writes)
        if wait.children is not None and self.children is not None:
            value = await self.children(wait.key, wait.children)
            outcome = Checkpoint(wait.key, wait.ordinal, wait.kind, "done", value)
            self.stored.append(outcome)
            self._crash_if_stored(writes, wait.key)
            return outcome
        status, value = self._outcome(wait)
        outcome = Checkpoint(wait.key, wait.ordinal, wait.kind, status, value, request=wait.request)
        self.stored.append(outcome)
        self._crash_if_stored(writes, wait.key)
        return outcome

    def _outcome(self, wait: Wait) -> tuple[Literal["done", "failed"], Any]:
        """A wait's end: the event, the call's answer, the decision."""
        if wait.call is not None:
            if wait.call.topic not in self.calls:
                raise AssertionError(
                    f"the step called {wait.call.topic!r} but no answer was scripted in calls="
                )
            answer = self.calls[wait.call.topic]
            if isinstance(answer, ProviderError):
                reason = "attempts" if retryable_status(answer.status) else "refused"
                failed = CallFailed(str(answer), status=answer.status, reason=reason)
                return "failed", failure_value(failed)
            return "done", answer
        if wait.kind == "approval":
            tool = (wait.detail or {}).get("approval", {}).get("tool")
            return "done", self.approvals.get(tool)
        if wait.kind == "uncertain":
            tool = (wait.detail or {}).get("uncertain", {}).get("tool")
            if tool not in self.uncertain:
                raise AssertionError(
                    f"the outcome of {tool!r} was unknown (its worker died mid-call) but no"
                    " decision was scripted in uncertain="
                )
            return "done", self.uncertain[tool]
        return "done", self.events.get(wait.event) if wait.event is not None else None

    def keep(self, writes: Writes) -> None:
        self.stored += [c.stored() for c in writes.checkpoints]
        self.effects += writes.effects

    def _crash_if_stored(self, writes: Writes, *keys: str) -> None:
        written = {c.key: c.kind for c in writes.checkpoints} | dict.fromkeys(keys, "wait")
        if self.crash_after is None or self.crash_after not in written:
            return
        if written[self.crash_after] == "intent":
            # The call runs; its worker dies before anything after it is stored.
            self.armed = True
            return
        raise _Crashed(self.crash_after)

    def _crash_if_armed(self) -> None:
        if self.armed:
            raise _Crashed(self.crash_after or "")


@dataclass
class _Script:
    """The scripted provider: each call takes the next answer."""

    answers: list[Any]
    calls: list[ModelCall] = field(default_factory=list)
    replaying: bool = False
    tool_calls: int = 0

    def as_model(self, name: str) -> _ScriptedModel:
        return _ScriptedModel(self, name)

    def tool_request(self, name: str, arguments: Mapping[str, Any] | str) -> ToolRequest:
        """A scripted tool call, numbered ``call_<n>`` across the run."""
        self.tool_calls += 1
        text = arguments if isinstance(arguments, str) else json.dumps(arguments)
        return ToolRequest(f"call_{self.tool_calls}", name, text)


@dataclass(frozen=True)
class _ScriptedModel:
    """The ``LLM`` protocol over the script, as one model name."""

    script: _Script
    name: str

    async def complete(
        self,
        messages: Sequence[Message],
        timeout: float,  # noqa: ASYNC109 (LLM protocol)
        *,
        schema: ResponseSchema | None = None,
        tools: Sequence[ToolSpec] = (),
        tool_choice: ToolChoice | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> Completion:
        s = self.script
        number = len(s.calls) + 1
        if not s.answers:
            raise AssertionError(
                f"the step made model call {number} but only {number - 1} answers were scripted"
            )
        answer = s.answers.pop(0)
        outcome = "ok" if not isinstance(answer, BaseException) else type(answer).__name__
        s.calls.append(
            ModelCall(
                self.name,
                current_checkpoint(),
                tuple(messages),
                schema.name if schema is not None else None,
                outcome,
                s.replaying,
            )
        )
        if isinstance(answer, ProviderError):
            if retryable_status(answer.status):
                raise TransientError(
                    str(answer), status=answer.status, retry_after_s=answer.retry_after_s
                )
            raise PermanentError(str(answer), status=answer.status)
        if isinstance(answer, BaseException):
            raise answer
        if isinstance(answer, ToolCalls):
            requests = tuple(s.tool_request(name, args) for name, args in answer.calls)
            return Completion(
                "", prompt_tokens=_tokens(messages), completion_tokens=1, tool_calls=requests
            )
        text = answer if isinstance(answer, str) else json.dumps(_json(answer))
        if on_text is not None:
            on_text(text)
        return Completion(text, prompt_tokens=_tokens(messages), completion_tokens=_tokens(text))


def _answers(calls: Mapping[str, Any] | None) -> dict[str, Any]:
    return {
        topic: answer if isinstance(answer, ProviderError) else _json(answer)
        for topic, answer in (calls or {}).items()
    }


def _decisions(
    approvals: Mapping[str, bool | ApprovalDecision | Mapping[str, Any]] | None,
) -> dict[str, Any]:
    found = {}
    for tool, decision in (approvals or {}).items():
        if isinstance(decision, bool):
            decision = ApprovalDecision(approved=decision)
        found[tool] = _json(decision)
    return found


def _uncertain(
    decisions: Mapping[str, str | UncertainDecision | Mapping[str, Any]] | None,
) -> dict[str, Any]:
    found = {}
    for tool, decision in (decisions or {}).items():
        if decision == "resend":
            decision = UncertainDecision(resend=True)
        elif decision == "failed":
            decision = UncertainDecision(failed="failed, as the test says")
        elif not isinstance(decision, UncertainDecision):
            decision = UncertainDecision.model_validate(decision)
        found[tool] = decision.model_dump(mode="json", exclude_unset=True)
    return found


def _tool_script(tools: Mapping[str, Any] | None, toolsets: Mapping[str, Any] | None) -> ToolScript:
    for name, listing in (toolsets or {}).items():
        if isinstance(listing, str) or not isinstance(listing, Sequence | Mapping):
            raise TypeError(
                f"toolsets={{{name!r}: ...}}: a list of the server's tools (names, or dicts"
                " as tools/list answers them), or {'tools': [...], 'idempotent': True}"
            )
    return ToolScript(results=dict(tools or {}), listings=dict(toolsets or {}))


def _json(value: BaseModel | Mapping[str, Any] | Any) -> Any:
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else value


def _tokens(text: str | Sequence[Message]) -> int:
    """About four characters a token, as the fake model counts."""
    chars = len(text) if isinstance(text, str) else sum(len(m.content) for m in text)
    return chars // 4 + 1
