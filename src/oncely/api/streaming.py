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

A client's resume id is checked here, before it reaches the process's
shared reader (``oncely.live.follow``): one that is no event id is 400.

Each tenant has at most ``per_tenant`` streams open at once across the
fleet (a sorted set in Redis, each stream's place renewed by a timer while
its connection is open): one more is 429. Each process has at most
``per_process`` open: one more is 503. What a client that reads nothing
costs is bounded: the history is read a page at a time, a stream holds at
most ``WATCHER_LIMIT`` live events unsent (then it ends), and a write the
client has not taken within ``stall_s`` ends it. An API process that stops
ends its streams (clients resume with ``Last-Event-ID``).

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
from functools import partial
from typing import Annotated, Any

import psycopg
import psycopg_pool
import structlog
from fastapi import APIRouter, Depends, Header, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from redis.exceptions import RedisError
from starlette.types import Message, Receive, Scope, Send

from oncely import names
from oncely.api import route_docs
from oncely.api.auth import ApiKeyAuth, key_id_of
from oncely.api.problems import RateLimited, StreamsFull, Unauthorized, job_uuid
from oncely.api.workflows import current_view
from oncely.jobs.records import JobRecord
from oncely.jobs.store import Jobs
from oncely.live.events import JobEvent, JobEvents, event_id
from oncely.live.follow import Followers
from oncely.live.tokens import StreamTokens
from oncely.redis_client import RedisClient
from oncely.statuses import FINISHED
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


# The history a stream reads from Redis at once: what a client that reads
# nothing can make the process hold of it.
HISTORY_PAGE = 100


@dataclass(frozen=True)
class StreamConfig:
    """ONCELY_STREAMS_PER_TENANT, ONCELY_STREAMS_PER_PROCESS and the pace of
    a stream."""

    per_tenant: int = 100
    # A comment line this often keeps proxies from closing an idle stream;
    # the job's row is read again at each, and each stream's place in its
    # tenant's set is renewed as often.
    heartbeat_s: float = 15.0
    # Open streams this API process serves at once (each costs a bounded
    # amount of memory, this bounds their sum).
    per_process: int = 1000
    # A write the client has not taken this long ends the stream (None: two
    # heartbeats, so that a client that reads at all is never cut).
    stall_after_s: float | None = None

    @property
    def stall_s(self) -> float:
        return 2 * self.heartbeat_s if self.stall_after_s is None else self.stall_after_s


@dataclass
class Live:
    """What the streams of one API process share."""

    redis: RedisClient
    events: JobEvents
    config: StreamConfig = field(default_factory=StreamConfig)
    followers: Followers = field(init=False)
    tokens: StreamTokens = field(init=False)
    stopping: asyncio.Event = field(default_factory=asyncio.Event, init=False)

    # Streams open on this process now (``StreamConfig.per_process``).
    open: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.followers = Followers(self.redis)
        self.tokens = StreamTokens(self.redis)
        self._open = self.redis.register_script(_OPEN)

    async def admit(self, tenant: str, allowed: "Allowed | None" = None) -> "Hold":
        """A place for one more stream of ``tenant``: on this process (else
        ``StreamsFull``, 503) and in the tenant's set across the fleet (else
        ``RateLimited``, 429). ``allowed`` is asked every heartbeat whether
        the stream may go on (its API key still active)."""
        retry_after = str(round(self.config.heartbeat_s))
        if self.open >= self.config.per_process:
            log.warning("stream.process_full", open=self.open)
            raise StreamsFull(round(self.config.heartbeat_s))
        # Counted before the Redis round trip: concurrent admissions cannot
        # overshoot together.
        self.open += 1
        place = Hold(self, tenant, secrets.token_hex(8), allowed)
        try:
            held = await self.hold(tenant, place.name)
        except BaseException:
            self.open -= 1
            raise
        if not held:
            self.open -= 1
            raise RateLimited({"Retry-After": retry_after})
        return place

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


# Whether a stream may go on: its API key still active (``key_still_active``).
Allowed = Callable[[], Awaitable[bool]]


@dataclass(eq=False)
class Hold:
    """One open stream's place: counted on its process, held in its
    tenant's set. ``release`` (once) gives both back."""

    live: Live
    tenant: str
    name: str
    allowed: Allowed | None = None
    released: bool = False

    async def renew(self) -> bool:
        """Renew the place; whether the stream may go on."""
        await self.live.hold(self.tenant, self.name)
        return self.allowed is None or await self.allowed()

    async def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.live.open -= 1
        await self.live.release(self.tenant, self.name)


class EventStream(StreamingResponse):
    """A job's stream as its client gets it, holding its place (``Hold``)
    for as long as the connection is open: renewed by a timer, never by the
    writes (a client that reads nothing blocks the writes, and must still
    count against its tenant), given back at the end. A write the client
    has not taken within ``stall_s`` ends the stream and its connection."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        hold: Hold,
        *,
        status_code: int = 200,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(content, status_code, {**_SSE_HEADERS, **(headers or {})}, EVENT_STREAM)
        self.hold = hold
        self._content = content
        # When the write in progress began (loop time), None between writes.
        self._writing_since: float | None = None
        # Why the keeper ended the stream (the log event), if it did.
        self._cut = "stream.stalled"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with asyncio.timeout(None) as bound:
                keeper = asyncio.create_task(self._keep(bound))
                try:
                    await super().__call__(scope, receive, self._timed(send))
                finally:
                    await _stopped(keeper)
        except TimeoutError:
            # The server closes a connection whose answer ends unfinished.
            log.info(self._cut, stall_s=self.hold.live.config.stall_s)
        finally:
            with contextlib.suppress(RuntimeError):
                await self._content.aclose()  # type: ignore[attr-defined]
            await self.hold.release()

    def _timed(self, send: Send) -> Send:
        loop = asyncio.get_running_loop()

        async def timed(message: Message) -> None:
            self._writing_since = loop.time()
            await send(message)
            self._writing_since = None

        return timed

    async def _keep(self, bound: asyncio.Timeout) -> None:
        """Renew the place every heartbeat; end the stream when a write
        stalled, or its API key was revoked."""
        config = self.hold.live.config
        loop = asyncio.get_running_loop()
        tick = min(config.heartbeat_s, config.stall_s) / 4
        renewed = loop.time()
        while True:
            await asyncio.sleep(tick)
            now = loop.time()
            since = self._writing_since
            if since is not None and now - since >= config.stall_s:
                bound.reschedule(now)
                return
            if now - renewed >= config.heartbeat_s:
                renewed = now
                if not await self.hold.renew():
                    self._cut = "stream.key_revoked"
                    bound.reschedule(now)
                    return


async def _stopped(keeper: asyncio.Task[None]) -> None:
    """Cancel a stream's keeper; a failure of its own is logged, never lost."""
    keeper.cancel()
    [outcome] = await asyncio.gather(keeper, return_exceptions=True)
    if isinstance(outcome, Exception):
        log.error("stream.keeper_failed", error=type(outcome).__name__)


class StreamToken(BaseModel):
    """Opens this job's stream for ``GET …/stream?token=`` until ``expires_at``."""

    token: str
    expires_at: int


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
        """The stream after the event ``after`` (an event id, or None: from
        the start)."""
        record = await self._record()
        if record is None:
            return
        if record.status in FINISHED and after is None:
            # Nothing to follow: the job as it ended, at once.
            yield sse("snapshot", await self._snapshot(record))
            yield sse("end", self._view(record), await self._last_id() or "0-0")
            return
        page = await self._page(after)
        if after is None and not page:
            yield sse("snapshot", await self._snapshot(record))
        last = after or "0-0"
        while page:
            for event in page:
                last = event.id
                if _finishes(event):
                    yield await self._end(event.id)
                    return
                yield sse(event.type, event.data, event.id)
            page = await self._page(last) if len(page) >= HISTORY_PAGE else []
        if record.status in FINISHED:
            # Finished, and Redis kept no event that says so.
            yield sse("end", self._view(record), last)
            return
        async for chunk in self._follow(self.workflow.name, str(self.job_id), last):
            yield chunk

    async def _follow(self, name: str, job_id: str, last: str) -> AsyncIterator[bytes]:
        heartbeat = self.live.config.heartbeat_s
        async with self.live.followers.watch(name, job_id, last) as watcher:
            while not self.live.stopping.is_set():
                try:
                    event = await asyncio.wait_for(watcher.queue.get(), heartbeat)
                except TimeoutError:
                    record = await self._record()
                    if record is None:
                        return
                    if record.status in FINISHED:
                        yield sse("end", self._view(record), last)
                        return
                    yield HEARTBEAT
                    continue
                if event is None:
                    # Cut off (too far behind, or the job's events unreadable):
                    # the client resumes after ``last``.
                    return
                last = event.id
                if _finishes(event):
                    yield await self._end(event.id)
                    return
                yield sse(event.type, event.data, event.id)

    async def _record(self) -> JobRecord | None:
        return await self.jobs.get(self.workflow.name, self.job_id, self.tenant)

    async def _page(self, after: str | None) -> list[JobEvent]:
        """The next ``HISTORY_PAGE`` events after ``after`` (a page at a
        time: a client that reads nothing holds one page, not the history)."""
        name, job_id = self.workflow.name, str(self.job_id)
        try:
            return await self.live.events.after(name, job_id, after, HISTORY_PAGE)
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
    hold: Hold | None = None,
    allowed: Allowed | None = None,
    status_code: int = 200,
    headers: dict[str, str] | None = None,
) -> EventStream:
    """The stream in a place of its own: ``hold``, or one taken now (429 or
    503 when there is none) that goes on while ``allowed``."""
    place = hold if hold is not None else await live.admit(stream.tenant, allowed)
    return EventStream(stream.events(after), place, status_code=status_code, headers=headers)


def wants_stream(request: Request) -> bool:
    """Whether the client asked for the job's stream (``Accept``)."""
    return EVENT_STREAM in request.headers.get("accept", "")


def resume_after(*given: str | None) -> str | None:
    """The event a client resumes after: the first id it gave
    (``Last-Event-ID``, then ``?after=``), or None. One that is no event id
    is refused here (400), before it reaches the process's shared reader."""
    for text in given:
        if text:
            found = event_id(text)
            if found is None:
                raise HTTPException(
                    400, "Last-Event-ID (or ?after=) must be the id of an event the stream sent"
                )
            return found
    return None


async def stream_accepted(
    live: Live,
    workflow: Workflow[Any, Any],
    jobs: Jobs,
    tenant: str,
    request: Request,
    accept: Callable[[], Awaitable[Response]],
    allowed: Allowed | None = None,
) -> Response:
    """The intake's answer, ``accept()``, as the job's stream when the client
    asked for one. The resume id and the stream's place are checked before
    ``accept`` runs: a refused stream (400, 429, 503) accepted no job."""
    if not wants_stream(request):
        return await accept()
    after = resume_after(request.headers.get("last-event-id"))
    hold = await live.admit(tenant, allowed)
    try:
        response = await accept()
        job_id = _accepted_job(response)
    except BaseException:
        await hold.release()
        raise
    if job_id is None:
        await hold.release()
        return response
    kept = {
        k: v
        for k, v in response.headers.items()
        if k.lower() in ("location", "idempotent-replayed")
    }
    stream = JobStream(live, workflow, jobs, tenant, job_id)
    return await open_stream(live, stream, after, hold=hold, headers=kept)


def _accepted_job(response: Response) -> uuid.UUID | None:
    """The job the intake accepted (or replays as accepted), else None."""
    if response.status_code != 202:
        return None
    try:
        return uuid.UUID(json.loads(getattr(response, "body", b""))["job_id"])
    except (ValueError, KeyError, TypeError):
        return None


def add_stream_routes(
    router: APIRouter,
    workflow: Workflow[Any, Any],
    jobs: Callable[[], Jobs],
    live: Callable[[], Live],
    tenant: Callable[..., Awaitable[str]],
    keys: ApiKeyAuth | None,
) -> None:
    """The job's stream, and with oncely's own API keys (``keys``) its token:
    the stream also opens with a token, while the key it was given for is
    active. With an app's own ``auth`` the stream opens with that alone, and
    no token is offered (one would open nothing: the app's auth, cookies
    say, is what a browser's ``EventSource`` sends)."""
    if keys is not None:
        _add_token_route(router, workflow, jobs, live, tenant, keys)
    opened = partial(_opened, workflow, jobs, live)
    endpoint = (
        _with_keys(workflow, live, keys, opened)
        if keys is not None
        else _with_own_auth(tenant, opened)
    )
    router.add_api_route(
        f"{workflow.route}/{{job_id}}/stream",
        endpoint,
        methods=["GET"],
        response_class=StreamingResponse,
        **route_docs.stream(workflow, EVENT_STREAM).fields(),
    )


async def _opened(
    workflow: Workflow[Any, Any],
    jobs: Callable[[], Jobs],
    live: Callable[[], Live],
    tenant_name: str,
    job_id: uuid.UUID,
    after: str | None,
    allowed: Allowed | None = None,
) -> Response:
    """The tenant's job's stream, from after ``after``; 404 for no such job."""
    if await jobs().get(workflow.name, job_id, tenant_name) is None:
        raise HTTPException(404, "job not found")
    stream = JobStream(live(), workflow, jobs(), tenant_name, job_id)
    return await open_stream(live(), stream, after, allowed=allowed)


_Open = Callable[[str, uuid.UUID, str | None, Allowed | None], Awaitable[Response]]


def _with_keys(
    workflow: Workflow[Any, Any], live: Callable[[], Live], keys: ApiKeyAuth, opened: _Open
) -> Callable[..., Awaitable[Response]]:
    """The stream's endpoint with oncely's API keys: opened with a key, or
    with a token (``?token=``) given for this job."""

    async def with_keys(
        request: Request,
        job_id: str,
        token: str | None = None,
        after: str | None = None,
        last_event_id: Annotated[str | None, Header()] = None,
    ) -> Response:
        parsed = job_uuid(job_id)
        if token is None:
            tenant_name, key_id = await keys.tenant_of(request), key_id_of(request)
        else:
            tenant_name, key_id = await _token_tenant(live(), keys, token, workflow.name, parsed)
        allowed = key_still_active(keys, key_id, tenant_name)
        return await opened(tenant_name, parsed, resume_after(last_event_id, after), allowed)

    return with_keys


def _with_own_auth(
    tenant: Callable[..., Awaitable[str]], opened: _Open
) -> Callable[..., Awaitable[Response]]:
    """The stream's endpoint with an app's own ``auth``: opened with that alone."""
    Tenant = Annotated[str, Depends(tenant)]

    async def with_own_auth(
        job_id: str,
        tenant_name: Tenant,
        after: str | None = None,
        last_event_id: Annotated[str | None, Header()] = None,
    ) -> Response:
        resume = resume_after(last_event_id, after)
        return await opened(tenant_name, job_uuid(job_id), resume, None)

    return with_own_auth


async def _token_tenant(
    live: Live, keys: ApiKeyAuth, token: str, workflow: str, job_id: uuid.UUID
) -> tuple[str, str]:
    """The tenant a stream token opens ``job_id``'s stream for, and its API
    key's id: a genuine, unexpired token for that job, whose key is still
    active (401 else)."""
    claims = await live.tokens.claims(token)
    if claims is None or (claims.job_id, claims.workflow) != (str(job_id), workflow):
        raise Unauthorized("the stream token is unknown, expired or for another job")
    # The token dies with its key, as fast as the key does (api/auth.py).
    if claims.key_id is None or await keys.tenant_of_id(claims.key_id) != claims.tenant:
        raise Unauthorized("the stream token's API key was revoked")
    return claims.tenant, claims.key_id


def key_still_active(keys: ApiKeyAuth | None, key_id: str | None, tenant: str) -> Allowed | None:
    """Whether the API key a stream was opened with (or its token given
    for) is still ``tenant``'s, asked every heartbeat: a revoked key's
    streams end within a heartbeat and the revocation bound. PostgreSQL
    away: yes (a stream is never ended on its account). None without a key
    (an app's own auth)."""
    if keys is None or key_id is None:
        return None

    async def active() -> bool:
        try:
            return await keys.tenant_of_id(key_id) == tenant
        except (psycopg.OperationalError, psycopg_pool.PoolTimeout):
            return True

    return active


def _add_token_route(
    router: APIRouter,
    workflow: Workflow[Any, Any],
    jobs: Callable[[], Jobs],
    live: Callable[[], Live],
    tenant: Callable[..., Awaitable[str]],
    keys: ApiKeyAuth | None,
) -> None:
    Tenant = Annotated[str, Depends(tenant)]

    async def token_route(request: Request, job_id: str, tenant_name: Tenant) -> Any:
        parsed = job_uuid(job_id)
        if await jobs().get(workflow.name, parsed, tenant_name) is None:
            raise HTTPException(404, "job not found")
        key_id = key_id_of(request) if keys is not None else None
        token, expires_at = await live().tokens.issue(
            workflow.name, str(parsed), tenant_name, key_id
        )
        return JSONResponse({"token": token, "expires_at": expires_at})

    router.add_api_route(
        f"{workflow.route}/{{job_id}}/stream-token",
        token_route,
        methods=["POST"],
        response_model=StreamToken,
        **route_docs.stream_token(workflow).fields(),
    )
