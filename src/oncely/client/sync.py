"""``Client``: the blocking client, driving ``oncely.client.calls``."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Mapping
from types import TracebackType
from typing import Any, TypeVar, overload

import httpx
from httpx_sse import connect_sse
from pydantic import BaseModel

from oncely import __version__
from oncely.client import calls, streams
from oncely.client.calls import Outcome, Plan, Send, Sleep
from oncely.client.errors import GaveUp, Problem, error_for
from oncely.client.jobs import Accepted, Cancelled, EventReceived, Job, StreamEvent
from oncely.client.policy import (
    POLL_BACKOFF,
    RETRIED_TRANSPORT_ERRORS,
    RETRY_BACKOFF,
    Backoff,
    Policy,
    retry_delay_s,
)

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

USER_AGENT = f"oncely-client/{__version__}"


class Client:
    """oncely's HTTP API for blocking code (see ``oncely.client``).

    ``http``: an ``httpx.Client`` of yours (left open on ``close``);
    ``transport``: for the client this one creates otherwise (tests).
    """

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        timeout: float = 10.0,
        deadline_s: float = 60.0,
        backoff: Backoff = RETRY_BACKOFF,
        poll: Backoff = POLL_BACKOFF,
        http: httpx.Client | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if http is not None and transport is not None:
            raise ValueError("pass an httpx.Client or a transport, not both")
        self.policy = Policy(timeout_s=timeout, deadline_s=deadline_s, retry=backoff, poll=poll)
        self._base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}", "User-Agent": USER_AGENT}
        self._owns_http = http is None
        self._http = http if http is not None else httpx.Client(transport=transport)

    def __repr__(self) -> str:
        return f"Client({self._base_url!r})"

    def submit(
        self,
        route: str,
        body: BaseModel | Mapping[str, Any],
        idempotency_key: str | None = None,
        *,
        prefer_wait_s: int | None = None,
    ) -> Accepted:
        """POST ``body`` to ``route`` (``/v1/triage``) once, whatever it takes.

        Without ``idempotency_key`` one is made, and every retry of this
        call sends it. ``prefer_wait_s`` (≤ 10): the server waits that long
        for a duplicate still in flight instead of answering 409.
        """
        return self._run(calls.submit(self.policy, route, body, idempotency_key, prefer_wait_s))

    @overload
    def get(self, route: str, job_id: str | uuid.UUID) -> Job[dict[str, Any]]: ...
    @overload
    def get(self, route: str, job_id: str | uuid.UUID, *, result_type: type[M]) -> Job[M]: ...
    def get(
        self, route: str, job_id: str | uuid.UUID, *, result_type: type[BaseModel] | None = None
    ) -> Job[Any]:
        """The job now; its ``result`` parsed into ``result_type`` if given."""
        return self._run(calls.get(self.policy, route, job_id, result_type))

    @overload
    def wait(
        self,
        route: str,
        job_id: str | uuid.UUID,
        *,
        timeout_s: float,
        until_waiting: bool = False,
    ) -> Job[dict[str, Any]]: ...
    @overload
    def wait(
        self,
        route: str,
        job_id: str | uuid.UUID,
        *,
        timeout_s: float,
        result_type: type[M],
        until_waiting: bool = False,
    ) -> Job[M]: ...
    def wait(
        self,
        route: str,
        job_id: str | uuid.UUID,
        *,
        timeout_s: float,
        result_type: type[BaseModel] | None = None,
        until_waiting: bool = False,
    ) -> Job[Any]:
        """The job once done, dead or cancelled; with ``until_waiting``, also
        once it waits for an event or a time (``job.waiting`` says which).
        ``WaitTimedOut`` after ``timeout_s``."""
        plan = calls.wait(self.policy, route, job_id, result_type, timeout_s, until_waiting)
        return self._run(plan)

    def send_event(
        self,
        route: str,
        job_id: str | uuid.UUID,
        event: str,
        body: BaseModel | Mapping[str, Any],
        idempotency_key: str | None = None,
    ) -> EventReceived:
        """Send the job the event ``event`` (``POST <route>/{job_id}/events/<event>``)
        once, whatever it takes: one key on every retry. ``EventAlreadyReceived``
        if another event of that name came before, ``JobFinished`` if the job
        is done, dead or cancelled."""
        plan = calls.send_event(self.policy, route, job_id, event, body, idempotency_key)
        return self._run(plan)

    def cancel(self, route: str, job_id: str | uuid.UUID) -> Cancelled:
        """Cancel a queued, running or waiting job (cancelling twice is
        fine); ``JobFinished`` if it is already done or dead."""
        return self._run(calls.cancel(self.policy, route, job_id))

    def stream(
        self, route: str, job_id: str | uuid.UUID, *, after: str | None = None
    ) -> Iterator[StreamEvent]:
        """The job's live events (docs/streaming.md), after ``after`` (an
        event id) if given, until ``end``; a dropped stream is opened again
        after the last event seen (``oncely.client.streams``)."""
        last, failures, since = after, 0, self.policy.clock()
        path = self._base_url + streams.stream_path(route, job_id)
        while True:
            try:
                with connect_sse(
                    self._http,
                    "GET",
                    path,
                    headers=streams.headers(self._headers, last),
                    timeout=streams.timeout(self.policy.timeout_s),
                ) as source:
                    if source.response.status_code != 200:
                        source.response.read()
                        if not streams.reconnects(source.response):
                            raise error_for(source.response)
                    else:
                        failures, since = 0, self.policy.clock()
                        for sse in source.iter_sse():
                            event = streams.event_of(sse)
                            last = event.id or last
                            yield event
                            if event.type == "end":
                                return
            except RETRIED_TRANSPORT_ERRORS:
                pass
            failures += 1
            delay = retry_delay_s(
                failures,
                remaining_s=self.policy.deadline_s - (self.policy.clock() - since),
                backoff=self.policy.retry,
                rand=self.policy.rand,
            )
            if delay is None:
                raise GaveUp(Problem(None, title="the stream kept dropping"), attempts=failures)
            time.sleep(delay)

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _run(self, plan: Plan[T]) -> T:
        outcome: Outcome = None
        while True:
            try:
                step = plan.send(outcome)
            except StopIteration as finished:
                result: T = finished.value
                return result
            outcome = self._perform(step)

    def _perform(self, step: Send | Sleep) -> Outcome:
        if isinstance(step, Sleep):
            time.sleep(step.seconds)
            return None
        try:
            return self._http.request(
                step.method,
                self._base_url + step.path,
                headers={**step.headers, **self._headers},
                content=step.content,
                timeout=step.timeout_s,
            )
        except RETRIED_TRANSPORT_ERRORS as exc:
            return exc
