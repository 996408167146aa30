"""A workflow: what a team declares, and the context its step runs in.

```python
triage = Workflow(
    name="triage",
    route="/v1/triage",
    request=Ticket,
    result=Triage,
    step=triage_ticket,          # async (request, ctx) -> result
    effects=[webhook("ticket.triaged")],
)
```

Registering it on an ``App`` gives the idempotent ``POST <route>``, ``GET
<route>/{job_id}``, a stream of its own, dead letters, reconciliation, status
and metrics: see docs/architecture.md. The step may run more than once for a
job (deliveries are at-least-once), so what it emits must depend only on the
job; only the delivery whose result is stored writes its effects.

A workflow may declare ``variants`` (another model, other instructions, or
another step) and an ``evaluator`` that scores a variant's result against the
primary's: shadow runs (docs/shadow.md) use them.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import re
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Generic, Literal, Self, TypeVar, cast, overload

from pydantic import BaseModel, ConfigDict
from pydantic_core import PydanticSerializationError, to_jsonable_python

from oncely import names
from oncely.effects import Effect
from oncely.errors import DeadlineExceeded, PermanentError, TransientError
from oncely.journal import Emitted, Journal, Recorded, check_name
from oncely.llm.routing import parse_models
from oncely.retry import Deadline, RetryPolicy, call_with_retries, classify
from oncely.usage.totals import summed

if TYPE_CHECKING:
    from oncely.jobs.store import JobRecord
    from oncely.llm.model import Model
    from oncely.shadow.evaluate import Evaluator, ModelJudge

RequestT = TypeVar("RequestT", bound=BaseModel)
ResultT = TypeVar("ResultT", bound=BaseModel)
EventT = TypeVar("EventT", bound=BaseModel)
ValueT = TypeVar("ValueT", bound=BaseModel)

_NAME = re.compile(r"^[a-z][a-z0-9_]{0,39}$")
_ROUTE = re.compile(r"^(/[A-Za-z0-9._~-]+)+$")
# Variant names are model names too (``gpt-4o-mini``, ``llama3:8b``, ``org/model``).
_VARIANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,99}$")
# What ``ctx.variant`` is for the configured model, with no variant named.
PRIMARY = "primary"
# The longest wait for an event, and the default one (ONCELY_WAIT_MAX_S).
WAIT_MAX_S = 30 * 86400.0


class UsageView(BaseModel):
    """Tokens, model calls and cost: of one model checkpoint, or of every
    model checkpoint of a job."""

    prompt_tokens: int
    completion_tokens: int
    model_calls: int
    # USD (ONCELY_LLM_PRICES); None when a call's model has no price.
    cost_usd: float | None = None
    # The model that answered (a job's: its last model checkpoint's).
    model: str | None = None


class StepView(BaseModel):
    """One checkpoint of a job, as its tenant sees it (never its value)."""

    key: str
    kind: Literal["step", "model", "wait", "sleep"]
    # failed: the work failed and the step went on past it (a replay raises it again).
    status: Literal["done", "waiting", "failed"]
    finished_at: datetime | None = None
    # Model checkpoints: what the call spent (its retries, re-asks and
    # fallbacks included), and the model that answered (a fallback, when one did).
    usage: UsageView | None = None
    model: str | None = None


class WaitingView(BaseModel):
    """What a waiting job waits for: ``event`` (None: a sleep) until ``until``."""

    event: str | None = None
    until: datetime


# Why a job is dead, as its tenant sees it (docs/http-api.md). The job row
# keeps the detail (the reason, then the last error, which may quote the
# provider's answer) for operators: the console and ``oncely dlq list``.
DEAD_REASONS = {
    "permanent": "the step failed in a way retrying cannot fix",
    "max_age": "the step kept failing until the job was too old to retry",
    "max_deliveries": "deliveries of the job kept stopping before they finished",
    "malformed": "the queued message could not be read",
    "nondeterministic": "the step no longer reaches the checkpoints its stored run reached",
}


DeadReason = Literal[
    "permanent", "max_age", "max_deliveries", "malformed", "nondeterministic", "failed"
]


def tenant_error(error: str | None) -> DeadReason | None:
    """The stable reason of a job row's ``error`` (``failed`` if unknown)."""
    if error is None:
        return None
    reason = error.partition(":")[0].strip()
    return cast(DeadReason, reason) if reason in DEAD_REASONS else "failed"


class JobView(BaseModel, Generic[ResultT]):
    """What ``GET <route>/{job_id}`` answers. Subclass it (and pass ``view=``)
    to add fields of your own; override ``from_record`` to fill them."""

    model_config = ConfigDict(frozen=True)

    job_id: uuid.UUID
    status: Literal["queued", "waiting", "done", "dead", "cancelled"]
    result: ResultT | None = None
    # Set once the job is dead: one of DEAD_REASONS, or "failed".
    error: DeadReason | None = None
    # Every model checkpoint of the job, summed.
    usage: UsageView | None = None
    # While the job waits: for what, until when.
    waiting: WaitingView | None = None
    # Its checkpoints, in the order its run reached them.
    steps: list[StepView] = []
    created_at: datetime
    updated_at: datetime

    @classmethod
    def from_record(cls, record: JobRecord) -> Self:
        waiting = None
        if record.status == "waiting" and record.wait_until is not None:
            waiting = {"event": record.waiting_for, "until": record.wait_until}
        return cls.model_validate(
            {
                "job_id": record.job_id,
                "status": record.status,
                "result": record.result,
                "error": tenant_error(record.error),
                "usage": record.usage or _summed(record.steps),
                "waiting": waiting,
                "steps": _steps(record.steps),
                "created_at": record.created_at,
                "updated_at": record.updated_at,
            }
        )


def _summed(steps: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The usage of every model checkpoint (a job not done yet); None if none."""
    usages = [s["usage"] for s in steps if s.get("usage")]
    return summed(usages) if usages else None


def _steps(steps: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each checkpoint with the model that answered it, from its usage."""
    return [{**s, "model": (s.get("usage") or {}).get("model")} for s in steps]


class Context:
    """What a step gets besides its request: who and which job, the model
    (each call a checkpoint), ``step`` for other work to keep, waits for
    events and sleeps, and ``emit`` for effects (docs/durable-steps.md).

    ``variant`` names the variant this run is for (``"primary"`` for the
    configured model); ``shadow`` is true in a shadow run, whose emits are
    recorded with its result and never sent."""

    def __init__(
        self,
        workflow: Workflow[Any, Any],
        job_id: str,
        tenant: str,
        model: Model,
        delivery: int,
        *,
        variant: Variant | None = None,
        shadow: bool = False,
        journal: Journal | None = None,
        wait_max_s: float = WAIT_MAX_S,
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

    @property
    def emitted(self) -> tuple[Emitted, ...]:
        """What this run emitted so far (read-only)."""
        return self._journal.emitted

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
        key = dedupe_key or f"{topic}:{self.job_id}"
        data = payload.model_dump(mode="json") if isinstance(payload, BaseModel) else payload
        self._journal.emit(Emitted(topic, to_jsonable_python(data), key))

    @overload
    async def step(
        self, name: str, fn: Callable[..., Any], *args: Any, returns: type[ValueT], **kwargs: Any
    ) -> ValueT: ...
    @overload
    async def step(
        self, name: str, fn: Callable[..., Any], *args: Any, returns: None = None, **kwargs: Any
    ) -> Any: ...
    async def step(
        self,
        name: str,
        fn: Callable[..., Any],
        *args: Any,
        returns: type[BaseModel] | None = None,
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
        it again instead of running ``fn``."""
        check_name(name)
        decode = _decoder(returns)

        async def work() -> Recorded[Any]:
            value = await self._retried(name, fn, args, kwargs)
            data = _json(name, value)
            return Recorded(data, decode(data))

        return await self._journal.record(name, "step", work, decode)

    async def _retried(
        self, name: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        deadline: Deadline = self.model.deadline
        # One attempt may take what is left of the delivery's budget.
        policy: RetryPolicy = replace(
            self.model.policy, per_call_timeout_s=max(deadline.remaining(), 0.001)
        )

        async def attempt(_timeout_s: float) -> Any:
            if _is_async(fn):
                return await fn(*args, **kwargs)
            value = await asyncio.to_thread(functools.partial(fn, *args, **kwargs))
            return await value if inspect.isawaitable(value) else value

        try:
            return await call_with_retries(
                attempt, policy=policy, deadline=deadline, min_attempt_s=0
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

        return await self._journal.wait(name, "wait", name, seconds, decode)

    async def sleep(self, duration: float | timedelta) -> None:
        """Wait ``duration`` (seconds or a ``timedelta``) holding nothing: the
        job is ``waiting`` and resumes after that time, across restarts of
        every process. Checkpoint ``sleep`` (``sleep#2``, …)."""
        seconds = _seconds(duration)
        await self._journal.wait("sleep", "sleep", None, seconds, lambda _: None)

    def _wait_seconds(self, timeout: float | timedelta | None) -> float:
        if timeout is None:
            return self._wait_max_s
        seconds = _seconds(timeout)
        if seconds > self._wait_max_s:
            raise PermanentError(
                f"wait of {seconds:g} s: at most ONCELY_WAIT_MAX_S ({self._wait_max_s:g} s)"
            )
        return max(seconds, 0.0)


def _is_async(fn: Any) -> bool:
    """An async function, or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 (the method, not callability)
    )


def _seconds(duration: float | timedelta) -> float:
    return duration.total_seconds() if isinstance(duration, timedelta) else float(duration)


def _decoder(returns: type[BaseModel] | None) -> Callable[[Any], Any]:
    if returns is None:
        return lambda value: value
    return returns.model_validate


def _json(name: str, value: Any) -> Any:
    """A step's value as JSON (what is stored and what replays decode)."""
    try:
        return to_jsonable_python(value)
    except PydanticSerializationError as exc:
        raise PermanentError(f"step {name!r} returned a value that is not JSON: {exc}") from exc


Step = Callable[[RequestT, Context], Awaitable[ResultT]]


@dataclass(frozen=True)
class Variant:
    """Another way to run a workflow's step: another ``model``, other
    ``instructions`` (what ``ctx.instructions(default)`` answers), or another
    ``step`` altogether. A name that no variant declares stands for that
    model with the workflow's own step and instructions."""

    name: str
    # None: the configured model (ONCELY_LLM_MODEL).
    model: str | None = None
    instructions: str | None = None
    step: Step[Any, Any] | None = None

    def __post_init__(self) -> None:
        if not _VARIANT.match(self.name):
            raise ValueError(
                f"variant name {self.name!r}: 1-100 of letters, digits and ._:/@+-, "
                "starting with a letter or digit"
            )


@dataclass(frozen=True)
class Workflow(Generic[RequestT, ResultT]):
    """One kind of job: its request, its step, its result and its effects."""

    name: str
    route: str
    request: type[RequestT]
    result: type[ResultT]
    step: Step[RequestT, ResultT]
    effects: Sequence[Effect] = ()
    # The consumer group on the workflow's stream (default "<name>-workers").
    group: str | None = None
    # The model ``GET <route>/{job_id}`` answers (default ``JobView[result]``).
    view: type[JobView[Any]] | None = None
    summary: str = ""
    # Declared variants, for shadow runs and promotion (ONCELY_SHADOW, ONCELY_PRIMARY).
    variants: Sequence[Variant] = ()
    # How a shadow result is scored against the primary's (default: every
    # field of the result compared for equality, oncely.field_agreement());
    # oncely.ModelJudge() asks a model instead.
    evaluator: Evaluator | ModelJudge | None = None
    # Events a job may be sent (``POST <route>/{job_id}/events/<name>``), by
    # name, each with the model its body must validate as.
    events: Mapping[str, type[BaseModel]] = field(default_factory=dict)
    # The models its calls move on to when the primary keeps failing, each
    # ``name`` or ``name@base_url`` (docs/model-routing.md); None: those of
    # ONCELY_LLM_FALLBACKS, [] none at all.
    fallbacks: Sequence[str] | None = None
    topics: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(
                f"workflow name {self.name!r}: 1-40 of a-z, 0-9 and _, starting with a letter"
            )
        if not _ROUTE.match(self.route):
            raise ValueError(f"workflow {self.name!r}: route {self.route!r} must look like /v1/x")
        topics = [e.topic for e in self.effects]
        if len(set(topics)) != len(topics):
            raise ValueError(f"workflow {self.name!r} declares a topic twice")
        variants = [v.name for v in self.variants]
        if len(set(variants)) != len(variants) or PRIMARY in variants:
            raise ValueError(
                f"workflow {self.name!r}: variant names must be unique, not {PRIMARY!r}"
            )
        for event, model in self.events.items():
            check_name(event)
            if not (isinstance(model, type) and issubclass(model, BaseModel)):
                raise ValueError(f"workflow {self.name!r}: event {event!r} needs a pydantic model")
        if not _is_async(self.step):
            raise ValueError(f"workflow {self.name!r}: step must be an async function")
        if self.fallbacks is not None:
            try:
                parse_models(self.fallbacks)
            except ValueError as exc:
                raise ValueError(f"workflow {self.name!r}: fallbacks: {exc}") from None
            object.__setattr__(self, "fallbacks", tuple(self.fallbacks))
        object.__setattr__(self, "events", dict(self.events))
        object.__setattr__(self, "effects", tuple(self.effects))
        object.__setattr__(self, "variants", tuple(self.variants))
        object.__setattr__(self, "topics", frozenset(topics))

    @property
    def keys(self) -> names.WorkflowKeys:
        return names.workflow_keys(self.name, self.group or f"{self.name}-workers")

    def variant(self, name: str) -> Variant:
        """The declared variant ``name``, or else the model of that name."""
        declared = next((v for v in self.variants if v.name == name), None)
        return declared or Variant(name, model=name)

    @property
    def job_view(self) -> type[JobView[Any]]:
        return self.view or JobView[self.result]  # type: ignore[name-defined]
