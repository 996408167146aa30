"""``AsyncClient``: the asyncio client, driving ``oncely.client.calls``."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Mapping
from types import TracebackType
from typing import Any, TypeVar, overload

import httpx
from httpx_sse import aconnect_sse
from pydantic import BaseModel

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
from oncely.client.sync import USER_AGENT

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


class AsyncClient:
    """oncely's HTTP API for asyncio code (see ``oncely.client``); the same
    calls, arguments and errors as ``Client``.

    ``http``: an ``httpx.AsyncClient`` of yours (left open on ``aclose``);
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
        http: httpx.AsyncClient | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if http is not None and transport is not None:
            raise ValueError("pass an httpx.AsyncClient or a transport, not both")
        self.policy = Policy(timeout_s=timeout, deadline_s=deadline_s, retry=backoff, poll=poll)
        self._base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}", "User-Agent": USER_AGENT}
        self._owns_http = http is None
        self._http = http if http is not None else httpx.AsyncClient(transport=transport)

    def __repr__(self) -> str:
        return f"AsyncClient({self._base_url!r})"

    async def submit(
        self,
        route: str,
        body: BaseModel | Mapping[str, Any],
        idempotency_key: str | None = None,
        *,
        prefer_wait_s: int | None = None,
    ) -> Accepted:
        """See ``Client.submit``."""
        plan = calls.submit(self.policy, route, body, idempotency_key, prefer_wait_s)
        return await self._run(plan)

    @overload
    async def get(self, route: str, job_id: str | uuid.UUID) -> Job[dict[str, Any]]: ...
    @overload
    async def get(self, route: str, job_id: str | uuid.UUID, *, result_type: type[M]) -> Job[M]: ...
    async def get(
        self, route: str, job_id: str | uuid.UUID, *, result_type: type[BaseModel] | None = None
    ) -> Job[Any]:
        """See ``Client.get``."""
        return await self._run(calls.get(self.policy, route, job_id, result_type))

    @overload
    async def wait(
        self,
        route: str,
        job_id: str | uuid.UUID,
        *,
        timeout_s: float,
        until_waiting: bool = False,
    ) -> Job[dict[str, Any]]: ...
    @overload
    async def wait(
        self,
        route: str,
        job_id: str | uuid.UUID,
        *,
        timeout_s: float,
        result_type: type[M],
        until_waiting: bool = False,
    ) -> Job[M]: ...
    async def wait(
        self,
        route: str,
        job_id: str | uuid.UUID,
        *,
        timeout_s: float,
        result_type: type[BaseModel] | None = None,
        until_waiting: bool = False,
    ) -> Job[Any]:
        """See ``Client.wait``."""
        plan = calls.wait(self.policy, route, job_id, result_type, timeout_s, until_waiting)
        return await self._run(plan)

    async def send_event(
        self,
        route: str,
        job_id: str | uuid.UUID,
        event: str,
        body: BaseModel | Mapping[str, Any],
        idempotency_key: str | None = None,
    ) -> EventReceived:
        """See ``Client.send_event``."""
        plan = calls.send_event(self.policy, route, job_id, event, body, idempotency_key)
        return await self._run(plan)

    async def cancel(self, route: str, job_id: str | uuid.UUID) -> Cancelled:
        """See ``Client.cancel``."""
        return await self._run(calls.cancel(self.policy, route, job_id))

    async def stream(
        self, route: str, job_id: str | uuid.UUID, *, after: str | None = None
    ) -> AsyncIterator[StreamEvent]:
        """The job's live events (docs/streaming.md), after ``after`` (an
        event id) if given, until ``end``; a dropped stream is opened again
        after the last event seen (``oncely.client.streams``)."""
        last, failures, since = after, 0, self.policy.clock()
        path = self._base_url + streams.stream_path(route, job_id)
        while True:
            try:
                async with aconnect_sse(
                    self._http,
                    "GET",
                    path,
                    headers=streams.headers(self._headers, last),
                    timeout=streams.timeout(self.policy.timeout_s),
                ) as source:
                    if source.response.status_code != 200:
                        await source.response.aread()
                        if not streams.reconnects(source.response):
                            raise error_for(source.response)
                    else:
                        failures, since = 0, self.policy.clock()
                        async for sse in source.aiter_sse():
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
            await asyncio.sleep(delay)

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def _run(self, plan: Plan[T]) -> T:
        outcome: Outcome = None
        while True:
            try:
                step = plan.send(outcome)
            except StopIteration as finished:
                result: T = finished.value
                return result
            outcome = await self._perform(step)

    async def _perform(self, step: Send | Sleep) -> Outcome:
        if isinstance(step, Sleep):
            await asyncio.sleep(step.seconds)
            return None
        try:
            # httpx's timeouts are per read; a server dripping bytes is cut here.
            async with asyncio.timeout(step.timeout_s):
                return await self._http.request(
                    step.method,
                    self._base_url + step.path,
                    headers={**step.headers, **self._headers},
                    content=step.content,
                    timeout=step.timeout_s,
                )
        except RETRIED_TRANSPORT_ERRORS as exc:
            return exc
        except TimeoutError:
            return httpx.TimeoutException(f"no answer within {step.timeout_s:g} s")
