"""The HTTP API of an app: its workflows' routes, problem handlers, body
limit, health and metrics.

``OncelyAPI`` holds an app's routes and the clients they use. Serve it alone
(``create_app``), or mount its routes into your own FastAPI service
(``OncelyAPI.mount``) with your own auth dependency; see
docs/embedding.md.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from oncely import __version__, clock, redis_client
from oncely.api.auth import ApiKeyAuth, TenantDependency, key_id_of
from oncely.api.clients import Clients
from oncely.api.edge import Edge
from oncely.api.idempotency import (
    RETENTION_POLICY,
    idempotency_dependency,
    idempotent_request_for,
)
from oncely.api.keys import MAX_KEY_LEN, MIN_KEY_LEN
from oncely.api.problems import (
    PROBLEM_BASE,
    PROBLEM_MEDIA_TYPE,
    install_problem_handlers,
    problem_schema,
)
from oncely.api.ratelimit import TenantLimiter
from oncely.api.store import IdempotencyStore
from oncely.api.streaming import (
    Live,
    StreamConfig,
    add_stream_routes,
    key_still_active,
    stream_accepted,
    wants_stream,
)
from oncely.api.workflows import Answer, DirectIntake, add_workflow_routes
from oncely.app import App
from oncely.jobs.checkpoints import Checkpoints
from oncely.jobs.store import Jobs
from oncely.live.events import JobEvents, LiveConfig
from oncely.queue.stream import Stream
from oncely.usage.budgets import BudgetLimits, Budgets, publish_limits
from oncely.workflow import Workflow

DESCRIPTION = f"""
Exactly-once effects for LLM steps. Every POST needs an `Idempotency-Key`.

**Retention.** {RETENTION_POLICY}

Errors are RFC 9457 `application/problem+json` with a stable `type` under
`{PROBLEM_BASE}`.
"""


@dataclass(frozen=True)
class ApiConfig:
    """The intake's knobs (docs/settings.md)."""

    # How long a running request holds its key without renewal: the time a
    # crashed API process blocks a retry.
    lock_ttl_s: float = 30.0
    # How long a finished request's response is replayed.
    result_ttl_s: int = 86400
    # Bodies above this are answered 413 before they are read in full.
    max_body_bytes: int = 1_048_576
    # A running request renews its key at most this long; then its handler
    # is cancelled, the key released and the request answered 503.
    max_hold_s: float = 120.0
    # The client-side bound on every SQL statement, the wait for a pooled
    # connection included: a frozen server never enforces its own
    # statement_timeout. Redis commands are bounded by the client's socket
    # timeout (``bootstrap.make_redis``).
    statement_timeout_s: float = 10.0
    # Requests per minute each tenant may send, fleet-wide (0: no limit).
    tenant_rpm: int = 0
    # Each tenant's daily model budget (oncely.usage.budgets; 0: none).
    tenant_daily_tokens: int = 0
    tenant_daily_usd: float = 0.0
    budget_reserve_tokens: int = 1000
    budget_hold_s: float = 3600.0
    # How long an API key, once looked up, is kept without asking PostgreSQL
    # again (0: no cache). A revocation reaches every process within about a
    # second anyway (api/auth.py), or within this when Redis was away.
    api_key_cache_s: float = 10.0
    # Unknown keys one client address may present per minute (per process)
    # before its unknown keys are refused 429 without a lookup (0: no limit).
    unknown_keys_per_minute: int = 60
    # More request header fields than this, or more bytes in them: 431.
    # ``oncely api`` also caps the head's size as it arrives (api/server.py).
    max_headers: int = 100
    max_header_bytes: int = 16_384
    # A request body must arrive in full within this, counted from the first
    # read (a body shorter than its Content-Length would hold the handler).
    body_timeout_s: float = 30.0
    # Live job streams (docs/streaming.md): open streams per tenant, a
    # job's events kept (about) and for how long after its last one.
    streams_per_tenant: int = 100
    stream_maxlen: int = 10_000
    stream_ttl_s: float = 3600.0
    # A comment line this often keeps proxies from closing an idle stream;
    # the job's row is read again at each.
    stream_heartbeat_s: float = 15.0
    # Open streams one API process serves at once (then 503).
    streams_per_process: int = 1000
    # Browser origins allowed to call from another origin (CORS); none: the
    # same-origin rule stands.
    cors_origins: tuple[str, ...] = ()


class OncelyAPI:
    """An app's routes and the clients they use.

    ``clients`` is either open clients (the caller owns them) or a function
    returning an async context manager that opens them; ``lifespan`` then
    opens them at start-up and closes them at shutdown. ``auth`` is a FastAPI
    dependency that answers the tenant (default: API keys).
    """

    def __init__(
        self,
        app: App,
        config: ApiConfig,
        clients: Clients | Callable[[], AbstractAsyncContextManager[Clients]],
        *,
        auth: TenantDependency | None = None,
    ) -> None:
        self.app = app
        self.config = config
        self._clients: Clients | None = None
        self._open: Callable[[], AbstractAsyncContextManager[Clients]] | None = None
        if callable(clients):
            self._open = clients
        else:
            self._bind(clients)
        # With oncely's own API keys, the intake resolves its requests itself
        # (workflows.DirectIntake); with an app's own auth, FastAPI does.
        self._direct: DirectIntake | None = None
        self._keys: ApiKeyAuth | None = None
        if auth is None:
            keys = ApiKeyAuth(
                lambda: self.clients.pool,
                timeout_s=config.statement_timeout_s,
                cache_s=config.api_key_cache_s,
                redis=lambda: self.clients.redis,
                unknown_per_minute=config.unknown_keys_per_minute,
            )
            auth = keys.dependency
            self._keys = keys
            self._direct = DirectIntake(
                keys.tenant_of, idempotent_request_for(lambda: self._idempotency, config.max_hold_s)
            )
        self.tenant = auth
        self.idempotent = idempotency_dependency(
            lambda: self._idempotency, self.tenant, config.max_hold_s
        )
        self._intake = idempotency_dependency(
            lambda: self._idempotency, self.tenant, config.max_hold_s, document_headers=False
        )
        self.router = APIRouter()
        self.add_routes(self.router)

    def add_routes(self, router: APIRouter) -> None:
        """The workflows' routes, added to ``router``. The standalone app adds
        them to its own router: FastAPI walks an included router on every
        request (bench/README.md, Intake)."""
        for workflow in self.app:
            add_workflow_routes(
                router,
                workflow,
                jobs=lambda: self._jobs,
                tenant=self.tenant,
                idempotent=self._intake,
                limiter=lambda: self._limiter,
                budgets=lambda: self._budgets,
                direct=self._direct,
                checkpoints=lambda: self._checkpoints,
                event_idempotent=self.idempotent,
                answer=self._answer(workflow),
            )
            add_stream_routes(
                router, workflow, lambda: self._jobs, lambda: self.live, self.tenant, self._keys
            )

    def _answer(self, workflow: Workflow[Any, Any]) -> Answer:
        """The intake's answer: the accepted job's stream when asked for."""

        async def answer(
            request: Request, tenant: str, accept: Callable[[], Awaitable[Response]]
        ) -> Response:
            if not wants_stream(request):
                return await accept()
            key_id = key_id_of(request) if self._keys is not None else None
            allowed = key_still_active(self._keys, key_id, tenant)
            return await stream_accepted(
                self.live, workflow, self._jobs, tenant, request, accept, allowed
            )

        return answer

    @property
    def clients(self) -> Clients:
        if self._clients is None:
            raise RuntimeError("oncely's routes ran before its lifespan opened their clients")
        return self._clients

    @property
    def jobs(self) -> Jobs:
        """The job store the routes use (bound when the clients open)."""
        _ = self.clients  # a readable error before the lifespan opened them
        return self._jobs

    def _bind(self, clients: Clients) -> None:
        self._clients = clients
        streams = {w.name: Stream(clients.redis, w.keys) for w in self.app}
        self._jobs = Jobs(
            clients.pool, streams, statement_timeout_s=self.config.statement_timeout_s
        )
        self._checkpoints = Checkpoints(self._jobs)
        events = JobEvents(
            clients.redis, LiveConfig(self.config.stream_maxlen, self.config.stream_ttl_s)
        )
        # What follows a status change a request makes (oncely.jobs.transitions).
        self._jobs.transitions.subscribe(events.status_changed)
        self._jobs.transitions.when_ended(self._checkpoints.children.on_end)
        config = StreamConfig(
            self.config.streams_per_tenant,
            self.config.stream_heartbeat_s,
            self.config.streams_per_process,
        )
        self.live = Live(clients.redis, events, config)
        self._idempotency = IdempotencyStore(
            clients.redis,
            lock_ttl_s=self.config.lock_ttl_s,
            result_ttl_s=self.config.result_ttl_s,
        )
        rpm = self.config.tenant_rpm
        self._limiter = TenantLimiter(clients.redis, rpm) if rpm else None
        c = self.config
        limits = BudgetLimits(
            c.tenant_daily_tokens, c.tenant_daily_usd, c.budget_reserve_tokens, c.budget_hold_s
        )
        self._budgets = Budgets(clients.redis, limits) if limits.enabled else None

    @asynccontextmanager
    async def lifespan(self, _: Any = None) -> AsyncIterator[None]:
        """Open the clients (unless they were given open) for the app's life."""
        if self._open is None:
            yield
            return
        async with self._open() as clients:
            self._bind(clients)
            await self.publish_limits()
            try:
                yield
            finally:
                await self.aclose()
                self._clients = None

    async def publish_limits(self) -> None:
        """Say in Redis which tenant budgets this API enforces, for the
        operator commands (``oncely.usage.budgets.publish_limits``)."""
        await publish_limits(self.clients.redis, self._budgets)

    async def aclose(self) -> None:
        """At shutdown: give withdrawals of unanswered intakes one statement
        bound to finish, and stop releasing keys in the background."""
        if self._clients is None:
            return
        await self._jobs.finish_withdrawals(self.config.statement_timeout_s)
        await self._idempotency.aclose()
        self.live.stop()
        await self.live.aclose()

    def mount(self, host: FastAPI, prefix: str = "") -> None:
        """Add the workflows' routes to ``host`` with oncely's problem handlers
        for its own errors (the host keeps its handlers for everything else).
        The host's lifespan must enter ``self.lifespan``."""
        host.include_router(self.router, prefix=prefix)
        install_problem_handlers(host, generic=False)


def create_app(api: OncelyAPI, *, public_metrics: bool = True) -> FastAPI:
    """A standalone FastAPI app serving ``api``: its routes, health, metrics
    (unless ``public_metrics`` is off: they are served on the metrics port
    instead), problem+json for every error and the body limit."""
    # No trailing-slash redirects: their Location would be built from the
    # client's Host header (docs/decisions.md).
    # FastAPI's own OpenTelemetry off: oncely makes the POST's server span
    # itself (oncely.tracing) and its metrics are Prometheus', and the check
    # for a configured provider would run on every request.
    app = FastAPI(
        title="oncely",
        version=__version__,
        description=DESCRIPTION,
        lifespan=api.lifespan,
        redirect_slashes=False,
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.state.oncely = api
    install_problem_handlers(app)
    api.add_routes(app.router)
    _add_operations(app, api, public_metrics=public_metrics)
    _add_problem_schema(app)
    # HEAD as GET, the body and header bounds, the request count and the 500
    # for anything unhandled: one layer (api/edge.py).
    app.add_middleware(
        Edge,
        max_body_bytes=api.config.max_body_bytes,
        max_headers=api.config.max_headers,
        max_header_bytes=api.config.max_header_bytes,
        body_timeout_s=api.config.body_timeout_s,
    )
    if api.config.cors_origins:
        # Outside the edge: a preflight is answered before any bound applies,
        # and every answer (a 4xx included) carries the headers a browser
        # needs to read it.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(api.config.cors_origins),
            allow_methods=["GET", "HEAD", "POST"],
            allow_headers=["Authorization", "Content-Type", "Idempotency-Key", "Last-Event-ID"],
            expose_headers=["Idempotent-Replayed", "Location", "Retry-After"],
            allow_credentials=True,
            max_age=600,
        )
    return app


READINESS: dict[str, Any] = {
    "description": "Each store's answer.",
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "properties": {
                    "ready": {"type": "boolean"},
                    "redis": {"type": "boolean"},
                    "postgres": {"type": "boolean"},
                    "clock_offset_s": {
                        "type": "number",
                        "description": "Only when this process's clock is more than a "
                        "minute off PostgreSQL's: by how much (positive: ahead).",
                    },
                    "warnings": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["ready", "redis", "postgres"],
            }
        }
    },
}


def _add_operations(app: FastAPI, api: OncelyAPI, *, public_metrics: bool) -> None:
    @app.get("/healthz", tags=["operations"], summary="The process is alive")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get(
        "/readyz",
        tags=["operations"],
        summary="Redis and PostgreSQL answer",
        responses={200: READINESS, 503: {**READINESS, "description": "Not ready."}},
    )
    async def readyz() -> JSONResponse:
        # Side by side: answered within the larger of the two bounds.
        redis_ok, reading = await asyncio.gather(_redis_ok(api), _postgres_clock(api))
        checks = {"redis": redis_ok, "postgres": reading is not None}
        ready = all(checks.values())
        # A skewed clock is said, not refused (docs/production.md, Clocks).
        extra = reading.readiness() if reading is not None else {}
        return JSONResponse({"ready": ready, **checks, **extra}, status_code=200 if ready else 503)

    if not public_metrics:
        return

    @app.get(
        "/metrics",
        tags=["operations"],
        summary="Prometheus metrics",
        response_class=Response,
        responses={
            200: {
                "description": "The Prometheus text format.",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            }
        },
    )
    async def metrics_endpoint() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


async def _redis_ok(api: OncelyAPI) -> bool:
    try:
        return await redis_client.ping(api.clients.redis)
    except Exception:
        return False


async def _postgres_clock(api: OncelyAPI) -> clock.ClockOffset | None:
    """PostgreSQL's clock against ours; None when it does not answer."""
    try:
        return await clock.measure(api.clients.pool, timeout_s=api.config.statement_timeout_s)
    except Exception:
        return None


def _add_problem_schema(app: FastAPI) -> None:
    original = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = original()
        schema.setdefault("components", {}).setdefault("schemas", {})["Problem"] = PROBLEM_SCHEMA
        for operation in _operations(schema):
            _complete_operation(operation)
        for unused in ("HTTPValidationError", "ValidationError"):
            schema["components"]["schemas"].pop(unused, None)
        schema["info"]["x-idempotency-retention"] = RETENTION_POLICY
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


PROBLEM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "RFC 9457 problem details.",
    "properties": {
        "type": {"type": "string", "format": "uri"},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string"},
        "errors": {
            "type": "array",
            "description": "With `validation`: what failed, where.",
            "items": {
                "type": "object",
                "properties": {
                    "loc": {"type": "array", "items": {"type": ["string", "integer"]}},
                    "msg": {"type": "string"},
                    "type": {"type": "string"},
                },
                "required": ["loc", "msg", "type"],
            },
        },
        "error_count": {
            "type": "integer",
            "description": "With `validation`: how many errors there were (at most 20 listed).",
        },
    },
    "required": ["type", "title", "status"],
}

# The header as the service checks it (``oncely.api.keys.parse_key``): the
# bare form, 16–255 printable ASCII characters, no comma, no leading quote
# and no surrounding spaces. The quoted form is in the description.
IDEMPOTENCY_KEY_SCHEMA: dict[str, Any] = {
    "type": "string",
    "minLength": MIN_KEY_LEN,
    "maxLength": MAX_KEY_LEN,
    "pattern": f"^[!#-+\\--~][ -+\\--~]{{{MIN_KEY_LEN - 2},{MAX_KEY_LEN - 2}}}[!-+\\--~]$",
}


def _operations(schema: dict[str, Any]) -> list[dict[str, Any]]:
    return [op for path in schema.get("paths", {}).values() for op in path.values()]


def _can_fail(parameter: dict[str, Any]) -> bool:
    """Whether a value of the parameter can fail validation: anything but an
    optional string without constraints."""
    schema = parameter.get("schema", {})
    options = schema.get("anyOf", [schema])
    plain = all(
        set(o) <= {"type", "title"} and o.get("type") in ("string", "null") for o in options
    )
    return parameter.get("required", False) or not plain


def _complete_operation(operation: dict[str, Any]) -> None:
    """What FastAPI cannot tell from the code: the key is required (a
    missing one is oncely's 400, not FastAPI's 422), every error is a
    problem, 401 and 500 wherever a key is needed (the routes that reach
    the stores)."""
    for parameter in operation.get("parameters", []):
        if parameter["in"] == "header" and parameter["name"].lower() == "idempotency-key":
            parameter["required"] = True
            parameter["schema"] = {**IDEMPOTENCY_KEY_SCHEMA, "title": "Idempotency-Key"}
    responses = operation.setdefault("responses", {})
    validated = "requestBody" in operation or any(
        p["in"] == "query" and _can_fail(p) for p in operation.get("parameters", [])
    )
    if "422" in responses and not validated:
        del responses["422"]  # a path parameter alone cannot fail validation
    elif PROBLEM_MEDIA_TYPE not in responses.get("422", {}).get("content", {PROBLEM_MEDIA_TYPE: 0}):
        responses["422"] = problem_schema("The request failed validation.")
    if operation.get("security"):
        responses.setdefault("401", problem_schema("Missing, unknown or revoked API key."))
        responses.setdefault(
            "500", problem_schema("An unexpected failure; retrying (with the same key) is safe.")
        )
