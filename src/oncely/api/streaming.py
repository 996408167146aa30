"""Live job streams over SSE (docs/streaming.md): ``GET
<route>/{job_id}/stream``, ``POST <route>/{job_id}/stream-token``, and the
intake's ``Accept: text/event-stream``.

A stream sends the job's events from Redis (``oncely.live.events``) with
their ids, resumes after ``Last-Event-ID`` (or ``?after=``), and ends with
``end``, whose data is exactly what ``GET <route>/{job_id}`` answers then,
read from PostgreSQL. When Redis has none of the job's events (lost, or
expired), the stream starts with a ``snapshot`` of the job from PostgreSQL
and goes on live; a finished job's stream is a snapshot and its end at
once. PostgreSQL stays the record: at every heartbeat (a comment line every
``heartbeat_s``) the job's row is read again, so a stream ends even if the
event that says so was lost.

Each tenant has at most ``per_tenant`` streams open at once across the
fleet (a sorted set in Redis, each stream renewed at its heartbeats): one
more is 429. An API process that stops ends its streams (clients resume
with ``Last-Event-ID``).

No ``from __future__ import annotations`` here: FastAPI reads the routes'
annotations at runtime.
"""

import asyncio
import contextlib
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

import structlog
from fastapi import APIRouter, Depends, Header, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from redis.exceptions import RedisError

from oncely import names
from oncely.api.problems import RateLimited, Unauthorized, problem_schema
from oncely.api.workflows import current_view
from oncely.jobs.records import JobRecord
from oncely.jobs.store import Jobs
from oncely.live.events import FINISHED, JobEvent, JobEvents
from oncely.live.follow import Followers
from oncely.live.tokens import StreamTokens
from oncely.redis_client import RedisClient
from oncely.workflow import Workflow

log = structlog.get_logger("oncely.streams")

EVENT_STREAM = "text/event-stream"
_SSE_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}

# KEYS[1]: a tenant's open streams. ARGV: the stream, now ms, lapse ms, limit.
# Returns 1 when it is open (or renewed), 0 when the tenant is at its limit.
_OPEN = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[2])
if redis.call('ZSCORE', KEYS[1], ARGV[1]) == false
   and redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[4]) then
  return 0
end
redis.call('ZADD', KEYS[1], tonumber(ARGV[2]) + tonumber(ARGV[3]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""


@dataclass(frozen=True)
class StreamConfig:
    """ONCELY_STREAMS_PER_TENANT and the pace of a stream."""

    per_tenant: int = 100
    # A comment line this often keeps proxies from closing an idle stream;
    # the job's row is read again at each.
    heartbeat_s: float = 15.0


@dataclass
class Live:
    """What the streams of one API process share."""

    redis: RedisClient
    events: JobEvents
    config: StreamConfig = field(default_factory=StreamConfig)
    followers: Followers = field(init=False)
    tokens: StreamTokens = field(init=False)
    stopping: asyncio.Event = field(default_factory=asyncio.Event, init=False)

    def __post_init__(self) -> None:
        self.followers = Followers(self.redis)
        self.tokens = StreamTokens(self.redis)
        self._open = self.redis.register_script(_OPEN)

    def stop(self) -> None:
        """The process stops: every stream ends at its next step."""
        self.stopping.set()

    async def aclose(self) -> None:
        await self.followers.aclose()

    async def hold(self, tenant: str, stream: str) -> bool:
        """Open (or renew) ``stream`` for ``tenant``; False past its limit.
        Redis away: open (the bound protects the fleet, it never stops a
        stream on its own account)."""
        lapse_ms = round(self.config.heartbeat_s * 3 * 1000)
        now_ms = round(time.time() * 1000)
        args: list[str | int] = [stream, now_ms, lapse_ms, self.config.per_tenant]
        try:
            return bool(await self._open(keys=[names.open_streams(_digest(tenant))], args=args))
        except RedisError:
            return True

    async def release(self, tenant: str, stream: str) -> None:
        with contextlib.suppress(RedisError):
            await self.redis.zrem(names.open_streams(_digest(tenant)), stream)


class StreamToken(BaseModel):
    """Opens this job's stream for ``GET …/stream?token=`` until ``expires_at``."""

    token: str
    expires_at: float


def sse(kind: str, data: Any, event_id: str | None = None) -> bytes:
    """One server-sent event."""
    head = f"id: {event_id}\n" if event_id is not None else ""
    body = json.dumps(data, separators=(",", ":"), default=str)
    return f"{head}event: {kind}\ndata: {body}\n\n".encode()


HEARTBEAT = b": keep-alive\n\n"


@dataclass
class JobStream:
    """One client's stream of one job (module docstring)."""

    live: Live
    workflow: Workflow[Any, Any]
    jobs: Jobs
    tenant: str
    job_id: uuid.UUID

    async def events(self, after: str | None) -> AsyncIterator[bytes]:
        name, job_id = self.workflow.name, str(self.job_id)
        record = await self._record()
        if record is None:
            return
        history = await self._history(after)
        finished = record.status in FINISHED
        if finished and (after is None or not any(_finishes(e) for e in history)):
            # Nothing to follow: the job as it ended, at once.
            if after is None:
                yield sse("snapshot", await self._snapshot(record))
            yield sse("end", self._view(record), after or await self._last_id() or "0-0")
            return
        if after is None and not history:
            yield sse("snapshot", await self._snapshot(record))
        last = after or "0-0"
        for event in history:
            last = event.id
            if _finishes(event):
                yield await self._end(event.id)
                return
            yield sse(event.type, event.data, event.id)
        async for chunk in self._follow(name, job_id, last):
            yield chunk

    async def _follow(self, name: str, job_id: str, last: str) -> AsyncIterator[bytes]:
        heartbeat = self.live.config.heartbeat_s
        async with self.live.followers.watch(name, job_id, last) as queue:
            while not self.live.stopping.is_set():
                try:
                    event = await asyncio.wait_for(queue.get(), heartbeat)
                except TimeoutError:
                    record = await self._record()
                    if record is None:
                        return
                    if record.status in FINISHED:
                        yield sse("end", self._view(record), last)
                        return
                    yield HEARTBEAT
                    continue
                last = event.id
                if _finishes(event):
                    yield await self._end(event.id)
                    return
                yield sse(event.type, event.data, event.id)

    async def _record(self) -> JobRecord | None:
        return await self.jobs.get(self.workflow.name, self.job_id, self.tenant)

    async def _history(self, after: str | None) -> list[JobEvent]:
        try:
            return await self.live.events.after(self.workflow.name, str(self.job_id), after)
        except RedisError:
            return []

    async def _last_id(self) -> str | None:
        try:
            return await self.live.events.last_id(self.workflow.name, str(self.job_id))
        except RedisError:
            return None

    async def _end(self, event_id: str) -> bytes:
        record = await self._record()
        data = self._view(record) if record is not None else {"status": "gone"}
        return sse("end", data, event_id)

    def _view(self, record: JobRecord) -> Any:
        view = self.workflow.job_view.from_record(record)
        return json.loads(view.model_dump_json())

    async def _snapshot(self, record: JobRecord) -> dict[str, Any]:
        view = await current_view(self.workflow.job_view, record, self.jobs)
        data = json.loads(view.model_dump_json())
        return {k: data.get(k) for k in ("job_id", "status", "waiting", "steps")}


def _finishes(event: JobEvent) -> bool:
    return (
        event.type == "status"
        and isinstance(event.data, dict)
        and (event.data.get("status") in FINISHED)
    )


def _digest(tenant: str) -> str:
    return names.tenant_digest(tenant) or "-"


async def open_stream(
    live: Live,
    stream: JobStream,
    after: str | None,
    *,
    status_code: int = 200,
    headers: dict[str, str] | None = None,
) -> StreamingResponse:
    """``stream_response`` once the tenant has room for one more (429 else)."""
    hold = secrets.token_hex(8)
    if not await live.hold(stream.tenant, hold):
        raise RateLimited({"Retry-After": str(round(live.config.heartbeat_s))})

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in stream.events(after):
                yield chunk
                if chunk is HEARTBEAT:
                    await live.hold(stream.tenant, hold)
        finally:
            await live.release(stream.tenant, hold)

    return StreamingResponse(
        body(),
        status_code=status_code,
        media_type=EVENT_STREAM,
        headers={**_SSE_HEADERS, **(headers or {})},
    )


def wants_stream(request: Request) -> bool:
    """Whether the client asked for the job's stream (``Accept``)."""
    return EVENT_STREAM in request.headers.get("accept", "")


async def stream_accepted(
    live: Live,
    workflow: Workflow[Any, Any],
    jobs: Jobs,
    tenant: str,
    response: Response,
    request: Request,
) -> Response:
    """The intake's answer as the job's stream, when it accepted (or replays
    an accepted) job and the client asked for the stream; else as it is."""
    if response.status_code != 202 or not wants_stream(request):
        return response
    body = getattr(response, "body", b"")
    try:
        job_id = uuid.UUID(json.loads(body)["job_id"])
    except (ValueError, KeyError, TypeError):
        return response
    kept = {
        k: v
        for k, v in response.headers.items()
        if k.lower() in ("location", "idempotent-replayed")
    }
    after = request.headers.get("last-event-id")
    stream = JobStream(live, workflow, jobs, tenant, job_id)
    return await open_stream(live, stream, after, headers=kept)


_STREAM_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The job's events.",
        "content": {EVENT_STREAM: {"schema": {"type": "string"}}},
    },
    401: problem_schema("No API key and no token, or one that is unknown, revoked or expired."),
    500: problem_schema("An unexpected failure; opening the stream again is safe."),
    404: problem_schema("No such job for this tenant."),
    429: problem_schema("The tenant has its most streams open (`rate-limited`)."),
    503: problem_schema("PostgreSQL did not answer in time; retrying is safe."),
}


def add_stream_routes(
    router: APIRouter,
    workflow: Workflow[Any, Any],
    jobs: Callable[[], Jobs],
    live: Callable[[], Live],
    tenant: Callable[..., Awaitable[str]],
    bearer: Callable[[Request], Awaitable[str]] | None,
) -> None:
    """The job's stream and its token. With oncely's own API keys
    (``bearer``), the stream also opens with a token; with an app's own
    ``auth``, with that alone."""
    _add_token_route(router, workflow, jobs, live, tenant)
    Tenant = Annotated[str, Depends(tenant)]

    async def opened(tenant_name: str, job_id: uuid.UUID, after: str | None) -> Response:
        if await jobs().get(workflow.name, job_id, tenant_name) is None:
            raise HTTPException(404, "job not found")
        stream = JobStream(live(), workflow, jobs(), tenant_name, job_id)
        return await open_stream(live(), stream, after)

    async def with_keys(
        request: Request,
        job_id: str,
        token: str | None = None,
        after: str | None = None,
        last_event_id: Annotated[str | None, Header()] = None,
    ) -> Response:
        parsed = _job_uuid(job_id)
        if token is None:
            assert bearer is not None
            tenant_name = await bearer(request)
        else:
            claims = await live().tokens.claims(token)
            if claims is None or (claims.job_id, claims.workflow) != (str(parsed), workflow.name):
                raise Unauthorized("the stream token is unknown, expired or for another job")
            tenant_name = claims.tenant
        return await opened(tenant_name, parsed, last_event_id or after)

    async def with_own_auth(
        job_id: str,
        tenant_name: Tenant,
        after: str | None = None,
        last_event_id: Annotated[str | None, Header()] = None,
    ) -> Response:
        return await opened(tenant_name, _job_uuid(job_id), last_event_id or after)

    router.add_api_route(
        f"{workflow.route}/{{job_id}}/stream",
        with_keys if bearer is not None else with_own_auth,
        methods=["GET"],
        tags=[workflow.name],
        response_class=StreamingResponse,
        summary=f"Follow a {workflow.name} job live (server-sent events)",
        description="Events `status`, `step`, `token`, `progress`, `reset`, `snapshot`, "
        "then `end` (what GET answers); resume with `Last-Event-ID` or `?after=`; "
        "`?token=` from `stream-token` instead of the API key (docs/streaming.md).",
        operation_id=f"stream_{workflow.name}",
        responses=_STREAM_RESPONSES,
    )


def _add_token_route(
    router: APIRouter,
    workflow: Workflow[Any, Any],
    jobs: Callable[[], Jobs],
    live: Callable[[], Live],
    tenant: Callable[..., Awaitable[str]],
) -> None:
    Tenant = Annotated[str, Depends(tenant)]

    async def token_route(job_id: str, tenant_name: Tenant) -> Any:
        parsed = _job_uuid(job_id)
        if await jobs().get(workflow.name, parsed, tenant_name) is None:
            raise HTTPException(404, "job not found")
        token, expires_at = await live().tokens.issue(workflow.name, str(parsed), tenant_name)
        return JSONResponse({"token": token, "expires_at": expires_at})

    router.add_api_route(
        f"{workflow.route}/{{job_id}}/stream-token",
        token_route,
        methods=["POST"],
        tags=[workflow.name],
        response_model=StreamToken,
        summary=f"A token that opens one {workflow.name} job's stream",
        description="For a browser's `EventSource`, which cannot send headers: "
        "`GET …/stream?token=…` with it, for 10 minutes, this job only.",
        operation_id=f"stream_token_{workflow.name}",
        responses={
            404: problem_schema("No such job for this tenant."),
            503: problem_schema("Redis or PostgreSQL did not answer in time."),
        },
    )


def _job_uuid(job_id: str) -> uuid.UUID:
    try:
        return uuid.UUID(job_id)
    except ValueError:
        raise HTTPException(404, "job not found") from None
