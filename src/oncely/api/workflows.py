"""The HTTP routes every registered workflow gets: ``POST <route>`` (the
idempotent intake), ``GET <route>/{job_id}`` (the job and its result),
``POST <route>/{job_id}/cancel``, and ``POST <route>/{job_id}/events/<name>``
for each event it declares (docs/durable-steps.md).

No ``from __future__ import annotations`` here: FastAPI reads each route's
request and response models from annotations built per workflow.
"""

import json
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from functools import partial
from typing import Annotated, Any, Literal, cast

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException

from oncely import metrics, tracing
from oncely.api import route_docs
from oncely.api.approvals import add_approval_route, add_uncertain_route
from oncely.api.idempotency import IdempotentRequest, mark_replayed
from oncely.api.problems import (
    BudgetExceeded,
    RateLimited,
    event_already_received,
    job_finished,
    job_uuid,
    refuse_unstorable_text,
)
from oncely.api.ratelimit import TenantLimiter
from oncely.errors import KeyReused
from oncely.identity import fingerprint
from oncely.jobs.checkpoints import Checkpoints, EventOutcome
from oncely.jobs.records import JobRecord, JobSpec
from oncely.jobs.store import Jobs
from oncely.usage.budgets import Budgets
from oncely.views import JobView
from oncely.workflow import Workflow


class Accepted(BaseModel):
    job_id: uuid.UUID
    status: Literal["queued"]


class EventReceived(BaseModel):
    """An event stored for a job: it resumes the job if the job waits for
    it, or is kept for the wait to come."""

    job_id: uuid.UUID
    event: str
    status: Literal["received"]


class CancelAccepted(BaseModel):
    """A job cancelled: nothing more is written for it."""

    job_id: uuid.UUID
    status: Literal["cancelled"]


@dataclass(frozen=True)
class DirectIntake:
    """How the intake resolves a request without FastAPI's dependencies: its
    tenant (the built-in API keys' ``ApiKeyAuth.tenant_of``) and its claim
    on its key (``idempotent_request_for``)."""

    tenant: Callable[[Request], Awaitable[str]]
    idempotent: Callable[[Request, str], IdempotentRequest]


# The intake's answer, as the client gets it: (request, tenant, accept), where
# ``accept()`` runs the intake and answers as JSON. It may refuse the request
# before calling ``accept`` (a stream with no room: nothing accepted).
Answer = Callable[[Request, str, Callable[[], Awaitable[Response]]], Awaitable[Response]]


async def _as_it_is(accept: Callable[[], Awaitable[Response]]) -> Response:
    return await accept()


def add_workflow_routes(
    router: APIRouter,
    workflow: Workflow[Any, Any],
    *,
    jobs: Callable[[], Jobs],
    tenant: Callable[..., Awaitable[str]],
    idempotent: Callable[..., Awaitable[IdempotentRequest]],
    limiter: Callable[[], TenantLimiter | None] = lambda: None,
    direct: DirectIntake | None = None,
    checkpoints: Callable[[], Checkpoints] | None = None,
    event_idempotent: Callable[..., Awaitable[IdempotentRequest]] | None = None,
    budgets: Callable[[], Budgets | None] = lambda: None,
    answer: Answer | None = None,
) -> None:
    """POST and GET for one workflow, its cancel and its events, added to
    ``router``. ``jobs`` and ``checkpoints`` are called per request, so the
    routes can be built before the lifespan opens the clients.

    The POST is documented from its endpoint's signature (the body model,
    the tenant and idempotency dependencies). With ``direct``, a request
    does not go through FastAPI's dependency solving but through
    ``direct_intake``, which reads and checks it in the same order with the
    same answers, for a fraction of the cost (bench/README.md, Intake);
    without (an app's own ``auth``), FastAPI solves the dependencies."""
    gates = _Gates(limiter, budgets) if answer is None else _Gates(limiter, budgets, answer)
    _add_intake(router, workflow, jobs, idempotent, gates, direct)
    _add_read(router, workflow, jobs, tenant)
    control = checkpoints or (lambda: Checkpoints(jobs()))
    _add_cancel(router, workflow, control, tenant)
    for event, model in workflow.events.items():
        _add_event(router, workflow, event, model, jobs, control, event_idempotent or idempotent)
    if workflow.approvals:
        add_approval_route(router, workflow, jobs, control, event_idempotent or idempotent)
    add_uncertain_route(router, workflow, jobs, control, event_idempotent or idempotent)


@dataclass(frozen=True)
class _Gates:
    """What may refuse a new job before its key is claimed: the tenant's
    request limit and its daily model budget (each None when off)."""

    limiter: Callable[[], TenantLimiter | None]
    budgets: Callable[[], Budgets | None]
    # What the client gets of the intake's answer (its job's stream, if it
    # asked for one: oncely.api.streaming.stream_accepted).
    answer: Answer = field(default=lambda request, tenant, accept: _as_it_is(accept))


def _add_intake(
    router: APIRouter,
    workflow: Workflow[Any, Any],
    jobs: Callable[[], Jobs],
    idempotent: Callable[..., Awaitable[IdempotentRequest]],
    gates: _Gates,
    direct: DirectIntake | None,
) -> None:
    request_model = workflow.request
    intake = _Intake(workflow, jobs, gates)
    Idempotent = Annotated[IdempotentRequest, Depends(idempotent)]

    async def create(
        body: request_model,  # type: ignore[valid-type]
        idem: Idempotent,
        request: Request,
    ) -> Response:
        return await intake(body, idem, request)

    route_class = APIRoute
    if direct is not None:
        route_class = _direct_route(direct_intake(request_model, direct, intake))
    router.add_api_route(
        workflow.route,
        create,
        methods=["POST"],
        route_class_override=route_class,
        status_code=202,
        response_model=Accepted,
        **route_docs.intake(workflow).fields(),
    )


class _Intake:
    """A workflow's intake once its request is read: the tenant's gates,
    then the job accepted under its key, answered as the client asked."""

    def __init__(self, workflow: Workflow[Any, Any], jobs: Callable[[], Jobs], gates: _Gates):
        self.workflow = workflow
        self.jobs = jobs
        self.gates = gates
        self.accepted_total = metrics.JOBS_ACCEPTED.labels(workflow=workflow.name)

    async def __call__(
        self, body: BaseModel, idem: IdempotentRequest, request: Request
    ) -> Response:
        payload = body.model_dump(mode="json")
        refuse_unstorable_text(payload)
        tenant_name = idem.scope.tenant
        location = f"{request.scope['path'].rstrip('/')}/{idem.job_id}"
        # Over the tenant's limit: refused before any key is claimed.
        tenant_limit = self.gates.limiter()
        if tenant_limit is not None:
            admission = await tenant_limit.admit(tenant_name)
            if not admission.admitted:
                raise RateLimited(admission.headers())
        # Found over its budget a moment ago: no key claimed, no Redis call
        # (but a retry of a job it had accepted is answered as ever).
        budget = self.gates.budgets()
        wait_s = budget.refusing(tenant_name) if budget is not None else None
        if wait_s is not None and not await _accepted(idem, self.jobs(), self.workflow.name):
            raise BudgetExceeded(wait_s)

        accept = partial(self._accept, body, payload, idem, location, budget)
        # ``Accept: text/event-stream``: the accepted job's stream instead.
        run = partial(_run, self.workflow, idem, body, accept)
        return await self.gates.answer(request, tenant_name, run)

    async def _accept(
        self,
        body: BaseModel,
        payload: dict[str, Any],
        idem: IdempotentRequest,
        location: str,
        budget: Budgets | None,
    ) -> Response:
        """The job reserved in its tenant's budget, recorded and enqueued."""
        if budget is not None:
            await _reserve(budget, body, idem, self.jobs(), self.workflow.name)
        job = JobSpec(idem.job_id, idem.scope.tenant, self.workflow.name, payload)
        response, fresh = await accept_job(self.jobs(), job, idem, location)
        if fresh:
            self.accepted_total.inc()
        return response


async def _run(
    workflow: Workflow[Any, Any],
    idem: IdempotentRequest,
    body: BaseModel,
    accept: Callable[[], Awaitable[Response]],
) -> Response:
    """The intake under its key (``idem.run``), traced: the trace starts here
    and travels with the job (oncely.tracing)."""
    with tracing.span(
        f"POST {workflow.route}",
        kind="server",
        attributes={"http.request.method": "POST", "http.route": workflow.route},
    ):
        return await idem.run(body, accept)


async def _reserve(
    budget: Budgets, body: BaseModel, idem: IdempotentRequest, jobs: Jobs, workflow: str
) -> None:
    """This request's job's tokens held in its tenant's budget, or
    ``BudgetExceeded`` (concurrent requests cannot overshoot it together).
    Called holding the key: a replay or a duplicate never gets here, so only
    a new job reserves; refused, the key is released. A job accepted before
    (its stored answer expired) is answered as ever."""
    tenant = idem.scope.tenant
    estimate = budget.estimate(len(body.model_dump_json()))
    wait_s = await budget.reserve(tenant, idem.job_id, estimate)
    if wait_s is not None and await jobs.get(workflow, uuid.UUID(idem.job_id), tenant) is None:
        raise BudgetExceeded(wait_s)


async def _accepted(idem: IdempotentRequest, jobs: Jobs, workflow: str) -> bool:
    """Whether this request's job was accepted before (or is being): its
    key is held, or its job exists (the key may have expired)."""
    if await idem.known():
        return True
    return await jobs.get(workflow, uuid.UUID(idem.job_id), idem.scope.tenant) is not None


def _add_read(
    router: APIRouter,
    workflow: Workflow[Any, Any],
    jobs: Callable[[], Jobs],
    tenant: Callable[..., Awaitable[str]],
) -> None:
    view_model = workflow.job_view
    Tenant = Annotated[str, Depends(tenant)]

    @router.get(
        workflow.route + "/{job_id}",
        response_model=view_model,
        **route_docs.read(workflow).fields(),
    )
    async def read(job_id: str, tenant_name: Tenant, response: Response) -> Any:
        record = await jobs().get(workflow.name, job_uuid(job_id), tenant_name)
        if record is None:
            raise HTTPException(404, "job not found")
        # A job changes, and holds a tenant's data: no cache keeps it.
        response.headers["Cache-Control"] = "no-store"
        return await current_view(view_model, record, jobs())


async def current_view(
    view_model: type[JobView[Any]], record: JobRecord, jobs: Jobs
) -> JobView[Any]:
    """What GET answers: the job's row, ``running`` while a worker holds a
    queued job (Redis says so; unreadable: ``queued``, as the row says)."""
    view = view_model.from_record(record)
    if record.status != "queued":
        return view
    stream = jobs.streams.get(record.kind)
    try:
        held = stream is not None and await stream.held(str(record.job_id))
    except RedisError:
        held = False
    return view.model_copy(update={"status": "running"}) if held else view


def _add_cancel(
    router: APIRouter,
    workflow: Workflow[Any, Any],
    checkpoints: Callable[[], Checkpoints],
    tenant: Callable[..., Awaitable[str]],
) -> None:
    Tenant = Annotated[str, Depends(tenant)]

    @router.post(
        workflow.route + "/{job_id}/cancel",
        status_code=202,
        response_model=CancelAccepted,
        **route_docs.cancel(workflow).fields(),
    )
    async def cancel(job_id: str, tenant_name: Tenant) -> Any:
        parsed = job_uuid(job_id)
        found = await checkpoints().cancel(parsed, tenant=tenant_name, kind=workflow.name)
        if found is None:
            raise HTTPException(404, "job not found")
        if found.finished:
            return job_finished(str(parsed), found.status)
        return JSONResponse({"job_id": str(parsed), "status": "cancelled"}, status_code=202)


def _add_event(
    router: APIRouter,
    workflow: Workflow[Any, Any],
    event: str,
    event_model: type[BaseModel],
    jobs: Callable[[], Jobs],
    checkpoints: Callable[[], Checkpoints],
    idempotent: Callable[..., Awaitable[IdempotentRequest]],
) -> None:
    Idempotent = Annotated[IdempotentRequest, Depends(idempotent)]

    async def send(
        job_id: str,
        body: event_model,  # type: ignore[valid-type]
        idem: Idempotent,
    ) -> Response:
        parsed = job_uuid(job_id)
        payload = cast(BaseModel, body).model_dump(mode="json")
        refuse_unstorable_text(payload)
        receive = partial(_receive_event, jobs, checkpoints, workflow, event, parsed, idem, payload)
        # The key covers which job and which event, not only the body: the
        # same key sent to another job is a reused key.
        return await idem.run({"job_id": str(parsed), "event": event, "body": payload}, receive)

    router.add_api_route(
        f"{workflow.route}/{{job_id}}/events/{event}",
        send,
        methods=["POST"],
        status_code=202,
        response_model=EventReceived,
        **route_docs.event(workflow, event).fields(),
    )


async def _receive_event(
    jobs: Callable[[], Jobs],
    checkpoints: Callable[[], Checkpoints],
    workflow: Workflow[Any, Any],
    event: str,
    job_id: uuid.UUID,
    idem: IdempotentRequest,
    payload: Any,
) -> Response:
    """The event stored under its key: 202, or why not."""
    outcome = await checkpoints().receive_event(
        workflow.name, job_id, idem.scope.tenant, event, payload, fingerprint(payload)
    )
    response = _event_response(str(job_id), event, outcome)
    if outcome.resumed is not None:
        # Queued again: enqueued with the stored response, in one round trip.
        idem.settle(response, along=[jobs().enqueue_call(outcome.resumed)])
    return response


def _event_response(job_id: str, event: str, outcome: EventOutcome) -> Response:
    if outcome.outcome == "missing":
        raise HTTPException(404, "job not found")
    if outcome.outcome == "conflict":
        return event_already_received(job_id, event)
    if outcome.outcome == "finished":
        return job_finished(job_id, outcome.status or "finished")
    body = {"job_id": job_id, "event": event, "status": "received"}
    return JSONResponse(body, status_code=202)


async def accept_job(
    jobs: Jobs, job: JobSpec, idem: IdempotentRequest, location: str
) -> tuple[Response, bool]:
    """The intake's handler: 202 once the job row is committed (whatever
    becomes of the enqueue), the same bytes when the row was there before
    (Redis forgot the key), 422 when that row holds another body. A fresh
    job's enqueue goes out with the stored response, in one round trip."""
    acceptance = await jobs.record(job, fingerprint=idem.fingerprint)
    # Rows accepted before fingerprints were kept cannot tell: replayed.
    if acceptance.fingerprint not in (None, idem.fingerprint):
        raise KeyReused("this Idempotency-Key was used with a different request body")
    response = JSONResponse(
        {"job_id": job.job_id, "status": "queued"},
        status_code=202,
        headers={"Location": location},
    )
    if not acceptance.fresh:
        mark_replayed(response)
    # The row is the record of acceptance: from here on, never a 503.
    idem.settle(response, along=[jobs.enqueue_call(job)] if acceptance.fresh else ())
    return response, acceptance.fresh


# -- the intake without FastAPI's dependency solving -------------------------------

Intake = Callable[[BaseModel, IdempotentRequest, Request], Awaitable[Response]]
Handler = Callable[[Request], Coroutine[Any, Any, Response]]
_NO_BODY = object()
# FastAPI's answer to a body it could not read (the problem handlers answer it 422).
_UNPARSABLE = "There was an error parsing the body"


def direct_intake(request_model: type[BaseModel], direct: DirectIntake, intake: Intake) -> Handler:
    """The POST's handler as FastAPI would run it, in its order and with its
    answers: a body that is not JSON (422), then the tenant (401), the key
    (400), the body's validation (422), then ``intake``."""

    async def handle(request: Request) -> Response:
        data = await _json_body(request)
        tenant_name = await direct.tenant(request)
        idem = direct.idempotent(request, tenant_name)
        return await intake(_validated(request_model, data), idem, request)

    return handle


async def _json_body(request: Request) -> Any:
    """The body as FastAPI reads a JSON body parameter: ``_NO_BODY`` when
    empty, parsed when its content type is JSON, else its bytes (which then
    fail validation)."""
    try:
        raw = await request.body()
    except StarletteHTTPException:  # the edge's 408 and 413
        raise
    except Exception as exc:  # the client gone mid-body, say
        raise HTTPException(400, _UNPARSABLE) from exc
    if not raw:
        return _NO_BODY
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if not (
        media_type == "application/json"
        or (media_type.startswith("application/") and media_type.endswith("+json"))
    ):
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        error = {
            "type": "json_invalid",
            "loc": ("body", exc.pos),
            "msg": "JSON decode error",
            "input": {},
            "ctx": {"error": exc.msg},
        }
        raise RequestValidationError([error], body=exc.doc) from exc
    except ValueError as exc:  # not UTF-8, say
        raise HTTPException(400, _UNPARSABLE) from exc
    except RecursionError:  # nested deeper than the parser goes: never a 500
        error = {
            "type": "json_invalid",
            "loc": ("body",),
            "msg": "JSON nested too deeply",
            "input": {},
        }
        raise RequestValidationError([error]) from None


def _validated(request_model: type[BaseModel], data: Any) -> BaseModel:
    """``data`` validated as FastAPI validates a body parameter, its errors'
    locations under ``body``."""
    if data is _NO_BODY:
        missing = {"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}
        raise RequestValidationError([missing])
    try:
        return request_model.model_validate(data, from_attributes=True)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in errors]) from None


def _direct_route(handler: Handler) -> type[APIRoute]:
    """An ``APIRoute`` that runs ``handler`` for every request: FastAPI still
    documents the route from its endpoint, and wraps the handler as it wraps
    its own (exception handlers, the request's exit stacks)."""

    class DirectRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            return handler

    return DirectRoute
