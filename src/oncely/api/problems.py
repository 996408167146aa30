"""RFC 9457 problem details: the one place errors become HTTP."""

from __future__ import annotations

import traceback
import uuid
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

import psycopg
import psycopg_pool
import redis.exceptions
import structlog
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from oncely.errors import (
    KeyMalformed,
    KeyMissing,
    KeyReused,
    RequestInProgress,
)
from oncely.storable import UNSTORABLE_TEXT, unstorable

PROBLEM_BASE = "https://oncely.dev/problems/"
# The validation errors a 422 lists (``error_count`` says how many there were).
MAX_ERRORS_SHOWN = 20
PROBLEM_MEDIA_TYPE = "application/problem+json"

log = structlog.get_logger("oncely.api")


class Unauthorized(Exception):
    """No, unknown or revoked API key."""


class RateLimited(Exception):
    """The tenant is over its intake limit; carries the RateLimit headers."""

    def __init__(self, headers: dict[str, str]) -> None:
        super().__init__("over the tenant's request limit")
        self.headers = headers


class BudgetExceeded(Exception):
    """The tenant spent its daily model budget: no new work until midnight UTC."""

    def __init__(self, retry_after_s: int) -> None:
        super().__init__("the tenant's daily model budget is spent")
        self.retry_after_s = retry_after_s


class StreamsFull(Exception):
    """This API process has its most live streams open (503)."""

    def __init__(self, retry_after_s: int) -> None:
        super().__init__("this API process has its most streams open")
        self.retry_after_s = retry_after_s


class HoldExpired(Exception):
    """A request ran past the maximum hold of its idempotency key: it was
    stopped and its key released."""

    def __init__(self, max_hold_s: float) -> None:
        super().__init__(f"the request did not finish within {max_hold_s:g} s")


def problem(
    status: int,
    slug: str,
    title: str,
    detail: str | None = None,
    *,
    headers: Mapping[str, str] | None = None,
    **extra: Any,
) -> JSONResponse:
    body: dict[str, Any] = {"type": PROBLEM_BASE + slug, "title": title, "status": status}
    if detail:
        body["detail"] = detail
    body.update(extra)
    return JSONResponse(
        body, status_code=status, headers=dict(headers or {}), media_type=PROBLEM_MEDIA_TYPE
    )


def job_finished(job_id: str, status: str) -> JSONResponse:
    """409: the job is done, dead or cancelled; nothing more can change it.
    (``job_status``: the problem's own ``status`` is the HTTP one.)"""
    return problem(
        409,
        "job-finished",
        "Job finished",
        f"the job is {status}",
        job_id=job_id,
        job_status=status,
    )


def event_already_received(job_id: str, event: str) -> JSONResponse:
    """409: another event of that name was received for the job before."""
    return problem(
        409,
        "event-already-received",
        "Event already received",
        f"the job already received another {event!r} event",
        job_id=job_id,
        event=event,
    )


def approval_already_decided(job_id: str, call_id: str) -> JSONResponse:
    """409: another decision on that tool call was received before."""
    return problem(
        409,
        "approval-already-decided",
        "Approval already decided",
        f"the tool call {call_id!r} was decided otherwise before",
        job_id=job_id,
        call_id=call_id,
    )


def uncertain_already_decided(job_id: str, call_id: str) -> JSONResponse:
    """409: another word on that uncertain call was received before."""
    return problem(
        409,
        "uncertain-already-decided",
        "Uncertain call already decided",
        f"the call {call_id!r} was decided otherwise before",
        job_id=job_id,
        call_id=call_id,
    )


def problem_schema(description: str) -> dict[str, Any]:
    """An OpenAPI ``responses`` entry for a problem+json answer."""
    return {
        "description": description,
        "content": {PROBLEM_MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}}},
    }


_UNAVAILABLE = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    psycopg.OperationalError,
    psycopg_pool.PoolTimeout,
)


def install_problem_handlers(app: FastAPI, *, generic: bool = True) -> None:
    """problem+json for oncely's own errors and for unavailable stores; with
    ``generic``, also for validation and HTTP errors (a host app that mounts
    oncely's routes keeps its own for those). Unhandled exceptions are
    the standalone app's ``Edge``'s (api/edge.py)."""

    @app.exception_handler(Unauthorized)
    async def _unauthorized(_: Request, exc: Unauthorized) -> JSONResponse:
        return problem(
            401, "unauthorized", "Unauthorized", str(exc), headers={"WWW-Authenticate": "Bearer"}
        )

    _install_intake_handlers(app)

    @app.exception_handler(HoldExpired)
    async def _hold_expired(_: Request, exc: HoldExpired) -> JSONResponse:
        log.warning("api.hold_expired")
        return problem(
            503,
            "unavailable",
            "Service unavailable",
            f"{exc}; it was stopped and its key released, retrying is safe",
            headers={"Retry-After": "1"},
        )

    @app.exception_handler(StreamsFull)
    async def _streams_full(_: Request, exc: StreamsFull) -> JSONResponse:
        return problem(
            503,
            "unavailable",
            "Service unavailable",
            f"{exc}; nothing was accepted, retrying (on another process) is safe",
            headers={"Retry-After": str(exc.retry_after_s)},
        )

    for exc_type in _UNAVAILABLE:
        app.add_exception_handler(exc_type, _unavailable)
    if generic:
        _install_generic_handlers(app)


def _install_intake_handlers(app: FastAPI) -> None:
    """The intake's refusals: its key, its tenant's limit and budget."""

    @app.exception_handler(KeyMissing)
    async def _key_missing(_: Request, exc: KeyMissing) -> JSONResponse:
        return problem(400, "idempotency-key-missing", "Idempotency-Key required", str(exc))

    @app.exception_handler(KeyMalformed)
    async def _key_malformed(_: Request, exc: KeyMalformed) -> JSONResponse:
        return problem(400, "idempotency-key-invalid", "Idempotency-Key malformed", str(exc))

    @app.exception_handler(KeyReused)
    async def _key_reused(_: Request, exc: KeyReused) -> JSONResponse:
        return problem(422, "idempotency-key-reused", "Idempotency-Key reused", str(exc))

    @app.exception_handler(RequestInProgress)
    async def _in_progress(_: Request, exc: RequestInProgress) -> JSONResponse:
        return problem(
            409,
            "idempotency-key-in-progress",
            "Request in progress",
            str(exc),
            headers={"Retry-After": "1"},
        )

    @app.exception_handler(RateLimited)
    async def _rate_limited(_: Request, exc: RateLimited) -> JSONResponse:
        return problem(
            429,
            "rate-limited",
            "Too many requests",
            f"{exc}; retry after {exc.headers['Retry-After']} s with the same key",
            headers=exc.headers,
        )

    @app.exception_handler(BudgetExceeded)
    async def _budget_exceeded(_: Request, exc: BudgetExceeded) -> JSONResponse:
        return problem(
            429,
            "budget-exceeded",
            "Budget exceeded",
            f"{exc}; jobs already accepted still run, new ones are accepted again "
            f"in {exc.retry_after_s} s (midnight UTC)",
            headers={"Retry-After": str(exc.retry_after_s)},
        )


def _install_generic_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        found = exc.errors()
        # A body wide enough to fail everywhere gets the first errors, and
        # their count: the answer stays small whatever was sent.
        errors = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
            for e in found[:MAX_ERRORS_SHOWN]
        ]
        return problem(422, "validation", "Invalid request", errors=errors, error_count=len(found))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return http_problem(exc.status_code, exc.detail, headers=exc.headers)


# The problem type of each status an HTTP error may carry (docs/http-api.md);
# any other 4xx is ``bad-request``, any other 5xx ``internal``.
_HTTP_SLUGS = {
    404: "not-found",
    405: "method-not-allowed",
    408: "request-timeout",
    413: "payload-too-large",
    431: "headers-too-large",
}
# FastAPI's answer to a body it could not decode (invalid UTF-8, say): the
# same 422 as any other body that is not JSON.
_UNPARSABLE_BODY = "There was an error parsing the body"


def http_problem(
    status: int, detail: str | None = None, *, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    """The problem for an HTTP error of ``status`` (a 405 keeps its ``Allow``)."""
    if status == 400 and detail == _UNPARSABLE_BODY:
        errors = [{"loc": ["body"], "msg": "the body is not UTF-8 JSON", "type": "json_invalid"}]
        return problem(422, "validation", "Invalid request", errors=errors)
    slug = _HTTP_SLUGS.get(status, "bad-request" if status < 500 else "internal")
    title = HTTPStatus(status).phrase
    extra = dict(headers or {})
    if status == 405 and "allow" in {k.lower() for k in extra}:
        extra = {k: _with_head(v) if k.lower() == "allow" else v for k, v in extra.items()}
    return problem(status, slug, title, None if detail == title else detail, headers=extra)


def _with_head(allow: str) -> str:
    """HEAD is answered wherever GET is (``oncely.api.edge.Edge``)."""
    methods = [m.strip() for m in allow.split(",") if m.strip()]
    if "GET" in methods and "HEAD" not in methods:
        methods.append("HEAD")
    return ", ".join(methods)


async def _unavailable(_: Request, exc: Exception) -> JSONResponse:
    log.warning("api.store_unavailable", error=type(exc).__name__)
    return problem(
        503,
        "unavailable",
        "Service unavailable",
        "a backing store did not answer in time; nothing was accepted, retrying is safe",
        headers={"Retry-After": "1"},
    )


def internal_problem() -> JSONResponse:
    return problem(500, "internal", "Internal error", "retrying with the same key is safe")


def log_unhandled(exc: BaseException) -> None:
    """One line an operator can act on, without the exception's message or
    the frames' locals: either may quote the request (a driver's error
    quotes the SQL parameters it refused)."""
    frames = traceback.extract_tb(exc.__traceback__)
    log.error(
        "api.unhandled",
        error=type(exc).__name__,
        sqlstate=getattr(exc, "sqlstate", None),
        where=[f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in frames[-6:]],
    )


def refuse_unstorable_text(payload: dict[str, Any]) -> None:
    """422 (before any key is claimed) for text PostgreSQL cannot store in
    JSON (``oncely.storable``): otherwise every retry would fail the same
    way, as a 500."""
    found = unstorable(payload, ("body",))
    if found is not None:
        error = {"loc": found, "msg": UNSTORABLE_TEXT, "type": "string_unstorable"}
        raise RequestValidationError([error])


def job_uuid(job_id: str) -> uuid.UUID:
    """A job id from a path; 404 (never 422) for one that is no job id."""
    try:
        return uuid.UUID(job_id)
    except ValueError:
        raise HTTPException(404, "job not found") from None
