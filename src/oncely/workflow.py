"""A workflow: what a team declares.

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
and metrics: see docs/architecture.md. The step runs in a ``Context``
(``oncely.context``); what GET answers is ``JobView`` (``oncely.views``).

A workflow may declare ``variants`` (another model, other instructions, or
another step) and an ``evaluator`` that scores a variant's result against the
primary's: shadow runs (docs/shadow.md) use them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Generic, TypeGuard, TypeVar

from pydantic import BaseModel, ValidationError

from oncely import names
from oncely.context import PRIMARY, WAIT_MAX_S, Step, is_async
from oncely.effects import Effect, WebhookEffect
from oncely.journal import check_name
from oncely.llm.routing import parse_models
from oncely.timetable import Timetable
from oncely.usage.calls import LANES, Lane
from oncely.views import JobView

if TYPE_CHECKING:
    from oncely.agent import Agent
    from oncely.shadow.evaluate import Evaluator, ModelJudge
    from oncely.tools import Tool

RequestT = TypeVar("RequestT", bound=BaseModel)
ResultT = TypeVar("ResultT", bound=BaseModel)

__all__ = ["PRIMARY", "WAIT_MAX_S", "Variant", "Workflow"]

_NAME = re.compile(r"^[a-z][a-z0-9_]{0,39}$")
_ROUTE = re.compile(r"^(/[A-Za-z0-9._~-]+)+$")
# Variant names are model names too (``gpt-4o-mini``, ``llama3:8b``, ``org/model``).
_VARIANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,99}$")


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
    # The agents its step runs: oncely.Agent (their call tools' topics are
    # checked against ``effects``, and a person's edited arguments for an
    # approval tool are checked at the API, docs/agents.md) or a framework's
    # own agent (docs/frameworks.md). Declaring one that may ask for a
    # person's decision is what opens the approvals route.
    agents: Sequence[Agent | object] = ()
    # Every model call of the step streams its tokens to the job's live
    # stream (docs/streaming.md); one call can say otherwise
    # (``ctx.model.complete(..., stream=False)``).
    stream: bool = False
    # How its model calls go unless one says otherwise (docs/lanes.md):
    # ``standard``, ``flex`` (OpenAI's flex tier: cheaper, slower) or
    # ``batch`` (the provider's batch API: about half the price, hours).
    lane: Lane = "standard"
    # A cron expression (``"0 2 * * *"``): a job of this workflow is started
    # at every tick, once across the fleet (docs/fanout.md, Schedules), read
    # in ``schedule_tz``. Its request: ``schedule_request`` (a request, its
    # JSON, or a function of the tick's time giving either), by default the
    # request model with its defaults.
    schedule: str | None = None
    schedule_request: Any = None
    schedule_tz: str = "UTC"
    topics: frozenset[str] = field(init=False)
    # The topics that are calls that answer, with what their answer validates as.
    calls: Mapping[str, type[BaseModel] | bool] = field(init=False)

    def __post_init__(self) -> None:
        self._check_names()
        for event, model in self.events.items():
            check_name(event)
            if not (isinstance(model, type) and issubclass(model, BaseModel)):
                raise ValueError(f"workflow {self.name!r}: event {event!r} needs a pydantic model")
        if not is_async(self.step):
            raise ValueError(f"workflow {self.name!r}: step must be an async function")
        if self.lane not in LANES:
            raise ValueError(
                f"workflow {self.name!r}: lane {self.lane!r}: expected one of {', '.join(LANES)}"
            )
        if self.fallbacks is not None:
            try:
                parse_models(self.fallbacks)
            except ValueError as exc:
                raise ValueError(f"workflow {self.name!r}: fallbacks: {exc}") from None
            object.__setattr__(self, "fallbacks", tuple(self.fallbacks))
        object.__setattr__(self, "events", dict(self.events))
        object.__setattr__(self, "effects", tuple(self.effects))
        object.__setattr__(self, "variants", tuple(self.variants))
        object.__setattr__(self, "topics", frozenset(e.topic for e in self.effects))
        calls = {
            e.topic: e.returns
            for e in self.effects
            if isinstance(e, WebhookEffect) and e.returns is not None
        }
        object.__setattr__(self, "calls", calls)
        object.__setattr__(self, "agents", tuple(self.agents))
        self._check_agents()
        if self.schedule is not None:
            try:
                Timetable(self.schedule, self.schedule_tz)
            except ValueError as exc:
                raise ValueError(f"workflow {self.name!r}: {exc}") from None
            self.scheduled_request(datetime.now(UTC))  # the request must validate

    @property
    def timetable(self) -> Timetable | None:
        """When it runs on its own (``schedule``); None: only when posted."""
        return None if self.schedule is None else Timetable(self.schedule, self.schedule_tz)

    def scheduled_request(self, tick: datetime) -> dict[str, Any]:
        """The request of the job started at ``tick``, as JSON."""
        given = self.schedule_request
        if callable(given) and not isinstance(given, BaseModel):
            given = given(tick)
        if given is None:
            given = {}
        if isinstance(given, BaseModel):
            given = given.model_dump(mode="json")
        try:
            request = self.request.model_validate(given)
        except ValidationError as exc:
            # Where and why, never the value (it may be anything the function made).
            fields = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'request'}: {e['msg']}"
                for e in exc.errors()[:5]
            )
            raise ValueError(
                f"workflow {self.name!r}: schedule_request is no valid request ({fields})"
            ) from None
        dumped: dict[str, Any] = request.model_dump(mode="json")
        return dumped

    def _check_names(self) -> None:
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

    @property
    def approvals(self) -> bool:
        """Whether a person's decision can reach its jobs (the approvals
        route): one of its oncely agents has an approval tool, or it
        declares a framework's agent (whose tools may ask for one)."""
        return any(not _is_oncely_agent(agent) or agent.asks_approval for agent in self.agents)

    def _oncely_agents(self) -> list[Agent]:
        return [agent for agent in self.agents if _is_oncely_agent(agent)]

    def _check_agents(self) -> None:
        for agent in self._oncely_agents():
            missing = sorted(agent.topics - set(self.calls))
            if missing:
                raise ValueError(
                    f"workflow {self.name!r}: agent {agent.name!r} calls {', '.join(missing)}:"
                    " declare each with webhook(topic, returns=...)"
                )

    def approval_tool(self, name: str) -> Tool | None:
        """The approval tool ``name`` of one of the workflow's agents."""
        for agent in self._oncely_agents():
            found = agent.tools.get(name)
            if found is not None and found.approval:
                return found
        return None

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


def _is_oncely_agent(agent: object) -> TypeGuard[Agent]:
    # Imported when asked: declaring a workflow without agents loads none.
    from oncely.agent import Agent

    return isinstance(agent, Agent)
