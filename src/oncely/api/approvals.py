"""``POST <route>/{job_id}/approvals/{call_id}``: a person's decision on a
tool call an agent waits on (docs/agents.md), with the whole idempotency
contract of the intake.

A decision is an event of the job (``approval:<call_id>``, stored with its
fingerprint): the same decision again is answered as before, a different
one is 409 ``approval-already-decided``; a job that does not wait on that
call (unknown, another tenant's, decided and moved on, never asked) is 404.
Edited ``arguments`` are checked against the tool's schema when the
workflow declares the agent (``Workflow(agents=[...])``): 422 otherwise.

No ``from __future__ import annotations`` here: FastAPI reads the route's
annotations at runtime.
"""

import uuid
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from oncely.agent import ApprovalDecision, approval_event
from oncely.api.idempotency import IDEMPOTENCY_RESPONSES, IdempotentRequest
from oncely.api.problems import approval_already_decided, job_finished, problem, problem_schema
from oncely.jobs.approvals import decide
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
        job_id: str, call_id: str, body: ApprovalDecision, idem: Idempotent
    ) -> Response:
        parsed = _job_uuid(job_id)
        payload = body.model_dump(mode="json", exclude_none=True)

        async def receive() -> Response:
            refused = await _edited_arguments_refused(
                workflow, checkpoints(), parsed, idem.scope.tenant, call_id, body
            )
            if refused is not None:
                return refused
            outcome = await decide(
                checkpoints(),
                parsed,
                call_id,
                payload,
                tenant=idem.scope.tenant,
                kind=workflow.name,
            )
            assert outcome is not None  # the tenant's job, or "missing"
            response = _answer(str(parsed), call_id, body, outcome)
            if outcome.resumed is not None:
                idem.settle(response, along=[jobs().enqueue_call(outcome.resumed)])
            return response

        return await idem.run({"job_id": str(parsed), "call_id": call_id, "body": payload}, receive)

    router.add_api_route(
        f"{workflow.route}/{{job_id}}/approvals/{{call_id}}",
        approve,
        methods=["POST"],
        status_code=202,
        tags=[workflow.name],
        response_model=ApprovalReceived,
        summary=f"Approve or reject a tool call a {workflow.name} job waits on",
        description=(
            "`approved` true runs the tool (with the edited `arguments`, if given); false "
            "tells the model it was rejected (`reason`). Same idempotency contract as the "
            "intake."
        ),
        operation_id=f"approve_{workflow.name}",
        responses={
            **IDEMPOTENCY_RESPONSES,
            404: problem_schema("No such job for this tenant, or no such tool call pending."),
            409: problem_schema(
                "Decided otherwise before (`approval-already-decided`), the job is done, "
                "dead or cancelled (`job-finished`), or a request with this key is still "
                "running (`idempotency-key-in-progress`)."
            ),
            422: problem_schema("The body, or edited `arguments` that fail the tool's schema."),
        },
    )


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
    waiting_for, detail = await checkpoints.waiting_detail(workflow.name, job_id, tenant)
    if waiting_for != approval_event(call_id) or not detail:
        return None
    tool = workflow.approval_tool(str(detail.get("approval", {}).get("tool")))
    if tool is None:
        return None
    try:
        tool.args.model_validate(decision.arguments)
    except ValidationError as exc:
        errors = [
            {"loc": ["body", "arguments", *e["loc"]], "msg": e["msg"], "type": e["type"]}
            for e in exc.errors(include_url=False, include_input=False)
        ]
        return problem(422, "validation", "Invalid request", errors=errors)
    return None


def _answer(
    job_id: str, call_id: str, decision: ApprovalDecision, outcome: EventOutcome
) -> Response:
    if outcome.outcome == "missing":
        raise HTTPException(404, "no such tool call waits for a decision")
    if outcome.outcome == "conflict":
        return approval_already_decided(job_id, call_id)
    if outcome.outcome == "finished":
        return job_finished(job_id, outcome.status or "finished")
    status = "approved" if decision.approved else "rejected"
    return JSONResponse({"job_id": job_id, "call_id": call_id, "status": status}, status_code=202)


def _job_uuid(job_id: str) -> uuid.UUID:
    try:
        return uuid.UUID(job_id)
    except ValueError:
        raise HTTPException(404, "job not found") from None
