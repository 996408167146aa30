"""What the client raises: one base, one class per answer a caller handles
differently, mapped from the problem+json ``type`` (docs/http-api.md).

Messages carry the server's title and detail and, for ``submit``, the
idempotency key (the caller's, needed to retry later); never the API key.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from oncely.errors import OncelyError

if TYPE_CHECKING:
    from oncely.client.jobs import Job

# The contract's URI prefix (oncely.api.problems.PROBLEM_BASE, kept equal by a
# test): the client does not import the server's HTTP layer.
PROBLEM_BASE = "https://oncely.dev/problems/"


@dataclass(frozen=True)
class Problem:
    """An RFC 9457 answer, or what stands for one when a proxy answered."""

    status: int | None
    type: str = "about:blank"
    title: str = ""
    detail: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def slug(self) -> str | None:
        """``validation`` for ``https://oncely.dev/problems/validation``."""
        return self.type.removeprefix(PROBLEM_BASE) if self.type.startswith(PROBLEM_BASE) else None


class OncelyClientError(OncelyError):
    """Base of every error the client raises: the answer's ``status``,
    ``type``, ``title`` and ``detail`` when there was one, and the
    ``idempotency_key`` of the ``submit`` that failed."""

    def __init__(self, problem: Problem, *, idempotency_key: str | None = None) -> None:
        self.problem = problem
        self.status = problem.status
        self.type = problem.type
        self.title = problem.title
        self.detail = problem.detail
        self.idempotency_key = idempotency_key
        super().__init__(self._message())

    def _message(self) -> str:
        parts = [str(self.status)] if self.status is not None else []
        parts.append(self.title or type(self).__name__)
        text = " ".join(parts) + (f": {self.detail}" if self.detail else "")
        if self.idempotency_key is not None:
            text += f" (Idempotency-Key {self.idempotency_key!r})"
        return text


class BadRequest(OncelyClientError):
    """400: the Idempotency-Key was missing or malformed (or another 400)."""


class Unauthorized(OncelyClientError):
    """401: no, unknown or revoked API key."""


class NotFound(OncelyClientError):
    """404: no such job for this tenant (another tenant's job is 404 too)."""


class PayloadTooLarge(OncelyClientError):
    """413: the body is over the server's ``ONCELY_MAX_BODY_BYTES``."""


class KeyReused(OncelyClientError):
    """422: this idempotency key was used before with a different body."""


class ValidationFailed(OncelyClientError):
    """422: the body failed validation; no key was claimed, so fixing the body
    and retrying with the same key is fine. ``errors``: the server's list."""

    @property
    def errors(self) -> Sequence[Mapping[str, Any]]:
        errors = self.problem.extra.get("errors")
        if errors is None:  # FastAPI's own 422 (a host app's handler): {"detail": [...]}
            errors = self.problem.extra.get("detail")
        return [e for e in errors if isinstance(e, Mapping)] if isinstance(errors, list) else []

    def _message(self) -> str:
        """The answer, then each failed field and why (the first few)."""
        fields = [_field_error(e) for e in self.errors]
        said = "; ".join(fields[:_FIELDS_SHOWN])
        more = f"; and {len(fields) - _FIELDS_SHOWN} more" if len(fields) > _FIELDS_SHOWN else ""
        return super()._message() + (f": {said}{more}" if said else "")


# How many of a 422's failed fields its message names.
_FIELDS_SHOWN = 5


def _field_error(error: Mapping[str, Any]) -> str:
    """``body.text: Field required``, from one of the server's errors."""
    where = ".".join(str(part) for part in error.get("loc") or ()) or "body"
    return f"{where}: {error.get('msg', 'invalid')}"


class JobFinished(OncelyClientError):
    """409: the job is done, dead or cancelled (``job_status``): it takes no
    event and no cancel any more."""

    @property
    def job_status(self) -> str | None:
        status = self.problem.extra.get("job_status")
        return status if isinstance(status, str) else None


class EventAlreadyReceived(OncelyClientError):
    """409: the job already received another event of that name."""


class UnexpectedResponse(OncelyClientError):
    """An answer the client cannot read: a success that is not the documented
    JSON, or a result that does not fit the model it was asked to parse into."""


class GaveUp(OncelyClientError):
    """The client gave up: every try failed in a way that can succeed later
    (connection error, timeout, 408, 409, 429, 5xx) until the deadline. The
    last answer's status and problem are kept; a connection error or timeout
    is the ``__cause__``. For ``submit`` the request may have been accepted:
    retry later with ``idempotency_key`` and it is accepted at most once."""

    def __init__(
        self, problem: Problem, *, attempts: int, idempotency_key: str | None = None
    ) -> None:
        self.attempts = attempts
        super().__init__(problem, idempotency_key=idempotency_key)

    def _message(self) -> str:
        return f"gave up after {self.attempts} attempts: {super()._message()}"


class Unavailable(GaveUp):
    """503 until the deadline: Redis or PostgreSQL did not answer the server;
    nothing was accepted on that answer, retrying with the same key is safe."""


class WaitTimedOut(GaveUp):
    """``wait`` ran out of time while the job was still queued or waiting;
    ``job`` is the last state read."""

    def __init__(self, job: Job[Any], *, timeout_s: float, polls: int) -> None:
        self.job = job
        still: str = job.status
        waiting = job.waiting
        if waiting is not None and waiting.children is not None:
            left = waiting.children.total - waiting.children.done
            left -= waiting.children.dead + waiting.children.cancelled
            still = f"waiting for {left} of its {waiting.children.total} child jobs"
        elif waiting is not None:
            what = f"event {waiting.event!r}" if waiting.event else "its sleep to end"
            until = f" until {waiting.until.isoformat()}" if waiting.until else ""
            still = f"waiting for {what}{until}"
        problem = Problem(
            status=None,
            title="Job not finished",
            detail=f"job {job.job_id} still {still} after {timeout_s:g} s",
        )
        super().__init__(problem, attempts=polls)

    def _message(self) -> str:
        return OncelyClientError._message(self)


_BY_SLUG: dict[str, type[OncelyClientError]] = {
    "idempotency-key-missing": BadRequest,
    "idempotency-key-invalid": BadRequest,
    "unauthorized": Unauthorized,
    "not-found": NotFound,
    "payload-too-large": PayloadTooLarge,
    "idempotency-key-reused": KeyReused,
    "validation": ValidationFailed,
    "job-finished": JobFinished,
    "event-already-received": EventAlreadyReceived,
}
# Answers with no oncely problem type (a proxy, a host app's own handlers).
_BY_STATUS: dict[int, type[OncelyClientError]] = {
    400: BadRequest,
    401: Unauthorized,
    404: NotFound,
    413: PayloadTooLarge,
    422: ValidationFailed,
}


def problem_of(response: httpx.Response) -> Problem:
    """The problem+json body of ``response``, or one made of its status line."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        return Problem(status=response.status_code, title=response.reason_phrase)
    detail = body.get("detail")
    return Problem(
        status=response.status_code,
        type=str(body.get("type") or "about:blank"),
        title=str(body.get("title") or response.reason_phrase),
        detail=detail if isinstance(detail, str) else None,
        extra={k: v for k, v in body.items() if k not in ("type", "title", "status")},
    )


def error_for(response: httpx.Response, *, idempotency_key: str | None = None) -> OncelyClientError:
    """The typed error for an answer that retrying cannot change."""
    problem = problem_of(response)
    slug = problem.slug
    cls = _BY_SLUG.get(slug) if slug is not None else None
    cls = cls or _BY_STATUS.get(response.status_code, OncelyClientError)
    return cls(problem, idempotency_key=idempotency_key)


def gave_up(
    last: httpx.Response | Exception, *, attempts: int, idempotency_key: str | None = None
) -> GaveUp:
    """The error for the last failure once no time is left to retry it."""
    if isinstance(last, httpx.Response):
        problem = problem_of(last)
        cls = Unavailable if last.status_code == 503 else GaveUp
        return cls(problem, attempts=attempts, idempotency_key=idempotency_key)
    problem = Problem(status=None, title="No answer", detail=f"{type(last).__name__}: {last}")
    return GaveUp(problem, attempts=attempts, idempotency_key=idempotency_key)
