"""A person's decision on a call a job waits on, with the whole idempotency
contract of the intake:

- ``POST <route>/{job_id}/approvals/{call_id}``: may an agent's tool call
  run (docs/agents.md)?
- ``POST <route>/{job_id}/uncertain/{call_id}``: what became of an
  at-most-once call whose outcome is unknown (docs/at-most-once.md):
  ``resend``, ``result`` or ``failed``.

A decision is an event of the job (``approval:<call_id>``,
``uncertain:<call_id>``, stored with its fingerprint): the same decision
again is answered as before, a different one is 409
(``approval-already-decided``, ``uncertain-already-decided``); a job that
does not wait on that call (unknown, another tenant's, decided and moved
on, never asked) is 404. Edited approval ``arguments`` are checked against
the tool's schema when the workflow declares the agent
(``Workflow(agents=[...])``): 422 otherwise.

No ``from __future__ import annotations`` here: FastAPI reads the route's
annotations at runtime.
"""

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from oncely.api import route_docs
from oncely.api.auth import key_id_of
from oncely.api.idempotency import IdempotentRequest
from oncely.api.problems import (
    approval_already_decided,
    job_finished,
    job_uuid,
    problem,
    refuse_unstorable_text,
    uncertain_already_decided,
)
from oncely.decisions import ApprovalDecision, UncertainDecision, is_call_id
from oncely.jobs.approvals import decide, edited_arguments_errors
from oncely.jobs.checkpoints import Checkpoints, EventOutcome
from oncely.jobs.store import Jobs
from oncely.workflow import Workflow


class ApprovalReceived(BaseModel):
    """A decision stored: the tool call runs (approved) or the model is told
    it was rejected, when the job resumes."""

    job_id: uuid.UUID
    call_id: str
    status: Literal["approved", "rejected"]


def add_approval_route(
    router: APIRouter,
    workflow: Workflow[Any, Any],
    jobs: Callable[[], Jobs],
    checkpoints: Callable[[], Checkpoints],
    idempotent: Callable[..., Awaitable[IdempotentRequest]],
) -> None:
    Idempotent = Annotated[IdempotentRequest, Depends(idempotent)]

    async def approve(
        job_id: str, call_id: str, body: ApprovalDecision, idem: Idempotent, request: Request
    ) -> Response:
        async def refused(parsed: uuid.UUID, tenant: str) -> Response | None:
            return await _edited_arguments_refused(
                workflow, checkpoints(), parsed, tenant, call_id, body
            )

        return await _take(
            _Route(workflow, jobs, checkpoints, "approval", approval_already_decided),
            idem,
            request,
            job_id,
            call_id,
            body.model_dump(mode="json", exclude_none=True),
            "approved" if body.approved else "rejected",
            refused,
        )

    router.add_api_route(
        f"{workflow.route}/{{job_id}}/approvals/{{call_id}}",
        approve,
        methods=["POST"],
        status_code=202,
        response_model=ApprovalReceived,
        **route_docs.approval(workflow).fields(),
    )


class UncertainReceived(BaseModel):
    """A person's word on an uncertain call stored: the job resumes with it."""

    job_id: uuid.UUID
    call_id: str
    status: Literal["resend", "result", "failed"]


def add_uncertain_route(
    router: APIRouter,
    workflow: Workflow[Any, Any],
    jobs: Callable[[], Jobs],
    checkpoints: Callable[[], Checkpoints],
    idempotent: Callable[..., Awaitable[IdempotentRequest]],
) -> None:
    Idempotent = Annotated[IdempotentRequest, Depends(idempotent)]

    async def resolve(
        job_id: str, call_id: str, body: UncertainDecision, idem: Idempotent, request: Request
    ) -> Response:
        return await _take(
            _Route(workflow, jobs, checkpoints, "uncertain", uncertain_already_decided),
            idem,
            request,
            job_id,
            call_id,
            body.model_dump(mode="json", exclude_unset=True),
            _chosen(body),
        )

    router.add_api_route(
        f"{workflow.route}/{{job_id}}/uncertain/{{call_id}}",
        resolve,
        methods=["POST"],
        status_code=202,
        response_model=UncertainReceived,
        **route_docs.uncertain(workflow).fields(),
    )


@dataclass(frozen=True)
class _Route:
    """What one kind of decision route takes: its workflow's stores, the
    event the decision is stored as, and the problem for a conflict."""

    workflow: Workflow[Any, Any]
    jobs: Callable[[], Jobs]
    checkpoints: Callable[[], Checkpoints]
    on: Literal["approval", "uncertain"]
    conflict: Callable[[str, str], Response]


async def _take(
    route: _Route,
    idem: IdempotentRequest,
    request: Request,
    job_id: str,
    call_id: str,
    payload: dict[str, Any],
    status: str,
    refused: Callable[[uuid.UUID, str], Awaitable[Response | None]] | None = None,
) -> Response:
    """Store a person's decision on ``call_id`` under the intake's
    idempotency contract: 404 for an id oncely did not make, ``refused``'s
    answer when it has one, else 202 with ``status`` (the job resumes)."""
    parsed = job_uuid(job_id)
    if not is_call_id(call_id):
        # Only ids oncely made name a call (oncely.decisions).
        raise HTTPException(404, "no such call waits for a decision")
    refuse_unstorable_text(payload)
    tenant = idem.scope.tenant

    async def receive() -> Response:
        if refused is not None and (refusal := await refused(parsed, tenant)) is not None:
            return refusal
        outcome = await decide(
            route.checkpoints(),
            parsed,
            call_id,
            payload,
            by=decided_by(request, tenant),
            tenant=tenant,
            kind=route.workflow.name,
            on=route.on,
        )
        assert outcome is not None  # the tenant's job, or "missing"
        response = _answered(str(parsed), call_id, outcome, route.conflict, status)
        if outcome.resumed is not None:
            idem.settle(response, along=[route.jobs().enqueue_call(outcome.resumed)])
        return response

    return await idem.run({"job_id": str(parsed), "call_id": call_id, "body": payload}, receive)


def _chosen(decision: UncertainDecision) -> str:
    if decision.resend:
        return "resend"
    return "failed" if decision.failed is not None else "result"


async def _edited_arguments_refused(
    workflow: Workflow[Any, Any],
    checkpoints: Checkpoints,
    job_id: uuid.UUID,
    tenant: str,
    call_id: str,
    decision: ApprovalDecision,
) -> Response | None:
    """422 when edited arguments fail the pending tool's schema."""
    if decision.arguments is None:
        return None
    errors = await edited_arguments_errors(
        workflow, checkpoints, job_id, tenant, call_id, decision.arguments
    )
    if not errors:
        return None
    return problem(
        422,
        "validation",
        "Invalid request",
        errors=[{**e, "loc": ["body", *e["loc"]]} for e in errors],
    )


def _answered(
    job_id: str,
    call_id: str,
    outcome: EventOutcome,
    conflict: Callable[[str, str], Response],
    status: str,
) -> Response:
    if outcome.outcome == "missing":
        raise HTTPException(404, "no such call waits for a decision")
    if outcome.outcome == "conflict":
        return conflict(job_id, call_id)
    if outcome.outcome == "finished":
        return job_finished(job_id, outcome.status or "finished")
    return JSONResponse({"job_id": job_id, "call_id": call_id, "status": status}, status_code=202)


def decided_by(request: Request, tenant: str) -> str:
    """Who decided, as the decision keeps it: the API key's id (what
    ``oncely keys list`` shows, never the key), else the tenant (an
    embedding application's own auth)."""
    key_id = key_id_of(request)
    return f"key:{key_id}" if key_id is not None else f"tenant:{tenant}"
