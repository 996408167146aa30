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
4. Only then, the job's end told (``Jobs.transitions``): a map child's
   count in its map, shadow work if a shadow variant samples it
   (``oncely.shadow``); neither ever fails the job.

A run that reaches a wait or a sleep ends there: the job waits holding
nothing, and the worker acknowledges its entry. A run that loses a race for
a checkpoint replays from the top over the winner's value. The worker
acknowledges afterwards; a duplicate delivery racing this one writes
nothing but its history row.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import structlog
from pydantic import BaseModel, ValidationError

from oncely import metrics, tracing
from oncely.context import Context
from oncely.errors import (
    PermanentError,
    TransientError,
    short_errors,
)
from oncely.jobs.checkpoints import Checkpoints, JobRun
from oncely.jobs.kit import StepConfig, run_step_function, step_context, step_model
from oncely.jobs.store import Jobs
from oncely.jobs.transitions import Ended
from oncely.journal import Checkpoint, Journal, Replay, RunStopped, Suspended, Wait, Writes
from oncely.live.events import JobEvents, LiveJob
from oncely.llm.base import LLM
from oncely.llm.model import Model, ModelRoute
from oncely.outbox.wakeup import OutboxWakeUp
from oncely.queue.stream import JobMessage
from oncely.usage.calls import CallSite
from oncely.workflow import Variant, Workflow

if TYPE_CHECKING:
    from oncely.queue.worker import Delivery

log = structlog.get_logger("oncely.handler")

T = TypeVar("T")

# Runs of one delivery that lost a race for a checkpoint and replayed; each
# replay starts with more stored, so this many means something is wrong.
_MAX_REPLAYS = 20


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
            raise PermanentError(
                f"stored request no longer validates: {short_errors(exc)}"
            ) from exc
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
                checked = await run_step_function(self.workflow, step, request, ctx, journal)
                result = checked.model_dump(mode="json")
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
        finally:
            if journal.diverged:
                await self.checkpoints.flag_diverged(message.job_id, journal.diverged)
        if not stored:
            return "duplicate"
        # Its stream heard "done" with its tokens (_finish); what follows a
        # job's end is the transitions' (a map's count, the shadow runs).
        end = Ended(
            self.workflow.name,
            message.job_id,
            "done",
            child=run.parent is not None,
            tenant=message.tenant,
            payload=message.payload,
            result=result,
        )
        await self.jobs.transitions.ended(end, told=True)
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
        # A background response its call waits for is cancelled with the job.
        model.cancelled_when(lambda: delivery.job_cancelled)
        if live is not None:
            model.stream_to(live, streaming=self.workflow.stream, delivery=delivery.number)
        ctx = step_context(
            self.workflow,
            message.job_id,
            message.tenant,
            model,
            delivery.number,
            journal=journal,
            config=self.config,
            variant=self.variant,
            live=live,
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
