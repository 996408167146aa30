"""The step kit: how a workflow's step runs, the same wherever it runs: a
job's delivery (jobs/handler.py), a shadow run (shadow/run.py) and a unit
test (oncely.testing). Its model (``step_model``), its context
(``step_context``, the one way to make a ``Context``) and the run itself
(``run_step_function``: the step over its journal, its task groups'
errors reduced to the one that decides, its answer checked against the
declared result).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

from pydantic import BaseModel, ValidationError

from oncely.context import CALL_TIMEOUT_S, MAP_MAX_ITEMS, WAIT_MAX_S, Context, running
from oncely.errors import (
    DeadlineExceeded,
    Nondeterministic,
    PermanentError,
    TransientError,
    short_errors,
)
from oncely.journal import Journal, Replay, RunStopped, Suspended
from oncely.llm.base import LLM
from oncely.llm.model import Model, ModelRoute
from oncely.retry import Deadline, RetryPolicy, classify
from oncely.usage.calls import CallSite
from oncely.workflow import Variant, Workflow

if TYPE_CHECKING:
    from oncely.live.events import LiveJob

T = TypeVar("T")


@dataclass(frozen=True)
class StepConfig:
    """How a step may use the model in one delivery."""

    policy: RetryPolicy
    # Wall-clock budget of one delivery; a fresh one on each redelivery.
    budget_s: float = 60.0
    # Extra model calls after an answer that does not fit the result model.
    invalid_output_retries: int = 2
    # The model's name, for metrics.
    model_name: str = ""
    # The longest ``ctx.wait_for_event`` (and its default timeout).
    wait_max_s: float = WAIT_MAX_S
    # A call's default timeout (``ctx.call``).
    call_timeout_s: float = CALL_TIMEOUT_S
    # The most items one ``ctx.map`` takes.
    map_max_items: int = MAP_MAX_ITEMS


def step_model(
    workflow: str,
    llm: LLM,
    config: StepConfig,
    model_name: str | None = None,
    *,
    journal: Journal | None = None,
    route: ModelRoute | None = None,
    site: CallSite | None = None,
) -> Model:
    """The model one delivery's step uses: ``config``'s retries under a fresh
    budget, its calls checkpoints of ``journal`` (shadow runs name their
    variant's model, and keep no checkpoints), going down ``route`` and
    recorded for ``site``."""
    return Model(
        llm,
        policy=config.policy,
        deadline=Deadline.after(config.budget_s),
        workflow=workflow,
        model_name=config.model_name if model_name is None else model_name,
        invalid_output_retries=config.invalid_output_retries,
        journal=journal,
        route=route,
        site=site,
    )


def step_context(
    workflow: Workflow[Any, Any],
    job_id: str,
    tenant: str,
    model: Model,
    delivery: int,
    *,
    journal: Journal,
    config: StepConfig | None = None,
    variant: Variant | None = None,
    shadow: bool = False,
    live: LiveJob | None = None,
) -> Context:
    """The context a step gets: for ``job_id`` of ``tenant``, its
    ``delivery`` number (1 on the first: ``Delivery.number``), calls and
    waits bounded by ``config`` (default: the settings' defaults)."""
    return Context(
        workflow,
        job_id,
        tenant,
        model,
        delivery,
        variant=variant,
        shadow=shadow,
        journal=journal,
        wait_max_s=config.wait_max_s if config is not None else WAIT_MAX_S,
        call_timeout_s=config.call_timeout_s if config is not None else CALL_TIMEOUT_S,
        map_max_items=config.map_max_items if config is not None else MAP_MAX_ITEMS,
        live=live,
    )


async def run_step_function(
    workflow: Workflow[Any, Any],
    step: Callable[[Any, Context], Awaitable[Any]],
    request: BaseModel,
    ctx: Context,
    journal: Journal,
) -> BaseModel:
    """``step`` on ``request`` over ``journal``: its answer as the declared
    result model; an error its task groups raised, as the one that decides."""
    with running(ctx):
        value = await journal.run(ungrouped(step(request, ctx)))
    return checked_result(workflow, value)


def checked_result(workflow: Workflow[Any, Any], result: Any) -> BaseModel:
    """A step's answer as the declared result model (a plain dict is validated)."""
    if isinstance(result, workflow.result):
        return cast(BaseModel, result)
    try:
        validated: BaseModel = workflow.result.model_validate(result)
    except ValidationError as exc:
        raise PermanentError(f"step returned an invalid result: {short_errors(exc)}") from exc
    return validated


async def ungrouped(step: Awaitable[T]) -> T:
    """The step's value; an exception group its tasks raised (a
    ``TaskGroup``), as the one error that decides the run: a replay, a
    stop, a wait, a nondeterministic run, then transient when every error
    in it can succeed later, else the first permanent one."""
    try:
        return await step
    except BaseExceptionGroup as group:
        raise _deciding(group) from group


def _deciding(group: BaseExceptionGroup[BaseException]) -> BaseException:
    leaves = list(_leaves(group))
    for kind in (Replay, RunStopped, Suspended, Nondeterministic, asyncio.CancelledError):
        found = next((e for e in leaves if isinstance(e, kind)), None)
        if found is not None:
            return found
    # Anything else that is no error (an interrupt, a test's stand-in for
    # kill -9) passes through as itself.
    stopping = next((e for e in leaves if not isinstance(e, Exception)), None)
    if stopping is not None:
        return stopping
    if all(isinstance(e, TransientError | DeadlineExceeded) or classify(e) for e in leaves):
        return TransientError(f"{len(leaves)} failed in parallel: {_short_errors(leaves)}")
    permanent = next((e for e in leaves if isinstance(e, PermanentError)), None)
    return permanent or PermanentError(f"failed in parallel: {_short_errors(leaves)}")


def _leaves(error: BaseException) -> Iterator[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            yield from _leaves(inner)
    else:
        yield error


def _short_errors(errors: list[BaseException]) -> str:
    return "; ".join(f"{type(e).__name__}: {e}" for e in errors)[:500]
