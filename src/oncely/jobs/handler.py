"""Running a workflow's step for one delivery of a job.

1. A result already stored for this job → nothing to do, no model call.
2. The step, given the validated request and a context (the model with
   classified retries under this delivery's deadline; ``emit``).
3. One statement stores the result, the emitted outbox rows and ``done``,
   only if no other delivery stored a result first, and this delivery in
   the job's history (``done``, or ``duplicate`` if it lost the race). A
   failed delivery is recorded by the worker when it settles it.
4. Only then, shadow work for the job if a shadow variant samples it
   (``oncely.shadow``): it never delays or fails the job.
The worker acknowledges afterwards; a duplicate delivery racing this one
loses at step 3 and writes nothing but its history row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from pydantic import BaseModel, ValidationError

from oncely import tracing
from oncely.errors import PermanentError
from oncely.jobs.store import Jobs
from oncely.llm.base import LLM
from oncely.llm.model import Model
from oncely.outbox.wakeup import OutboxWakeUp
from oncely.queue.stream import JobMessage
from oncely.retry import Deadline, RetryPolicy
from oncely.workflow import Context, Variant, Workflow

if TYPE_CHECKING:
    from oncely.queue.worker import Delivery
    from oncely.shadow.run import ShadowDispatch


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


class WorkflowHandler:
    """The worker's handler for one workflow's jobs."""

    def __init__(
        self,
        workflow: Workflow[Any, Any],
        jobs: Jobs,
        llm: LLM,
        config: StepConfig,
        wake_relay: OutboxWakeUp,
        *,
        variant: Variant | None = None,
        shadows: ShadowDispatch | None = None,
    ) -> None:
        self.workflow = workflow
        self.jobs = jobs
        self.llm = llm
        self.config = config
        self.wake_relay = wake_relay
        # The primary variant (ONCELY_PRIMARY); None: the workflow's own step.
        self.variant = variant
        # None without shadow variants: the primary path pays nothing for them.
        self.shadows = shadows

    async def __call__(self, message: JobMessage, delivery: Delivery) -> str:
        with tracing.span(
            f"oncely.job {self.workflow.name}",
            parent=message.traceparent,
            kind="consumer",
            attributes={
                "oncely.workflow": self.workflow.name,
                "oncely.job_id": message.job_id,
                "oncely.delivery": delivery.number,
            },
        ):
            return await self._run(message, delivery)

    async def _run(self, message: JobMessage, delivery: Delivery) -> str:
        if await self.jobs.result_stored(message.job_id):
            return "duplicate"
        try:
            request = self.workflow.request.model_validate(message.payload)
        except ValidationError as exc:
            raise PermanentError(f"stored request no longer validates: {_short(exc)}") from exc
        model = self._model()
        ctx = Context(
            self.workflow,
            message.job_id,
            message.tenant,
            model,
            delivery.number,
            variant=self.variant,
        )
        step = self.variant.step if self.variant and self.variant.step else self.workflow.step
        try:
            result = self._checked(await step(request, ctx)).model_dump(mode="json")
        finally:
            # Also for a failed delivery: the worker records what it spent.
            delivery.model_calls = model.usage.model_calls
        with tracing.span("oncely.store_result", attributes={"oncely.effects": len(ctx.emitted)}):
            stored = await self.jobs.finish(
                self.workflow.name,
                message.job_id,
                result,
                model.usage.to_json(),
                ctx.emitted,
                delivery=delivery.report("done"),
            )
        if not stored:
            return "duplicate"
        if ctx.emitted:
            self.wake_relay.soon()
        if self.shadows is not None:
            await self.shadows.after_commit(message, result)
        return "done"

    def _model(self) -> Model:
        return step_model(self.workflow.name, self.llm, self.config)

    def _checked(self, result: Any) -> BaseModel:
        return checked_result(self.workflow, result)


def step_model(workflow: str, llm: LLM, config: StepConfig, model_name: str | None = None) -> Model:
    """The model one delivery's step uses: ``config``'s retries under a fresh
    budget (shadow runs name their variant's model)."""
    return Model(
        llm,
        policy=config.policy,
        deadline=Deadline.after(config.budget_s),
        workflow=workflow,
        model_name=config.model_name if model_name is None else model_name,
        invalid_output_retries=config.invalid_output_retries,
    )


def checked_result(workflow: Workflow[Any, Any], result: Any) -> BaseModel:
    """A step's answer as the declared result model (a plain dict is validated)."""
    if isinstance(result, workflow.result):
        return cast(BaseModel, result)
    try:
        validated: BaseModel = workflow.result.model_validate(result)
    except ValidationError as exc:
        raise PermanentError(f"step returned an invalid result: {_short(exc)}") from exc
    return validated


def _short(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or '(root)'}: {e['msg']}" for e in exc.errors()
    )[:500]
