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
primary's: shadow runs (README: "Trial a model change safely") use them.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Generic, Literal, Self, TypeVar, cast

from pydantic import BaseModel, ConfigDict
from pydantic_core import to_jsonable_python

from oncely import names
from oncely.effects import Effect
from oncely.errors import PermanentError

if TYPE_CHECKING:
    from oncely.jobs.store import JobRecord
    from oncely.llm.model import Model
    from oncely.shadow.evaluate import Evaluator, ModelJudge

RequestT = TypeVar("RequestT", bound=BaseModel)
ResultT = TypeVar("ResultT", bound=BaseModel)

_NAME = re.compile(r"^[a-z][a-z0-9_]{0,39}$")
_ROUTE = re.compile(r"^(/[A-Za-z0-9._~-]+)+$")
# Variant names are model names too (``gpt-4o-mini``, ``llama3:8b``, ``org/model``).
_VARIANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,99}$")
# What ``ctx.variant`` is for the configured model, with no variant named.
PRIMARY = "primary"


class UsageView(BaseModel):
    """Tokens and model calls of the delivery that produced the result."""

    prompt_tokens: int
    completion_tokens: int
    model_calls: int


# Why a job is dead, as its tenant sees it (README: HTTP API). The job row
# keeps the detail (the reason, then the last error, which may quote the
# provider's answer) for operators: the console and ``oncely dlq list``.
DEAD_REASONS = {
    "permanent": "the step failed in a way retrying cannot fix",
    "max_age": "the step kept failing until the job was too old to retry",
    "max_deliveries": "deliveries of the job kept stopping before they finished",
    "malformed": "the queued message could not be read",
}


DeadReason = Literal["permanent", "max_age", "max_deliveries", "malformed", "failed"]


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
    status: Literal["queued", "done", "dead"]
    result: ResultT | None = None
    # Set once the job is dead: one of DEAD_REASONS, or "failed".
    error: DeadReason | None = None
    usage: UsageView | None = None
    created_at: datetime
    updated_at: datetime

    @classmethod
    def from_record(cls, record: JobRecord) -> Self:
        return cls.model_validate(
            {
                "job_id": record.job_id,
                "status": record.status,
                "result": record.result,
                "error": tenant_error(record.error),
                "usage": record.usage,
                "created_at": record.created_at,
                "updated_at": record.updated_at,
            }
        )


@dataclass(frozen=True)
class Emitted:
    """An outbox row a step asked for; written with the result, or not at all."""

    topic: str
    payload: Mapping[str, Any]
    dedupe_key: str


class Context:
    """What a step gets besides its request: who and which job, the model, and
    ``emit`` for effects.

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
        self.emitted: list[Emitted] = []

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
        if any(e.dedupe_key == key for e in self.emitted):
            raise PermanentError(f"dedupe key {key!r} emitted twice by one step")
        data = payload.model_dump(mode="json") if isinstance(payload, BaseModel) else payload
        self.emitted.append(Emitted(topic, to_jsonable_python(data), key))


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
