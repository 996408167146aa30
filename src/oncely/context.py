"""What a workflow's step runs in: ``ctx`` (docs/durable-steps.md).

The step may run more than once for a job (deliveries are at-least-once),
so what it emits must depend only on the job; only the delivery whose
result is stored writes its effects. Each model call, ``ctx.step``, wait
and sleep is a checkpoint of the job's run (``oncely.journal``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import itertools
import json
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypeVar, overload

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticSerializationError, to_jsonable_python

from oncely.at_most_once import run_at_most_once, shown_arguments, step_arguments
from oncely.decisions import ApprovalDecision, approval_event, call_id
from oncely.errors import DeadlineExceeded, PermanentError, TransientError
from oncely.journal import (
    Emitted,
    ForCall,
    ForChildren,
    ForEvent,
    ForTime,
    Journal,
    Kind,
    MapStart,
    Recorded,
    Scope,
    asked,
    check_name,
    current_checkpoint,
)
from oncely.retry import Deadline, RetryPolicy, call_with_retries, classify
from oncely.statuses import FinishedStatus

if TYPE_CHECKING:
    from oncely.live.events import LiveJob
    from oncely.llm.model import Model

EventT = TypeVar("EventT", bound=BaseModel)
ValueT = TypeVar("ValueT", bound=BaseModel)
ResultT = TypeVar("ResultT", bound=BaseModel)

# What ``ctx.variant`` is for the configured model, with no variant named.
PRIMARY = "primary"
# The longest wait for an event, and the default one (ONCELY_WAIT_MAX_S).
WAIT_MAX_S = 30 * 86400.0
# A call's default timeout (ONCELY_CALL_TIMEOUT_S).
CALL_TIMEOUT_S = 86400.0
# The most a ``ctx.progress`` event may carry.
PROGRESS_MAX_BYTES = 8192
# The most items one ``ctx.map`` takes (ONCELY_MAP_MAX_ITEMS).
MAP_MAX_ITEMS = 10_000
# How many of a map's items are validated before other tasks get a turn.
_MAP_VALIDATED_AT_ONCE = 500
# A map waits for its children with no time limit of its own (each child
# has its own retries and age): this stands for "until they end".
MAP_WAIT_S = 10 * 365 * 86400.0
# How long a tool call waits for a person's decision, by default.
APPROVAL_TIMEOUT_S = 48 * 3600.0

# The stable key of the tool checkpoint whose work runs now (``tool_key``).
_TOOL_KEY: ContextVar[str | None] = ContextVar("oncely_tool_key", default=None)


# The context of the step running in this task (``current_context``).
_CURRENT: ContextVar[Context | None] = ContextVar("oncely_context", default=None)


def current_context() -> Context:
    """The ``Context`` of the step running now, for code the step calls that
    was not handed it (a framework's agent wrapped for durability, see
    docs/frameworks.md). ``RuntimeError`` outside a step."""
    ctx = _CURRENT.get()
    if ctx is None:
        raise RuntimeError("oncely.current_context() is only known while a step runs")
    return ctx


@contextlib.contextmanager
def running(ctx: Context) -> Iterator[Context]:
    """``ctx`` as ``current_context()`` for the code run in the block (and
    the tasks it starts)."""
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def tool_key() -> str:
    """Inside a tool's run (``ctx.tool``, an agent's function tool, a
    framework's tool run by an oncely integration): the stable key of this
    tool call, ``<job_id>:<checkpoint key>``. The same on every retry and
    replay of the call and unique to it: pass it to an API that takes an
    idempotency key and the tool's effect happens once. ``RuntimeError``
    outside a tool's run."""
    key = _TOOL_KEY.get()
    if key is None:
        raise RuntimeError("oncely.tool_key() is only known inside a tool's run")
    return key


class Declared(Protocol):
    """What a context needs of its workflow's declaration (``Workflow``)."""

    @property
    def name(self) -> str: ...

    @property
    def topics(self) -> frozenset[str]: ...

    @property
    def events(self) -> Mapping[str, type[BaseModel]]: ...

    @property
    def calls(self) -> Mapping[str, type[BaseModel] | bool]: ...


class Mapped(Protocol):
    """What ``ctx.map`` needs of the children's workflow (a ``Workflow`` of
    the same app)."""

    @property
    def name(self) -> str: ...

    @property
    def request(self) -> type[BaseModel]: ...

    @property
    def result(self) -> type[BaseModel]: ...


@dataclass(frozen=True)
class ChildResult(Generic[ResultT]):
    """What became of one child of a map (``ctx.map``): its job id, its
    ``status`` (``done``, ``dead`` or ``cancelled``), its ``result`` (the
    children's workflow's result model, when done) and, when it is dead,
    its ``error`` (the stable reason GET shows)."""

    job_id: str
    status: FinishedStatus
    result: ResultT | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "done"


class Trial(Protocol):
    """What a context needs of the variant it runs (``Variant``)."""

    @property
    def name(self) -> str: ...

    @property
    def instructions(self) -> str | None: ...


class Context:
    """What a step gets besides its request: who and which job, the model
    (each call a checkpoint), ``step`` for other work to keep, waits for
    events and sleeps, and ``emit`` for effects (docs/durable-steps.md).

    ``variant`` names the variant this run is for (``"primary"`` for the
    configured model); ``shadow`` is true in a shadow run, whose emits are
    recorded with its result and never sent."""

    def __init__(
        self,
        workflow: Declared,
        job_id: str,
        tenant: str,
        model: Model,
        delivery: int,
        *,
        variant: Trial | None = None,
        shadow: bool = False,
        journal: Journal | None = None,
        wait_max_s: float = WAIT_MAX_S,
        call_timeout_s: float = CALL_TIMEOUT_S,
        live: LiveJob | None = None,
        map_max_items: int = MAP_MAX_ITEMS,
    ) -> None:
        self.workflow = workflow.name
        self.job_id = job_id
        self.tenant = tenant
        self.model = model
        # 1 on the first delivery; more after crashes, timeouts or transient failures.
        self.delivery = delivery
        self.variant = variant.name if variant is not None else PRIMARY
        self.shadow = shadow
        self._instructions = variant.instructions if variant is not None else None
        self._topics = workflow.topics
        self._events = workflow.events
        if journal is None:
            journal = model.journal if model is not None else Journal(workflow=workflow.name)
        self._journal = journal
        self._wait_max_s = wait_max_s
        self._calls = workflow.calls
        self._call_timeout_s = call_timeout_s
        self._live = live
        self._map_max_items = map_max_items
        # Whether a person's decision can reach this workflow's jobs.
        self._approvals: bool = getattr(workflow, "approvals", True)

    @contextlib.contextmanager
    def scope(self, name: str) -> Iterator[str]:
        """Checkpoints reached in the block are keyed under ``name/``
        (``name#2/`` the second time): code that runs as one unit (an
        agent's run) keeps its checkpoints together, named apart from the
        rest of the step's. Yields the scope's path."""
        with self._journal.scope(name) as path:
            yield path

    # -- the checkpoint kit (docs/checkpoint-kit.md) --------------------------
    #
    # What oncely.Agent and the framework integrations are built on: scopes,
    # tool checkpoints, approvals, besides model turns (``ctx.model``) and
    # calls that answer (``ctx.call``).

    def open_scope(self, name: str, *, shared: bool = False) -> Scope:
        """A scope keyed ``name/`` (``name#2/`` the second time) in the
        running code's scope, entered later with ``within``. Scopes opened one
        after another are named in that order however the code run in them
        then interleaves: open the scopes of one model turn's tool calls in
        the turn's order, then run the calls concurrently. ``shared``: the
        tasks that enter it make no branches of it (a framework's run, whose
        turns come from tasks of the framework's own)."""
        return self._journal.open_scope(name, shared=shared)

    def within(self, scope: Scope) -> contextlib.AbstractContextManager[str]:
        """Checkpoints reached in the block are ``scope``'s (``open_scope``).
        Yields the scope's path."""
        return self._journal.within(scope)

    async def tool(
        self,
        fn: Callable[..., Any],
        /,
        *args: Any,
        name: str = "tool",
        returns: type[BaseModel] | None = None,
        at_most_once: bool = False,
        reconcile: Callable[[Any, str], Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """``fn(*args, **kwargs)`` as a tool checkpoint (key ``name`` in the
        running scope, ``tool`` by default): at least once, its JSON value
        kept, never run again for the job once it answered; retried and
        classified as ``ctx.step`` is. Inside it ``oncely.tool_key()`` is
        the call's stable key. ``at_most_once``/``reconcile``: as for
        ``ctx.step``."""
        return await record_step(
            self, name, "tool", fn, args, kwargs, returns,
            at_most_once=at_most_once, reconcile=reconcile,
        )  # fmt: skip

    async def approval(
        self,
        tool: str,
        arguments: Mapping[str, Any] | None,
        *,
        timeout: float | timedelta = APPROVAL_TIMEOUT_S,  # noqa: ASYNC109 (a durable wait)
        on_timeout: Literal["reject", "approve"] = "reject",
        schema: Mapping[str, Any] | None = None,
    ) -> ApprovalDecision:
        """Wait, holding no worker slot, for a person's decision on calling
        ``tool`` with ``arguments`` (checkpoint ``approval`` in the running
        scope). The job shows ``waiting: {"approval": {"call_id", "tool",
        "arguments"}}``; ``call_id`` is oncely's own (``oncely.decisions``),
        and the decision is taken by ``POST <route>/{job_id}/approvals/
        {call_id}``, ``oncely jobs approve`` or the console. With the effect
        ``approval.requested`` declared, one is emitted with the wait. No
        decision within ``timeout`` is ``on_timeout``'s. ``schema``: the
        tool's arguments' JSON schema, kept with the wait so that the API
        refuses (422) edited arguments that fail it (a framework's tool,
        which the workflow's declaration cannot name)."""
        if not self._approvals:
            raise PermanentError(
                f"tool {tool!r} asks for a person's decision, but workflow {self.workflow!r}"
                " has no approvals route: declare the agent with Workflow(agents=[...])"
            )
        shown = dict(arguments or {})
        reached = self._journal.reach("approval", "approval")
        decided_as = call_id(reached.key, tool, shown)
        pending = {"call_id": decided_as, "tool": tool, "arguments": shown}
        if self.declares("approval.requested"):
            self.emit(
                "approval.requested",
                {"job_id": self.job_id, **pending},
                dedupe_key=f"approval.requested:{self.job_id}:{decided_as}",
            )

        def decode(value: Any) -> ApprovalDecision:
            if value is None:
                approved = on_timeout == "approve"
                return ApprovalDecision(approved=approved, reason="no decision in time")
            return ApprovalDecision.model_validate(value)

        return await self._journal.wait(
            "approval",
            "approval",
            ForEvent(approval_event(decided_as)),
            max(_seconds(timeout), 0.0),
            decode,
            detail={"approval": pending if schema is None else {**pending, "schema": schema}},
            reached=reached,
        )

    @property
    def emitted(self) -> tuple[Emitted, ...]:
        """What this run emitted so far (read-only)."""
        return self._journal.emitted

    def patched(self, name: str) -> bool:
        """``if ctx.patched("name"):`` the new code, ``else:`` the old: True
        for a run that reaches this point for the first time (a marker
        checkpoint is stored), False for a replay of a run that passed this
        point before the patch existed. Jobs in flight keep their old path
        across a deploy while new jobs take the new one
        (docs/durable-steps.md, "Deploying changed steps")."""
        return self._journal.patched(name)

    def progress(self, data: Any) -> None:
        """Tell whoever follows the job live how far it got: a ``progress``
        event with ``data`` (JSON, at most 8 KB) on its stream
        (docs/streaming.md). A view only: never stored, never replayed."""
        text = json.dumps(to_jsonable_python(data), separators=(",", ":"))
        if len(text.encode()) > PROGRESS_MAX_BYTES:
            raise ValueError(f"progress of {len(text.encode())} bytes: at most 8 KB")
        if self._live is not None:
            self._live.progress(json.loads(text), current_checkpoint())

    def declares(self, topic: str) -> bool:
        """Whether the workflow declares the effect ``topic``."""
        return topic in self._topics

    def instructions(self, default: str) -> str:
        """The variant's instructions if it declares some, else ``default``:
        steps that pass their system prompt through this can be trialled with
        another prompt as a variant."""
        return self._instructions if self._instructions is not None else default

    def emit(
        self, topic: str, payload: Mapping[str, Any] | BaseModel, *, dedupe_key: str | None = None
    ) -> None:
        """Queue an effect. It is stored in the same transaction as the result,
        so it exists if and only if the result does; the relay then delivers it
        once, with ``dedupe_key`` (default ``<topic>:<job_id>``) as the
        provider's idempotency key."""
        if topic not in self._topics:
            raise PermanentError(f"workflow {self.workflow!r} does not declare topic {topic!r}")
        if topic in self._calls:
            raise TypeError(f"{topic!r} is a call that answers: await ctx.call({topic!r}, ...)")
        key = dedupe_key or f"{topic}:{self.job_id}"
        self._journal.emit(Emitted(topic, _payload(payload), key))

    async def call(
        self,
        topic: str,
        payload: Mapping[str, Any] | BaseModel,
        *,
        timeout: float | timedelta | None = None,  # noqa: ASYNC109 (a durable wait, not a bound)
        step: str | None = None,
    ) -> Any:
        """Send ``payload`` to the receiver of ``topic`` (declared with
        ``webhook(topic, returns=...)``) once, and return its answer,
        validated as ``returns`` (docs/agents.md). A checkpoint (key: the
        topic, then ``topic#2``, ...): the call's outbox row is written with
        it, and the job waits holding no worker slot until the relay stored
        the answer; a replay gets the stored answer. The receiver gets the
        dedupe key ``<topic>:<job_id>:<key>`` as ``webhook-id`` and
        ``Idempotency-Key``. A 4xx, an invalid answer, the relay's attempts
        running out or ``timeout`` (default ``ONCELY_CALL_TIMEOUT_S``)
        raise ``CallFailed``. ``step`` names the checkpoint instead of the topic."""
        if topic not in self._topics:
            raise PermanentError(f"workflow {self.workflow!r} does not declare topic {topic!r}")
        returns = self._calls.get(topic)
        if returns is None:
            raise TypeError(
                f"{topic!r} is a plain effect: ctx.emit({topic!r}, ...), or declare it"
                " with webhook(..., returns=...) to call it"
            )
        seconds = self._call_timeout_s if timeout is None else max(_seconds(timeout), 0.0)
        data = _payload(payload)

        def row(key: str) -> Emitted:
            return Emitted(topic, data, f"{topic}:{self.job_id}:{key}")

        def decode(value: Any) -> Any:
            if isinstance(returns, type) and issubclass(returns, BaseModel):
                return returns.model_validate(value)
            return value

        detail = {"call": topic}
        name = check_name(step if step is not None else topic)
        return await self._journal.wait(
            name,
            "call",
            lambda key: ForCall(row(key)),
            seconds,
            decode,
            detail=detail,
            request=asked(data),
        )

    async def map(
        self,
        workflow: Mapped,
        items: Iterable[BaseModel | Mapping[str, Any]],
        *,
        concurrency: int = 50,
        step: str | None = None,
    ) -> list[ChildResult[Any]]:
        """One child job of ``workflow`` (a workflow of the same app) per
        item, each item its request; answers every child's outcome in item
        order once all have ended, done or not (docs/fanout.md). A
        checkpoint (key ``map``, ``map#2``, …; ``step`` names it): the
        children start with it, at most ``concurrency`` of them queued or
        running at once, and the job waits holding no worker slot; a replay
        never starts a child twice (a child's id comes from this job's, the
        key and the item's position). Children are ordinary jobs of this
        tenant: their own retries, dead letters, usage and effects."""
        if concurrency < 1:
            raise ValueError("ctx.map: concurrency must be at least 1")
        # At most one item past the bound is taken: a million items fail as
        # fast as the bound plus one, before any is validated.
        taken = list(itertools.islice(items, self._map_max_items + 1))
        if len(taken) > self._map_max_items:
            raise PermanentError(
                f"ctx.map of more than {self._map_max_items} items: at most ONCELY_MAP_MAX_ITEMS"
            )
        requests = []
        for n, item in enumerate(taken):
            requests.append(_child_request(workflow, n, item))
            if n % _MAP_VALIDATED_AT_ONCE == _MAP_VALIDATED_AT_ONCE - 1:
                await asyncio.sleep(0)  # other jobs on this worker go on meanwhile
        children = MapStart(workflow.name, tuple(requests), concurrency, declaration=workflow)
        detail = {"children": {"workflow": workflow.name, "total": len(requests)}}

        def decode(value: Any) -> list[ChildResult[Any]]:
            return [_child_result(workflow, child) for child in value or ()]

        name = check_name(step if step is not None else "map")
        return await self._journal.wait(
            name, "map", ForChildren(children), MAP_WAIT_S, decode, detail=detail
        )

    @overload
    async def step(
        self,
        name: str,
        fn: Callable[..., Any],
        *args: Any,
        returns: type[ValueT],
        at_most_once: bool = False,
        reconcile: Callable[[Any, str], Any] | None = None,
        **kwargs: Any,
    ) -> ValueT: ...
    @overload
    async def step(
        self,
        name: str,
        fn: Callable[..., Any],
        *args: Any,
        returns: None = None,
        at_most_once: bool = False,
        reconcile: Callable[[Any, str], Any] | None = None,
        **kwargs: Any,
    ) -> Any: ...
    async def step(
        self,
        name: str,
        fn: Callable[..., Any],
        *args: Any,
        returns: type[BaseModel] | None = None,
        at_most_once: bool = False,
        reconcile: Callable[[Any, str], Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """``fn(*args, **kwargs)`` (sync, run in a thread, or async) once per
        job: its value is a checkpoint, returned again without running ``fn``
        whenever the step function replays. The value must be JSON;
        ``returns=SomeModel`` validates it and gives the model back, on the
        first run and on replays alike. Errors that can succeed later
        (``TransientError``, timeouts, connection errors, retryable statuses)
        are retried under the delivery's deadline as model calls are; what
        is left is raised as ``TransientError`` (redelivered), anything else
        as ``PermanentError`` (the job dies), the original as ``__cause__``.
        A failure the step catches and goes on past is kept: a replay raises
        it again instead of running ``fn``.

        ``at_most_once=True``: an effect no receiver dedupes. Its intent is
        stored before ``fn`` runs, and ``fn`` is never run twice without
        ``reconcile(arguments, key)`` (``arguments``: ``fn``'s by parameter
        name; ``oncely.NOT_DONE``: run it again) or a person saying so
        (docs/at-most-once.md). It is not retried: a failure other than
        ``PermanentError`` leaves its outcome unknown, as a crash does."""
        return await record_step(
            self, name, "step", fn, args, kwargs, returns,
            at_most_once=at_most_once, reconcile=reconcile,
        )  # fmt: skip

    async def _retried(
        self, name: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        deadline: Deadline = self.model.deadline
        # One attempt may take what is left of the delivery's budget.
        policy: RetryPolicy = replace(
            self.model.policy, per_call_timeout_s=max(deadline.remaining(), 0.001)
        )

        async def attempt(_timeout_s: float) -> Any:
            if is_async(fn):
                return await fn(*args, **kwargs)
            value = await asyncio.to_thread(functools.partial(fn, *args, **kwargs))
            return await value if inspect.isawaitable(value) else value

        try:
            return await call_with_retries(
                attempt, policy=policy, deadline=deadline, min_attempt_s=0, what="step"
            )
        except (PermanentError, TransientError, DeadlineExceeded):
            raise
        except Exception as exc:
            # As oncely's own, the same on the first run and on replays.
            error = TransientError if classify(exc) else PermanentError
            raise error(f"step {name!r}: {type(exc).__name__}: {exc}") from exc

    @overload
    async def wait_for_event(
        self,
        name: str,
        *,
        timeout: float | timedelta | None = None,  # noqa: ASYNC109 (a durable wait, not a bound)
    ) -> Any: ...
    @overload
    async def wait_for_event(
        self,
        name: str,
        event: type[EventT],
        *,
        timeout: float | timedelta | None = None,  # noqa: ASYNC109
    ) -> EventT | None: ...
    async def wait_for_event(
        self,
        name: str,
        event: type[BaseModel] | None = None,
        *,
        timeout: float | timedelta | None = None,  # noqa: ASYNC109
    ) -> Any:
        """The event ``name`` (declared in the workflow's ``events``) as its
        model, or None once ``timeout`` (at most ``ONCELY_WAIT_MAX_S``, and
        that by default) has passed. While it waits the job is ``waiting``
        and holds no worker slot: the event (``POST
        <route>/{job_id}/events/<name>``) or the timeout enqueues it again,
        and the step function replays to here. An event sent before the wait
        began is kept for it. (``event`` only narrows the type for checkers;
        the declared model is what validates.)"""
        model = self._events.get(name)
        if model is None:
            raise PermanentError(f"workflow {self.workflow!r} declares no event {name!r}")
        seconds = self._wait_seconds(timeout)

        def decode(value: Any) -> Any:
            return None if value is None else model.model_validate(value)

        return await self._journal.wait(name, "wait", ForEvent(name), seconds, decode)

    async def sleep(self, duration: float | timedelta) -> None:
        """Wait ``duration`` (seconds or a ``timedelta``) holding nothing: the
        job is ``waiting`` and resumes after that time, across restarts of
        every process. Checkpoint ``sleep`` (``sleep#2``, …)."""
        seconds = _seconds(duration)
        await self._journal.wait("sleep", "sleep", ForTime(), seconds, lambda _: None)

    def _wait_seconds(self, timeout: float | timedelta | None) -> float:
        if timeout is None:
            return self._wait_max_s
        seconds = _seconds(timeout)
        if seconds > self._wait_max_s:
            raise PermanentError(
                f"wait of {seconds:g} s: at most ONCELY_WAIT_MAX_S ({self._wait_max_s:g} s)"
            )
        return max(seconds, 0.0)


async def record_step(
    ctx: Context,
    name: str,
    kind: Kind,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    returns: type[BaseModel] | None = None,
    *,
    at_most_once: bool = False,
    reconcile: Callable[[Any, str], Any] | None = None,
    label: str | None = None,
    arguments: Any = None,
) -> Any:
    """``ctx.step``'s checkpoint, of ``kind`` (an agent's function tool is a
    ``tool``): ``fn`` run with the step's retries, its JSON value kept. With
    ``at_most_once``, run at most once per decision instead
    (``oncely.at_most_once``): ``label`` names it to operators (the tool;
    the step's name by default), ``arguments`` is what ``reconcile`` is
    given (the step's arguments by name by default)."""
    check_name(name)
    if reconcile is not None and not at_most_once:
        raise ValueError(f"step {name!r}: reconcile= goes with at_most_once=True")
    decode = _decoder(returns)

    async def work() -> Recorded[Any]:
        key = f"{ctx.job_id}:{current_checkpoint()}"
        token = _TOOL_KEY.set(key if kind == "tool" or at_most_once else None)
        try:
            if at_most_once:
                given = step_arguments(fn, args, kwargs) if arguments is None else arguments
                value = await run_at_most_once(
                    ctx,
                    label=label or name,
                    fn=fn,
                    args=args,
                    kwargs=kwargs,
                    arguments=given,
                    shown=shown_arguments(given),
                    reconcile=reconcile,
                    key=key,
                )
            else:
                value = await ctx._retried(name, fn, args, kwargs)
        finally:
            _TOOL_KEY.reset(token)
        data = _json(name, value)
        return Recorded(data, decode(data))

    return await ctx._journal.record(name, kind, work, decode)


def journal_of(ctx: Context) -> Journal:
    """The run's journal, for the library's own checkpoint kinds built on
    it (an agent's tool calls)."""
    return ctx._journal


def is_async(fn: Any) -> bool:
    """An async function, or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 (the method, not callability)
    )


def _child_request(
    workflow: Mapped, position: int, item: BaseModel | Mapping[str, Any]
) -> dict[str, Any]:
    """An item as the children's workflow's request, in JSON."""
    try:
        request = (
            item
            if isinstance(item, workflow.request)
            else workflow.request.model_validate(
                item.model_dump() if isinstance(item, BaseModel) else item
            )
        )
    except ValidationError as exc:
        raise PermanentError(
            f"ctx.map: item {position} is no {workflow.name} request:"
            f" {exc.error_count()} validation error(s)"
        ) from exc
    dumped: dict[str, Any] = request.model_dump(mode="json")
    return dumped


def _child_result(workflow: Mapped, child: Mapping[str, Any]) -> ChildResult[Any]:
    result = child.get("result")
    if child["status"] == "done" and result is not None:
        result = workflow.result.model_validate(result)
    return ChildResult(str(child["job_id"]), child["status"], result, child.get("error"))


def _seconds(duration: float | timedelta) -> float:
    return duration.total_seconds() if isinstance(duration, timedelta) else float(duration)


def _decoder(returns: type[BaseModel] | None) -> Callable[[Any], Any]:
    if returns is None:
        return lambda value: value
    return returns.model_validate


def _payload(payload: Mapping[str, Any] | BaseModel) -> Any:
    """An effect's or a call's payload as JSON."""
    data = payload.model_dump(mode="json") if isinstance(payload, BaseModel) else payload
    return to_jsonable_python(data)


def _json(name: str, value: Any) -> Any:
    """A step's value as JSON (what is stored and what replays decode)."""
    try:
        return to_jsonable_python(value)
    except PydanticSerializationError as exc:
        raise PermanentError(f"step {name!r} returned a value that is not JSON: {exc}") from exc


RequestT = TypeVar("RequestT", bound=BaseModel)

# A workflow's step: ``async (request, ctx) -> result``.
Step = Callable[[RequestT, Context], Awaitable[ResultT]]
