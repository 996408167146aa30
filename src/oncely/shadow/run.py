"""Shadow work: enqueued after a primary result commits, run by its own worker.

``ShadowDispatch.on_end``, told of the primary's done jobs by the jobs'
transitions (``oncely.jobs.transitions``), is all the primary path sees: for a job in
the sample of a shadow variant, one XADD to that variant's stream
(``names.shadow_keys``), carrying the job's request and the primary result.
It runs after the commit and never raises, so a shadow can neither delay the
job's result nor fail it. Shadow work that Redis loses (or that a crash
between the commit and the XADD never enqueued) is not restored: the
reconciler only restores jobs (docs/shadow.md).

``ShadowHandler`` is the handler of that stream's ``Worker``: the variant's
step on the same input, under the shadow share of the fleet limiter; what it
emits is recorded with its result, never written to the outbox; then its
score against the primary. A multi-step step function runs whole: a shadow
run keeps no checkpoints of its own and never reads the primary's, its
sleeps end at once, and its waits get what the primary received (or None).
A permanent failure is stored as the run's error; a transient one is
redelivered later like any job's.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import structlog
from pydantic import BaseModel, ValidationError

from oncely import tracing
from oncely.errors import DeadlineExceeded, PermanentError
from oncely.jobs.kit import StepConfig, run_step_function, step_context, step_model
from oncely.journal import Ephemeral, Journal
from oncely.llm.base import LLM
from oncely.llm.model import Model, ModelRoute
from oncely.queue.stream import JobMessage
from oncely.retry import classify
from oncely.shadow.dispatch import PRIMARY_FIELD
from oncely.shadow.evaluate import Evaluation, ModelJudge, evaluate
from oncely.shadow.store import ShadowResults, ShadowRun
from oncely.usage.calls import CallSite
from oncely.usage.ledger import Ledger
from oncely.workflow import Variant, Workflow

if TYPE_CHECKING:
    from oncely.queue.worker import Delivery

log = structlog.get_logger("oncely.shadow")

_ERROR_CHARS = 500


class ShadowHandler:
    """The worker's handler for one shadow variant of one workflow."""

    def __init__(
        self,
        workflow: Workflow[Any, Any],
        variant: Variant,
        store: ShadowResults,
        llm: LLM,
        config: StepConfig,
        *,
        judge_llm: LLM | None = None,
        events: Callable[[str], Awaitable[Mapping[str, Any]]] | None = None,
        ledger: Ledger | None = None,
    ) -> None:
        self.workflow = workflow
        # Where its calls are recorded, as shadow calls (no tenant's spend).
        self.route = ModelRoute(ledger=ledger)
        # The events the primary's job received (for a workflow that declares some).
        self.events = events
        self.variant = variant
        self.store = store
        # The variant's model, behind the shadow share of the fleet limiter.
        self.llm = llm
        self.config = config
        # The model judge's model (a ModelJudge evaluator), behind the same share.
        self.judge_llm = judge_llm

    async def __call__(self, message: JobMessage, delivery: Delivery) -> str:
        with tracing.span(
            f"oncely.shadow {self.workflow.name}",
            parent=message.traceparent,
            kind="consumer",
            attributes={
                "oncely.workflow": self.workflow.name,
                "oncely.variant": self.variant.name,
                "oncely.job_id": message.job_id,
            },
        ):
            return await self._run(message, delivery)

    async def _run(self, message: JobMessage, delivery: Delivery) -> str:
        if await self.store.stored(message.job_id, self.variant.name):
            return "duplicate"
        journal = Journal(
            store=Ephemeral(await self._events(message.job_id)),
            workflow=f"{self.workflow.name}:shadow:{self.variant.name}",
            sleeps=False,
        )
        site = CallSite(self.workflow.name, message.job_id, message.tenant, shadow=True)
        model = self._model(self.llm, self.variant.model or self.config.model_name, site, journal)
        judge = self._judge(site)
        try:
            primary, request = self._inputs(message, delivery)
            ctx = step_context(
                self.workflow,
                message.job_id,
                message.tenant,
                model,
                delivery.number,
                journal=journal,
                config=self.config,
                variant=self.variant,
                shadow=True,
            )
            step = self.variant.step or self.workflow.step
            result = await run_step_function(self.workflow, step, request, ctx, journal)
            evaluation = await self._evaluate(judge, request, primary, result)
        except Exception as exc:
            if isinstance(exc, DeadlineExceeded) or classify(exc):
                raise  # transient: delivered again later, like a job
            return await self._failed(message.job_id, _usage(model, judge), exc)
        run = ShadowRun(
            workflow=self.workflow.name,
            variant=self.variant.name,
            job_id=message.job_id,
            usage=_usage(model, judge),
            result=result.model_dump(mode="json"),
            emitted=ctx.emitted,
            score=evaluation.score,
            fields=evaluation.fields,
        )
        return "shadowed" if await self.store.record(run) else "duplicate"

    async def record_dead(self, job_id: str, reason: str, generation: int | None = None) -> None:
        """The worker gave up on a delivery (too old, too many deliveries):
        stored as the run's error, so the report counts it (a shadow run
        has no generation of its own)."""
        run = ShadowRun(
            self.workflow.name, self.variant.name, job_id, usage={}, error=reason[:_ERROR_CHARS]
        )
        await self.store.record(run)

    async def _evaluate(
        self, judge: Model | None, request: BaseModel, primary: BaseModel, result: BaseModel
    ) -> Evaluation:
        evaluator = self.workflow.evaluator
        if isinstance(evaluator, ModelJudge):
            assert judge is not None
            return await evaluator.judge(judge, request, primary, result)
        return evaluate(evaluator, primary, result)

    def _judge(self, site: CallSite) -> Model | None:
        """The judge's own Model (its usage kept apart), if the workflow has one."""
        evaluator = self.workflow.evaluator
        if not isinstance(evaluator, ModelJudge):
            return None
        if self.judge_llm is None:
            raise PermanentError("a ModelJudge evaluator needs the handler's judge_llm")
        return self._model(self.judge_llm, evaluator.model or self.config.model_name, site)

    async def _failed(self, job_id: str, usage: Mapping[str, Any], exc: Exception) -> str:
        error = f"{type(exc).__name__}: {exc}"[:_ERROR_CHARS]
        run = ShadowRun(self.workflow.name, self.variant.name, job_id, usage, error=error)
        await self.store.record(run)
        log.info("shadow.failed", job_id=job_id, variant=self.variant.name, error=error)
        return "shadow_failed"

    def _inputs(self, message: JobMessage, delivery: Delivery) -> tuple[BaseModel, BaseModel]:
        """The primary result and the request, as the workflow's models."""
        try:
            primary = self.workflow.result.model_validate_json(delivery.fields[PRIMARY_FIELD])
            request = self.workflow.request.model_validate(message.payload)
        except (KeyError, ValidationError) as exc:
            raise PermanentError(f"shadow message unusable: {type(exc).__name__}") from exc
        return primary, request

    async def _events(self, job_id: str) -> Mapping[str, Any]:
        if not self.workflow.events or self.events is None:
            return {}
        return await self.events(job_id)

    def _model(
        self, llm: LLM, model_name: str, site: CallSite, journal: Journal | None = None
    ) -> Model:
        return step_model(
            self.workflow.name,
            llm,
            self.config,
            model_name,
            journal=journal,
            route=self.route,
            site=site,
        )


def _usage(model: Model, judge: Model | None) -> dict[str, Any]:
    """The run's usage; a judge's calls under ``judge_*`` keys, apart from the
    variant's own (what cost comparisons with the primary read)."""
    usage = model.usage.to_json()
    if judge is not None:
        usage |= {f"judge_{key}": value for key, value in judge.usage.to_json().items()}
    return usage
