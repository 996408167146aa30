"""Each client call once, without I/O: a generator that yields what to do
(``Send`` a request, ``Sleep``) and is sent what happened (the response,
the transport error, or None after a sleep). ``Client`` and ``AsyncClient``
only perform the steps, so the policy cannot drift between them.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError
from pydantic_core import to_json

from oncely.client.errors import (
    GaveUp,
    Problem,
    UnexpectedResponse,
    WaitTimedOut,
    error_for,
    gave_up,
)
from oncely.client.jobs import Accepted, Cancelled, EventReceived, Job
from oncely.client.policy import Policy, reason_of, retry_after_of, retry_delay_s, worth_retrying

T = TypeVar("T")

# The standard library's logging: silent unless the application configures it
# (a client library must not print into its caller's output).
log = logging.getLogger("oncely.client")

MIN_KEY_LEN = 16
MAX_KEY_LEN = 255
MAX_PREFER_WAIT_S = 10  # the server caps it there too


@dataclass(frozen=True)
class Send:
    """One try of a request; the client adds the API key and base URL."""

    method: str
    path: str
    timeout_s: float
    headers: Mapping[str, str] = field(default_factory=dict)
    content: bytes | None = None


@dataclass(frozen=True)
class Sleep:
    seconds: float


PlanStep = Send | Sleep
Outcome = httpx.Response | Exception | None
Plan = Generator[PlanStep, Outcome, T]


def new_idempotency_key() -> str:
    """43 printable ASCII characters, unique per call."""
    return f"oncely-{uuid.uuid4()}"


def checked_key(key: str) -> str:
    """``key`` if the server will take it (16–255 printable ASCII), else ValueError."""
    if not MIN_KEY_LEN <= len(key) <= MAX_KEY_LEN or not all(" " <= ch <= "~" for ch in key):
        raise ValueError(
            f"an idempotency key is {MIN_KEY_LEN} to {MAX_KEY_LEN} printable ASCII characters"
        )
    return key


def route_path(route: str) -> str:
    """``/v1/triage`` for ``v1/triage/`` too."""
    return "/" + route.strip("/")


def encode(body: BaseModel | Mapping[str, Any]) -> bytes:
    """The JSON sent, computed once so every try sends the same bytes."""
    value = body.model_dump(mode="json", by_alias=True) if isinstance(body, BaseModel) else body
    return to_json(value)


def submit(
    policy: Policy,
    route: str,
    body: BaseModel | Mapping[str, Any],
    idempotency_key: str | None,
    prefer_wait_s: int | None,
) -> Plan[Accepted]:
    """POST with one key across every try, until accepted, refused or out of time."""
    key = checked_key(idempotency_key) if idempotency_key is not None else new_idempotency_key()
    headers = {"Idempotency-Key": key, "Content-Type": "application/json"}
    held_s = 0
    if prefer_wait_s:
        held_s = min(max(int(prefer_wait_s), 0), MAX_PREFER_WAIT_S)
        headers["Prefer"] = f"wait={held_s}"
    content, path = encode(body), route_path(route)

    def attempt(timeout_s: float) -> Send:
        return Send("POST", path, timeout_s, headers, content)

    deadline_at = policy.clock() + policy.deadline_s
    # Each try gets the Prefer wait on top of its timeout: the server may hold it that long.
    response = yield from _request(policy, attempt, deadline_at, key, extra_s=held_s)
    return read_accepted(response, idempotency_key=key)


def send_event(
    policy: Policy,
    route: str,
    job_id: str | uuid.UUID,
    event: str,
    body: BaseModel | Mapping[str, Any],
    idempotency_key: str | None,
) -> Plan[EventReceived]:
    """POST the event with one key across every try, until stored or refused."""
    key = checked_key(idempotency_key) if idempotency_key is not None else new_idempotency_key()
    headers = {"Idempotency-Key": key, "Content-Type": "application/json"}
    content, path = encode(body), f"{route_path(route)}/{job_id}/events/{event}"
    deadline_at = policy.clock() + policy.deadline_s
    response = yield from _request(
        policy, lambda timeout_s: Send("POST", path, timeout_s, headers, content), deadline_at, key
    )
    return read_event(response, idempotency_key=key)


def cancel(policy: Policy, route: str, job_id: str | uuid.UUID) -> Plan[Cancelled]:
    """POST the cancel (idempotent, no key needed) until answered."""
    path = f"{route_path(route)}/{job_id}/cancel"
    deadline_at = policy.clock() + policy.deadline_s
    response = yield from _request(
        policy, lambda timeout_s: Send("POST", path, timeout_s), deadline_at, None
    )
    return read_cancelled(response)


def get(
    policy: Policy,
    route: str,
    job_id: str | uuid.UUID,
    result_type: type[BaseModel] | None,
    deadline_at: float | None = None,
) -> Plan[Job[Any]]:
    """GET one job, retrying what can succeed later until ``deadline_at``."""
    path = f"{route_path(route)}/{job_id}"
    deadline_at = policy.clock() + policy.deadline_s if deadline_at is None else deadline_at
    response = yield from _request(
        policy, lambda timeout_s: Send("GET", path, timeout_s), deadline_at, None
    )
    return read_job(response, result_type)


def wait(
    policy: Policy,
    route: str,
    job_id: str | uuid.UUID,
    result_type: type[BaseModel] | None,
    timeout_s: float,
    until_waiting: bool = False,
) -> Plan[Job[Any]]:
    """GET until the job is done, dead or cancelled (or, ``until_waiting``,
    waiting for an event or a time), backing off between reads; every read
    and its retries end by ``timeout_s``."""
    deadline_at = policy.clock() + timeout_s
    polls = 0
    job: Job[Any] | None = None
    while True:
        try:
            job = yield from get(policy, route, job_id, result_type, deadline_at)
        except GaveUp as exc:
            # A later read that ran out of the wait's time: the wait timed
            # out, on the job as last seen. (The first read failing, or the
            # service answering 503 to the end, is the error it is.)
            if job is None or type(exc) is not GaveUp:
                raise
            raise WaitTimedOut(job, timeout_s=timeout_s, polls=polls) from exc
        polls += 1
        if job.finished or (until_waiting and job.status == "waiting"):
            return job
        remaining_s = deadline_at - policy.clock()
        delay = retry_delay_s(polls, remaining_s=remaining_s, backoff=policy.poll, rand=policy.rand)
        if delay is None:
            raise WaitTimedOut(job, timeout_s=timeout_s, polls=polls)
        yield Sleep(delay)


def _request(
    policy: Policy,
    attempt: Callable[[float], Send],
    deadline_at: float,
    key: str | None,
    *,
    extra_s: float = 0.0,
) -> Plan[httpx.Response]:
    """Try until an answer retrying cannot change: a success is returned, any
    other answer raised as its typed error; out of time, ``gave_up``."""
    attempts = 0
    while True:
        attempts += 1
        remaining_s = deadline_at - policy.clock()
        outcome = yield attempt(max(0.001, min(policy.timeout_s + extra_s, remaining_s)))
        assert outcome is not None, "a Send is answered with a response or an error"
        # The clients hand back only the transport errors worth retrying.
        if isinstance(outcome, httpx.Response) and not worth_retrying(outcome):
            if outcome.is_success:
                return outcome
            raise error_for(outcome, idempotency_key=key)
        delay = _retry_delay(policy, attempts, deadline_at, outcome)
        if delay is None:
            log.info(
                "client.gave_up",
                extra={"event_name": "client.gave_up", "attempts": attempts,
                       "reason": reason_of(outcome)},
            )  # fmt: skip
            cause = outcome if isinstance(outcome, Exception) else None
            raise gave_up(outcome, attempts=attempts, idempotency_key=key) from cause
        log.info(
            "client.retrying",
            extra={"event_name": "client.retrying", "attempt": attempts,
                   "reason": reason_of(outcome), "sleep_s": delay},
        )  # fmt: skip
        yield Sleep(delay)


def _retry_delay(
    policy: Policy, attempts: int, deadline_at: float, outcome: httpx.Response | Exception
) -> float | None:
    return retry_delay_s(
        attempts,
        remaining_s=deadline_at - policy.clock(),
        backoff=policy.retry,
        retry_after_s=retry_after_of(outcome),
        rand=policy.rand,
    )


# -- answers into their types ---------------------------------------------------


def read_accepted(response: httpx.Response, *, idempotency_key: str) -> Accepted:
    try:
        body = response.json()
        return Accepted.model_validate(
            {
                **(body if isinstance(body, dict) else {}),
                "location": response.headers.get("location", ""),
                "replayed": response.headers.get("idempotent-replayed") == "true",
            }
        )
    except (ValueError, ValidationError) as exc:
        raise UnexpectedResponse(
            _unreadable(response, "Accepted", exc), idempotency_key=idempotency_key
        ) from exc


def read_event(response: httpx.Response, *, idempotency_key: str) -> EventReceived:
    try:
        return EventReceived.model_validate(
            {**response.json(), "replayed": response.headers.get("idempotent-replayed") == "true"}
        )
    except (ValueError, TypeError, ValidationError) as exc:
        raise UnexpectedResponse(
            _unreadable(response, "EventReceived", exc), idempotency_key=idempotency_key
        ) from exc


def read_cancelled(response: httpx.Response) -> Cancelled:
    try:
        return Cancelled.model_validate_json(response.content)
    except ValidationError as exc:
        raise UnexpectedResponse(_unreadable(response, "Cancelled", exc)) from exc


def read_job(response: httpx.Response, result_type: type[BaseModel] | None) -> Job[Any]:
    model: type[Job[Any]] = Job[dict[str, Any]] if result_type is None else Job[result_type]  # type: ignore[valid-type]
    try:
        return model.model_validate_json(response.content)
    except ValidationError as exc:
        raise UnexpectedResponse(_unreadable(response, model.__name__, exc)) from exc


def _unreadable(response: httpx.Response, what: str, exc: Exception) -> Problem:
    found = (
        f"{exc.error_count()} validation errors" if isinstance(exc, ValidationError) else "no JSON"
    )
    return Problem(
        status=response.status_code,
        title="Unexpected response",
        detail=f"the answer is not a {what}: {found}",
    )
