"""What each of a workflow's routes says of itself in the OpenAPI document:
its summary, description, operation id, and the answers it may give besides
its own success, each a problem+json (docs/http-api.md). The routes
(``workflows.py``, ``approvals.py``, ``streaming.py``) add themselves with
``RouteDoc.fields()``; what they do is there, what they say is here.

The idempotency contract's answers (``IDEMPOTENCY_RESPONSES``) and its two
headers as parameters (``HEADER_PARAMETERS``, for routes whose dependency
reads them without declaring them) are shared by every idempotent route.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from oncely.api.idempotency import KEY_HEADER_DOC, PREFER_HEADER_DOC, REPLAY_HEADER
from oncely.api.problems import problem_schema
from oncely.workflow import Workflow

Responses = dict[int | str, dict[str, Any]]


@dataclass(frozen=True)
class RouteDoc:
    """One route's entry in the OpenAPI document, under its workflow's tag."""

    workflow: str
    operation_id: str
    summary: str
    description: str | None = None
    responses: Responses = field(default_factory=dict)
    openapi_extra: dict[str, Any] | None = None

    def fields(self) -> dict[str, Any]:
        """As ``APIRouter.add_api_route``'s keyword arguments."""
        return {
            "tags": [self.workflow],
            "summary": self.summary,
            "description": self.description,
            "operation_id": self.operation_id,
            "responses": self.responses,
            "openapi_extra": self.openapi_extra,
        }


IDEMPOTENCY_RESPONSES: Responses = {
    400: problem_schema("Idempotency-Key missing, malformed or sent twice."),
    401: problem_schema("Missing, unknown or revoked API key."),
    409: {
        **problem_schema("A request with this key and body is still running; retry later."),
        "headers": {"Retry-After": {"schema": {"type": "integer"}, "description": "Seconds."}},
    },
    413: problem_schema("Request body over `ONCELY_MAX_BODY_BYTES`."),
    429: {
        **problem_schema(
            "Over the tenant's `ONCELY_TENANT_RPM` (`rate-limited`), or over its daily "
            "model budget (`budget-exceeded`, `Retry-After` to midnight UTC); no key "
            "was claimed."
        ),
        "headers": {
            "Retry-After": {"schema": {"type": "integer"}, "description": "Seconds."},
            "RateLimit": {"schema": {"type": "string"}},
            "RateLimit-Policy": {"schema": {"type": "string"}},
        },
    },
    422: problem_schema(
        "The body failed validation (no key was claimed), or the key was used "
        "before with a different body."
    ),
    503: problem_schema(
        "Redis or PostgreSQL did not answer in time, or the request ran past the "
        "maximum hold; nothing was accepted, retrying with the same key is safe."
    ),
}
# What a job's event, approval or uncertain-call route may answer: the same
# contract, without the intake's tenant limit and budget (no 429).
EVENT_RESPONSES = {status: r for status, r in IDEMPOTENCY_RESPONSES.items() if status != 429}

# The two headers as OpenAPI parameters, for routes whose dependency does not
# declare them (``idempotency_dependency(document_headers=False)``).
HEADER_PARAMETERS: list[dict[str, Any]] = [
    {
        "name": "Idempotency-Key",
        "in": "header",
        "required": True,
        "schema": {"type": "string", "title": "Idempotency-Key"},
        "description": KEY_HEADER_DOC,
    },
    {
        "name": "prefer",
        "in": "header",
        "required": False,
        "schema": {"type": "string", "title": "Prefer", "description": PREFER_HEADER_DOC},
        "description": PREFER_HEADER_DOC,
    },
]

_NO_JOB = problem_schema("No such job for this tenant.")
_PG_SLOW = problem_schema("PostgreSQL did not answer in time; retrying is safe.")


def intake(workflow: Workflow[Any, Any]) -> RouteDoc:
    """``POST <route>``."""
    return RouteDoc(
        workflow.name,
        f"create_{workflow.name}",
        workflow.summary or f"Accept a {workflow.name} job",
        responses={
            202: {
                "description": "Accepted (or, with `Idempotent-Replayed`, the stored original).",
                "headers": {
                    "Location": {"schema": {"type": "string"}, "description": "The job's URL."},
                    REPLAY_HEADER: {
                        "schema": {"type": "string", "enum": ["true"]},
                        "description": "Present on a replayed response: the stored original, "
                        "byte for byte.",
                    },
                },
            },
            **IDEMPOTENCY_RESPONSES,
        },
        # The dependency reads the headers without declaring them (one
        # validation less per request): documented here instead.
        openapi_extra={"parameters": HEADER_PARAMETERS},
    )


def read(workflow: Workflow[Any, Any]) -> RouteDoc:
    """``GET <route>/{job_id}``."""
    return RouteDoc(
        workflow.name,
        f"get_{workflow.name}",
        f"Read a {workflow.name} job and, once done, its result",
        responses={404: _NO_JOB, 503: _PG_SLOW},
    )


def cancel(workflow: Workflow[Any, Any]) -> RouteDoc:
    """``POST <route>/{job_id}/cancel``."""
    return RouteDoc(
        workflow.name,
        f"cancel_{workflow.name}",
        f"Cancel a {workflow.name} job",
        "From now on nothing more is written for the job: a running delivery stops "
        "at its next checkpoint (or within the lease renewal interval, its model "
        "call cancelled), a waiting job never resumes. Effects that committed "
        "before stay. Idempotent: no `Idempotency-Key` needed; cancelling twice "
        "answers the same.",
        {
            404: _NO_JOB,
            409: problem_schema(
                "The job is done, dead or cancelled (`job-finished`, with its `status`)."
            ),
            503: _PG_SLOW,
        },
    )


def event(workflow: Workflow[Any, Any], name: str) -> RouteDoc:
    """``POST <route>/{job_id}/events/<name>``."""
    return RouteDoc(
        workflow.name,
        f"send_{workflow.name}_{name.replace('-', '_').replace('.', '_')}",
        f"Send the {name!r} event to a {workflow.name} job",
        f"Stores the event; a job waiting for `{name}` resumes, and one that has "
        "not reached its wait yet finds it there. Same idempotency contract as the "
        "intake.",
        {
            **EVENT_RESPONSES,
            404: _NO_JOB,
            409: problem_schema(
                "Another event of that name was received (`event-already-received`), "
                "the job is done, dead or cancelled (`job-finished`), or a request with "
                "this key is still running (`idempotency-key-in-progress`)."
            ),
        },
    )


def approval(workflow: Workflow[Any, Any]) -> RouteDoc:
    """``POST <route>/{job_id}/approvals/{call_id}``."""
    return RouteDoc(
        workflow.name,
        f"approve_{workflow.name}",
        f"Approve or reject a tool call a {workflow.name} job waits on",
        "`approved` true runs the tool (with the edited `arguments`, if given); false "
        "tells the model it was rejected (`reason`). Same idempotency contract as the "
        "intake.",
        {
            **EVENT_RESPONSES,
            404: problem_schema("No such job for this tenant, or no such tool call pending."),
            409: problem_schema(
                "Decided otherwise before (`approval-already-decided`), the job is done, "
                "dead or cancelled (`job-finished`), or a request with this key is still "
                "running (`idempotency-key-in-progress`)."
            ),
            422: problem_schema("The body, or edited `arguments` that fail the tool's schema."),
        },
    )


def uncertain(workflow: Workflow[Any, Any]) -> RouteDoc:
    """``POST <route>/{job_id}/uncertain/{call_id}``."""
    return RouteDoc(
        workflow.name,
        f"resolve_{workflow.name}",
        f"Say what became of a call a {workflow.name} job could not tell",
        "An at-most-once call whose worker died mid-call: `resend` (true) runs it "
        "again, `result` says it happened with that result, `failed` says it failed "
        "(the reason). Exactly one of them. Same idempotency contract as the intake.",
        {
            **EVENT_RESPONSES,
            404: problem_schema("No such job for this tenant, or no such call pending."),
            409: problem_schema(
                "Decided otherwise before (`uncertain-already-decided`), the job is done, "
                "dead or cancelled (`job-finished`), or a request with this key is still "
                "running (`idempotency-key-in-progress`)."
            ),
            422: problem_schema("The body: exactly one of resend, result or failed."),
        },
    )


def stream(workflow: Workflow[Any, Any], media_type: str) -> RouteDoc:
    """``GET <route>/{job_id}/stream``, its events as ``media_type``."""
    return RouteDoc(
        workflow.name,
        f"stream_{workflow.name}",
        f"Follow a {workflow.name} job live (server-sent events)",
        "Events `status`, `step`, `token`, `progress`, `reset`, `snapshot`, "
        "then `end` (what GET answers); resume with `Last-Event-ID` or `?after=`; "
        "`?token=` from `stream-token` instead of the API key (docs/streaming.md).",
        {
            200: {
                "description": "The job's events.",
                "content": {media_type: {"schema": {"type": "string"}}},
            },
            400: problem_schema("`Last-Event-ID` (or `?after=`) is not the id of an event."),
            401: problem_schema(
                "No API key and no token, or one that is unknown, revoked or expired."
            ),
            500: problem_schema("An unexpected failure; opening the stream again is safe."),
            404: _NO_JOB,
            429: problem_schema("The tenant has its most streams open (`rate-limited`)."),
            503: problem_schema(
                "PostgreSQL did not answer in time, or this process has its most streams "
                "open; retrying is safe."
            ),
        },
    )


def stream_token(workflow: Workflow[Any, Any]) -> RouteDoc:
    """``POST <route>/{job_id}/stream-token``."""
    return RouteDoc(
        workflow.name,
        f"stream_token_{workflow.name}",
        f"A token that opens one {workflow.name} job's stream",
        "For a browser's `EventSource`, which cannot send headers: "
        "`GET …/stream?token=…` with it, for 10 minutes, this job only, while the API key "
        "that asked for it is active.",
        {404: _NO_JOB, 503: problem_schema("Redis or PostgreSQL did not answer in time.")},
    )
