"""The ASGI app: routes, problem handlers, body limit, health and metrics."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from psycopg_pool import AsyncConnectionPool
from redis.asyncio import Redis
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from oncely import __version__, metrics
from oncely.api import summaries
from oncely.api.idempotency import RETENTION_POLICY
from oncely.api.problems import PROBLEM_BASE, install_problem_handlers, problem
from oncely.api.store import IdempotencyStore
from oncely.queue.stream import Stream
from oncely.settings import Settings

DESCRIPTION = f"""
Exactly-once effects for LLM steps. Every POST needs an `Idempotency-Key`.

**Retention.** {RETENTION_POLICY}

Errors are RFC 9457 `application/problem+json` with a stable `type` under
`{PROBLEM_BASE}`.
"""


def create_app(settings: Settings, *, redis: Redis, pool: AsyncConnectionPool) -> FastAPI:
    """Build the app around live clients; the caller owns their lifecycle."""
    app = FastAPI(title="oncely", version=__version__, description=DESCRIPTION)
    app.state.settings = settings
    app.state.redis = redis
    app.state.pool = pool
    app.state.stream = Stream(redis)
    app.state.idempotency = IdempotencyStore(
        redis,
        lock_ttl_s=settings.idempotency_lock_ttl_s,
        result_ttl_s=settings.idempotency_result_ttl_s,
    )
    install_problem_handlers(app)
    app.include_router(summaries.router)
    _add_operations(app)
    _add_problem_schema(app)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(CountRequests)
    return app


def _add_operations(app: FastAPI) -> None:
    @app.get("/healthz", tags=["operations"], summary="The process is alive")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["operations"], summary="Redis and PostgreSQL answer")
    async def readyz(request: Request) -> JSONResponse:
        checks = {"redis": await _redis_ok(request), "postgres": await _postgres_ok(request)}
        ready = all(checks.values())
        return JSONResponse({"ready": ready, **checks}, status_code=200 if ready else 503)

    @app.get("/metrics", tags=["operations"], summary="Prometheus metrics")
    async def metrics_endpoint() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


async def _redis_ok(request: Request) -> bool:
    try:
        return bool(await request.app.state.redis.ping())
    except Exception:
        return False


async def _postgres_ok(request: Request) -> bool:
    try:
        async with request.app.state.pool.connection(timeout=2) as conn:
            await conn.execute("SELECT 1")
        return True
    except Exception:
        return False


def _add_problem_schema(app: FastAPI) -> None:
    original = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = original()
        schema.setdefault("components", {}).setdefault("schemas", {})["Problem"] = {
            "type": "object",
            "description": "RFC 9457 problem details.",
            "properties": {
                "type": {"type": "string", "format": "uri"},
                "title": {"type": "string"},
                "status": {"type": "integer"},
                "detail": {"type": "string"},
            },
            "required": ["type", "title", "status"],
        }
        schema["info"]["x-idempotency-retention"] = RETENTION_POLICY
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


class CountRequests:
    """``oncely_requests_total`` by route template and status class."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", "unmatched")
            metrics.REQUESTS.labels(route=path, outcome=f"{status // 100}xx").inc()


class BodyLimit:
    """413 for bodies over the limit, by Content-Length or by counting the stream."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                # Surfaces through the app's HTTPException handler as a 413 problem.
                raise HTTPException(413, f"the limit is {self.max_bytes} bytes")
            return message

        await self.app(scope, counting_receive, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = problem(
            413, "payload-too-large", "Payload too large", f"the limit is {self.max_bytes} bytes"
        )
        await response(scope, receive, send)
