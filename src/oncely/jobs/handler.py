"""Running a workflow's step for one delivery of a job.

1. The job's run, loaded (batched across handlers): its status, generation
   and checkpoints. A job that is no longer running (done, dead, cancelled,
   waiting) → nothing to do, no model call.
2. The step, given the validated request and a context over a ``Journal``
   of those checkpoints (oncely/journal.py): each checkpoint it reaches that
   is stored returns its value without running again; the others run (the
   model with classified retries under this delivery's deadline) and are
   written before the next one is paid for, with the effects emitted before
   them.
3. One statement stores the run's last checkpoints, the result, the
   emitted outbox rows and ``done``, only while the job still runs in this
   generation and no other delivery stored a result first, and this
   delivery in the job's history (``done``, or ``duplicate``). A failed
   delivery keeps the checkpoints it reached and is recorded by the worker
   when it settles it.
4. Only then, shadow work for the job if a shadow variant samples it
   (``oncely.shadow``): it never delays or fails the job.

A run that reaches a wait or a sleep ends there: the job waits holding
nothing, and the worker acknowledges its entry. A run that loses a race for
a checkpoint replays from the top over the winner's value. The worker
acknowledges afterwards; a duplicate delivery racing this one writes
nothing but its history row.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar, cast

import structlog
from pydantic import BaseModel, ValidationError

from oncely import metrics, tracing
from oncely.context import CALL_TIMEOUT_S, MAP_MAX_ITEMS, WAIT_MAX_S, Context
from oncely.errors import DeadlineExceeded, Nondeterministic, PermanentError, TransientError
from oncely.jobs.checkpoints import Checkpoints, JobRun
from oncely.jobs.store import Jobs
from oncely.journal import Checkpoint, Journal, Replay, RunStopped, Suspended, Wait, Writes
from oncely.live.events import JobEvents, LiveJob
from oncely.llm.base import LLM
from oncely.llm.model import Model, ModelRoute
from oncely.outbox.wakeup import OutboxWakeUp
from oncely.queue.stream import JobMessage
from oncely.retry import Deadline, RetryPolicy, classify
from oncely.shadow.dispatch import ShadowDispatch
from oncely.usage.ledger import CallSite
from oncely.workflow import Variant, Workflow

if TYPE_CHECKING:
    from oncely.queue.worker import Delivery

log = structlog.get_logger("oncely.handler")

T = TypeVar("T")

# Runs of one delivery that lost a race for a checkpoint and replayed; each
# replay starts with more stored, so this many means something is wrong.
_MAX_REPLAYS = 20


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
        checkpoints: Checkpoints | None = None,
        route: ModelRoute | None = None,
        events: JobEvents | None = None,
    ) -> None:
        self.workflow = workflow
        # Each job's live events (docs/streaming.md); None: none published.
        self.events = events
        self.jobs = jobs
        self.checkpoints = checkpoints or Checkpoints(jobs)
        self.llm = llm
        self.config = config
        # The fallbacks, cooldown and ledger of every delivery's model.
        self.route = route or ModelRoute()
        self.wake_relay = wake_relay
        # The primary variant (ONCELY_PRIMARY); None: the workflow's own step.
        self.variant = variant
        # None without shadow variants: the primary path pays nothing for them.
        self.shadows = shadows
        # Bound once: a labels() lookup per job shows up in profiles.
        self._checkpoints_written = metrics.CHECKPOINTS_WRITTEN.labels(workflow=workflow.name)

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
        run = await self.checkpoints.run_of(message.job_id)
        if (stopped := _not_running(run)) is not None:
            return stopped
        if (live := self._live(message.job_id)) is not None:
            live.status("running")
        try:
            request = self.workflow.request.model_validate(message.payload)
        except ValidationError as exc:
            raise PermanentError(f"stored request no longer validates: {_short(exc)}") from exc
        for _ in range(_MAX_REPLAYS):
            assert run is not None
            outcome = await self._attempt(message, delivery, request, run)
            if outcome is not None:
                return outcome
            run = await self.checkpoints.run_of(message.job_id)
            if (stopped := _not_running(run)) is not None:
                return stopped
        raise TransientError(f"checkpoints changed under {_MAX_REPLAYS} replays of one delivery")

    async def _attempt(
        self, message: JobMessage, delivery: Delivery, request: BaseModel, run: JobRun
    ) -> str | None:
        """One run of the step over ``run``'s checkpoints: its outcome, or
        None when it lost a race for a checkpoint and must replay."""
        delivery.generation = run.generation
        journal, model, ctx = self._run_parts(message, delivery, run)
        step = self.variant.step if self.variant and self.variant.step else self.workflow.step
        try:
            try:
                value = await journal.run(ungrouped(step(request, ctx)))
                result = self._checked(value).model_dump(mode="json")
            finally:
                # Also for a failed delivery: the worker records what it spent.
                delivery.model_calls += model.usage.model_calls
            stored = await self._finish(message, delivery, journal, result, run.generation)
        except Suspended:
            return "waiting"
        except RunStopped:
            return "stopped"
        except Replay:
            return None
        except Exception as exc:
            # Branches the step left running finish what they paid for first.
            await journal.settle(model.deadline.remaining())
            await journal.keep_after_failure(exc)
            raise
        except BaseException as exc:  # cancelled: keep what is done, now
            await journal.keep_after_failure(exc)
            raise
        if not stored:
            return "duplicate"
        if run.parent is not None:
            # A map's child: its end counts in the map (oncely.jobs.children).
            await self.checkpoints.children.ended([message.job_id])
        if self.shadows is not None:
            await self.shadows.after_commit(message, result)
        return "done"

    def _run_parts(
        self, message: JobMessage, delivery: Delivery, run: JobRun
    ) -> tuple[Journal, Model, Context]:
        """The run's journal over its checkpoints, its model and its context,
        all publishing to the job's live stream when there is one."""
        live = self._live(message.job_id)
        store = _JobStore(self, message.job_id, run.generation, delivery, live=live)
        journal = Journal(run.checkpoints, store, workflow=self.workflow.name)
        site = CallSite(self.workflow.name, message.job_id, message.tenant)
        model = store.model = self._model(journal, site)
        if live is not None:
            model.stream_to(live, streaming=self.workflow.stream, redelivered=delivery.number > 1)
        ctx = Context(
            self.workflow,
            message.job_id,
            message.tenant,
            model,
            delivery.number,
            variant=self.variant,
            journal=journal,
            wait_max_s=self.config.wait_max_s,
            live=live,
            call_timeout_s=self.config.call_timeout_s,
            map_max_items=self.config.map_max_items,
        )
        return journal, model, ctx

    def _live(self, job_id: str) -> LiveJob | None:
        return None if self.events is None else LiveJob(self.events, self.workflow.name, job_id)

    async def _finish(
        self,
        message: JobMessage,
        delivery: Delivery,
        journal: Journal,
        result: dict[str, Any],
        generation: int,
    ) -> bool:
        writes = journal.unwritten()
        effects = len(writes.effects)
        with tracing.span("oncely.store_result", attributes={"oncely.effects": effects}):
            stored = await self.jobs.finish(
                self.workflow.name,
                message.job_id,
                result,
                journal.usage(),
                writes,
                generation=generation,
                delivery=delivery.report("done"),
            )
        if stored and writes.checkpoints:
            self._checkpoints_written.inc(len(writes.checkpoints))
        live = self._live(message.job_id)
        if stored and live is not None:
            _published(live, writes)
            live.status("done")
        if stored and writes.effects:
            self.wake_relay.soon()
        return stored

    def _model(self, journal: Journal, site: CallSite) -> Model:
        return step_model(
            self.workflow.name, self.llm, self.config, journal=journal, route=self.route, site=site
        )

    def _checked(self, result: Any) -> BaseModel:
        return checked_result(self.workflow, result)


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


def _not_running(run: JobRun | None) -> str | None:
    """What a delivery of a job that no longer runs comes to (None: it runs).
    Done or gone (erased): a duplicate; else its status (waiting, cancelled,
    dead)."""
    if run is None or run.status == "done":
        return "duplicate"
    return None if run.status == "queued" else run.status


@dataclass
class _JobStore:
    """A delivery's journal store: the job's checkpoints in PostgreSQL, for
    this run's generation; the relay woken for what they emitted."""

    handler: WorkflowHandler
    job_id: str
    generation: int
    delivery: Delivery
    # The run's model, for what the delivery spent before it waits.
    model: Model | None = None
    # Where the job's live events go (None: nowhere).
    live: LiveJob | None = None

    async def write(self, writes: Writes) -> None:
        h = self.handler
        await h.checkpoints.write(h.workflow.name, self.job_id, self.generation, writes)
        if writes.effects:
            h.wake_relay.soon()
        if self.live is not None:
            _published(self.live, writes)

    async def wait(self, writes: Writes, wait: Wait) -> Checkpoint | None:
        h = self.handler
        spent = self.model.usage.model_calls if self.model is not None else 0
        report = replace(
            self.delivery.report("waiting"), model_calls=self.delivery.model_calls + spent
        )
        outcome = await h.checkpoints.start_wait(
            h.workflow.name, self.job_id, self.generation, writes, wait, report
        )
        if writes.effects or wait.call is not None:
            h.wake_relay.soon()
        if self.live is not None:
            _published(self.live, writes)
            if outcome is None:
                self.live.step(wait.key, wait.kind, "waiting")
                self.live.status("waiting", waiting=_waiting(wait))
            else:
                self.live.step(wait.key, wait.kind, outcome.status)
        return outcome


def _published(live: LiveJob, writes: Writes) -> None:
    """A ``step`` event for each checkpoint just stored."""
    for c in writes.checkpoints:
        live.step(c.key, c.kind, c.status, c.usage)


def _waiting(wait: Wait) -> dict[str, Any]:
    """What a job waits on, as its ``status`` event says it (GET's ``waiting``)."""
    detail = dict(wait.detail) if wait.detail is not None else {"event": wait.event}
    if wait.kind == "map":
        return detail  # until its children have ended
    until = datetime.now(UTC) + timedelta(seconds=wait.seconds)
    return {**detail, "until": until.isoformat()}


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
