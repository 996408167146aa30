"""The composition root: settings in, configs, clients and services out.

The only module (with the CLI) that reads ``Settings``: every library
component takes a config dataclass, mapped here in one place.
"""

from __future__ import annotations

import asyncio
import gc
import math
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import structlog
import uvicorn
from psycopg import conninfo
from psycopg_pool import AsyncConnectionPool
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException

from oncely import names
from oncely.app import App, load_app
from oncely.health import HealthConfig, HealthServer
from oncely.jobs.checkpoints import Checkpoints
from oncely.jobs.handler import StepConfig, WorkflowHandler
from oncely.jobs.reconcile import Reconciler
from oncely.jobs.retention import Retention
from oncely.jobs.store import Jobs
from oncely.jobs.timers import Timers
from oncely.llm.base import LLM
from oncely.llm.limiter import FleetLimiter, LimitedLLM, Limits
from oncely.llm.model import ModelRoute
from oncely.llm.openai_compat import OpenAICompatible
from oncely.llm.routing import Cooldown, CooldownPolicy, ModelSpec, Target, parse_models
from oncely.outbox.relay import Relay, RelayConfig
from oncely.outbox.store import OutboxStore
from oncely.outbox.wakeup import OutboxWakeUp
from oncely.queue.stream import Stream
from oncely.queue.worker import Worker, WorkerConfig
from oncely.redis_client import ClusterClient, HiredisPacked, RedisClient, SharedConnectionRedis
from oncely.retry import RetryPolicy
from oncely.senders import EffectRouter, SendersConfig, build_router
from oncely.services import Progress, Service
from oncely.settings import Settings
from oncely.shadow.config import ShadowSpec, check_workflows, parse_primary, parse_shadow
from oncely.shadow.dispatch import ShadowDispatch
from oncely.shadow.evaluate import ModelJudge
from oncely.shadow.run import ShadowHandler
from oncely.shadow.store import ShadowResults
from oncely.sql.migrate import SchemaMismatch, schema_state
from oncely.usage.budgets import BudgetLimits, Budgets
from oncely.usage.ledger import Ledger
from oncely.usage.prices import Prices
from oncely.workflow import Variant, Workflow

if TYPE_CHECKING:
    from fastapi import FastAPI

    from oncely.api.app import ApiConfig, OncelyAPI
    from oncely.api.auth import TenantDependency

log = structlog.get_logger("oncely.process")


# -- settings → component configs -------------------------------------------------


def api_config(s: Settings) -> ApiConfig:
    from oncely.api.app import ApiConfig

    return ApiConfig(
        lock_ttl_s=s.idempotency_lock_ttl_s,
        result_ttl_s=s.idempotency_result_ttl_s,
        max_body_bytes=s.max_body_bytes,
        max_hold_s=s.idempotency_max_hold_s,
        statement_timeout_s=client_bounds(s).statement_timeout_s,
        tenant_rpm=s.tenant_rpm,
        api_key_cache_s=s.api_key_cache_s,
        unknown_keys_per_minute=s.api_key_unknown_per_min,
        tenant_daily_tokens=s.tenant_daily_tokens,
        tenant_daily_usd=s.tenant_daily_usd,
        max_headers=s.http_max_headers,
        max_header_bytes=s.http_max_header_bytes,
        body_timeout_s=s.http_body_timeout_s,
        console_key=s.console_key.get_secret_value() if s.console_key else None,
    )


def worker_config(s: Settings) -> WorkerConfig:
    return WorkerConfig(
        concurrency=s.worker_concurrency,
        claim_idle_ms=s.claim_idle_ms,
        max_deliveries=s.max_deliveries,
        block_ms=s.block_ms,
        shutdown_grace_s=s.shutdown_grace_s,
        trim_every_s=s.stream_trim_every_s,
        handler_timeout_s=s.job_budget_s + s.job_grace_s,
        redelivery_base_s=s.redelivery_base_s,
        redelivery_max_s=s.redelivery_max_s,
        job_max_age_s=s.job_max_age_s,
    )


def retry_policy(s: Settings) -> RetryPolicy:
    return RetryPolicy(
        per_call_timeout_s=s.llm_timeout_s,
        max_attempts=s.llm_max_attempts,
        backoff_base_s=s.llm_backoff_base_s,
        backoff_max_s=s.llm_backoff_max_s,
        retry_after_max_s=s.llm_retry_after_max_s,
    )


def step_config(s: Settings) -> StepConfig:
    return StepConfig(
        policy=retry_policy(s),
        budget_s=s.job_budget_s,
        invalid_output_retries=s.llm_invalid_output_retries,
        model_name=s.llm_model,
        wait_max_s=s.wait_max_s,
    )


def limits(s: Settings) -> Limits:
    return Limits(rpm=s.llm_rpm, tpm=s.llm_tpm, pause_max_s=s.llm_retry_after_max_s)


def cooldown_policy(s: Settings) -> CooldownPolicy:
    return CooldownPolicy(
        failures=s.llm_cooldown_failures,
        window_s=s.llm_cooldown_window_s,
        cooldown_s=s.llm_cooldown_s,
        # A probe is one call: out for at most one attempt's time.
        probe_s=s.llm_timeout_s + 5,
    )


def budgets(s: Settings, redis: RedisClient) -> Budgets:
    limits = BudgetLimits(daily_tokens=s.tenant_daily_tokens, daily_usd=s.tenant_daily_usd)
    return Budgets(redis, limits)


def ledger_for(res: Resources) -> Ledger:
    """The worker's ledger. It counts tenants' spend for budgets even while
    none is set: one turned on mid-day then counts the day's spend so far."""
    s = res.settings
    return Ledger(
        res.pool,
        prices=Prices.parse(s.llm_prices),
        budgets=budgets(s, res.redis),
        flush_s=s.ledger_flush_s,
        retention_s=s.ledger_retention_s,
        statement_timeout_s=s.pg_statement_timeout_s,
    )


def relay_config(s: Settings) -> RelayConfig:
    return RelayConfig(
        max_attempts=s.relay_max_attempts,
        lease_s=s.relay_lease_s,
        batch=s.relay_batch,
        concurrency=s.relay_concurrency,
        poll_s=s.relay_poll_s,
        retention_s=s.outbox_retention_s,
    )


def senders_config(s: Settings) -> SendersConfig:
    return SendersConfig(
        email=s.sender,
        email_url=s.sender_url,
        timeout_s=s.sender_timeout_s,
        webhook_secret=s.webhook_secret.get_secret_value(),
        smtp_from=s.smtp_from,
        webhook_urls=dict(s.workflow_webhook_urls),
        default_webhook_url=s.webhook_url,
    )


def connect_llm(s: Settings) -> OpenAICompatible:
    return OpenAICompatible.connect(s.llm_base_url, s.llm_api_key.get_secret_value(), s.llm_model)


@dataclass(frozen=True)
class ShadowPlan:
    """ONCELY_SHADOW and ONCELY_PRIMARY: shadow variants, and each workflow's primary."""

    shadows: list[ShadowSpec]
    primary: dict[str, str]

    def for_workflow(self, workflow: str) -> list[ShadowSpec]:
        return [spec for spec in self.shadows if spec.workflow == workflow]


def shadow_plan(s: Settings, app: App | None = None) -> ShadowPlan:
    """The settings' shadow plan; with ``app``, checked against its workflows
    (ValueError naming the unknown ones)."""
    plan = ShadowPlan(parse_shadow(s.shadow), parse_primary(s.primary))
    if app is not None:
        check_workflows(plan.shadows, plan.primary, app.names, s.app)
    return plan


def shadow_streams(app: App, res: Resources) -> dict[str, Stream]:
    """The stream of every configured shadow variant of ``app``'s workflows,
    by ``<workflow>:shadow:<variant>`` (the name its worker logs under)."""
    plan = shadow_plan(res.settings)
    return {
        f"{spec.workflow}:shadow:{spec.variant}": Stream(
            res.redis, names.shadow_keys(spec.workflow, spec.variant)
        )
        for spec in plan.shadows
        if spec.workflow in app.names
    }


def app_from(s: Settings, only: list[str] | None = None) -> App:
    """The settings' app, narrowed to the workflows named in ``only``."""
    return load_app(s.app).only(only or [])


# -- clients ----------------------------------------------------------------------


@dataclass(frozen=True)
class Resources:
    settings: Settings
    redis: RedisClient
    pool: AsyncConnectionPool


def require_urls(settings: Settings) -> tuple[str, str]:
    if not settings.redis_url or not settings.database_url:
        raise SystemExit(
            "set ONCELY_REDIS_URL and ONCELY_DATABASE_URL (or run `oncely dev`, "
            "which starts embedded servers)"
        )
    return settings.redis_url, settings.database_url


@dataclass(frozen=True)
class ClientBounds:
    """How long a process waits on its servers (docs/failure-model.md)."""

    # Every Redis command (the socket timeout): a frozen Redis is an error
    # after this long, never a hang.
    redis_timeout_s: float
    # Connecting to Redis or PostgreSQL; also the longest wait for a free
    # pooled PostgreSQL connection.
    connect_timeout_s: float
    # Every SQL statement: on the server (statement_timeout) and on the
    # client (a frozen server enforces nothing).
    statement_timeout_s: float


def client_bounds(s: Settings) -> ClientBounds:
    if s.block_ms / 1000 >= s.redis_timeout_s:
        # A blocking XREADGROUP must answer before the socket gives up on it.
        raise SystemExit(
            f"ONCELY_BLOCK_MS ({s.block_ms}) must be below ONCELY_REDIS_TIMEOUT_S "
            f"({s.redis_timeout_s:g} s)"
        )
    return ClientBounds(s.redis_timeout_s, s.connect_timeout_s, s.pg_statement_timeout_s)


def make_redis(
    url: str,
    *,
    cluster: bool = False,
    timeout_s: float = 5.0,
    connect_timeout_s: float = 5.0,
    shared: bool = True,
) -> RedisClient:
    """A Redis client whose every command answers within ``timeout_s`` (else
    ``redis.exceptions.TimeoutError``). A command that met a broken
    connection (a server restarted under a pooled one) is retried once at
    once on a new connection; a timeout is not retried: that would double
    the bound. With ``cluster``, ``url`` names any node of a Redis Cluster
    and the client routes each key to the node owning its slot (docs/production.md,
    Redis Cluster); the same bounds apply to each node. Without ``shared``,
    a single server's client is redis-py's own, with no shared connection."""
    options: dict[str, Any] = {
        "decode_responses": True,
        "health_check_interval": 30,
        "socket_timeout": timeout_s,
        "socket_connect_timeout": connect_timeout_s,
    }
    if cluster:
        # Retried once on the cluster's refreshed layout (ClusterClient). The
        # servers' own cluster-require-full-coverage decides whether a partly
        # served cluster answers; the client refuses no more than they do.
        try:
            return ClusterClient.from_url(
                url, retry=Retry(NoBackoff(), 1), require_full_coverage=False, **options
            )
        except RedisClusterException as exc:  # e.g. a database other than 0
            raise SystemExit(f"ONCELY_REDIS_CLUSTER: {exc}") from None
    client_class = Redis
    if shared and url.startswith("redis://"):
        # Plain TCP: short commands share one connection, the pool's pack
        # with hiredis. rediss:// and unix:// keep redis-py's own
        # connections, as a cluster's nodes do.
        options["connection_class"] = HiredisPacked
        client_class = SharedConnectionRedis
    return client_class.from_url(
        url, retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)), **options
    )


def postgres_pool(database_url: str, s: Settings) -> AsyncConnectionPool:
    bounds = client_bounds(s)
    params = conninfo.conninfo_to_dict(database_url)
    statement_timeout = f"-c statement_timeout={int(bounds.statement_timeout_s * 1000)}"
    options = f"{params.get('options') or ''} {statement_timeout}".strip()
    return AsyncConnectionPool(
        database_url,
        min_size=s.pg_pool_min,
        max_size=s.pg_pool_max,
        open=False,
        # The longest wait for a free connection: a request fails fast when
        # the pool has none (server down or frozen) instead of queueing.
        timeout=bounds.connect_timeout_s,
        # Give up replacing a lost connection after a second; the pool grows
        # again on demand, so a returning server serves at once instead of
        # after a backoff of many seconds.
        reconnect_timeout=1.0,
        kwargs={
            # Each statement commits on its own unless code opens
            # ``conn.transaction()``: no BEGIN/COMMIT round trips for single
            # statements, which is every hot-path write.
            "autocommit": True,
            # libpq counts whole seconds, at least 2.
            "connect_timeout": max(2, math.ceil(bounds.connect_timeout_s)),
            "options": options,
        },
    )


@asynccontextmanager
async def open_resources(settings: Settings) -> AsyncIterator[Resources]:
    redis_url, database_url = require_urls(settings)
    bounds = client_bounds(settings)
    redis = make_redis(
        redis_url,
        cluster=settings.redis_cluster,
        timeout_s=bounds.redis_timeout_s,
        connect_timeout_s=bounds.connect_timeout_s,
        shared=settings.redis_shared_connection,
    )
    pool = postgres_pool(database_url, settings)
    await pool.open(wait=True, timeout=max(10, bounds.connect_timeout_s))
    try:
        yield Resources(settings, redis, pool)
    finally:
        await pool.close()
        await redis.aclose()


async def require_current_schema(res: Resources) -> None:
    """Long-running processes refuse a database that is behind or ahead of
    this code (one readable line; ``oncely migrate`` first when upgrading)."""
    async with res.pool.connection() as conn:
        problem = (await schema_state(conn)).problem()
    if problem:
        raise SchemaMismatch(problem)


def jobs_for(app: App, res: Resources) -> Jobs:
    streams = {w.name: Stream(res.redis, w.keys) for w in app}
    return Jobs(res.pool, streams, statement_timeout_s=res.settings.pg_statement_timeout_s)


@contextmanager
def stop_on_signals(*stops: Callable[[], object]) -> Iterator[None]:
    """SIGTERM and SIGINT call every ``stop``: services finish what they hold."""
    loop = asyncio.get_running_loop()

    def stop_all() -> None:
        log.info("process.stopping")
        for stop in stops:
            stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_all)
    try:
        yield
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


# -- the API ----------------------------------------------------------------------


def http_api(
    app: App,
    settings: Settings | None = None,
    *,
    auth: TenantDependency | None = None,
    resources: Resources | None = None,
) -> OncelyAPI:
    """An app's routes for your own FastAPI service (docs/embedding.md).

    Without ``resources`` the API opens its own Redis and PostgreSQL clients
    from ``settings`` (default: the environment) in its ``lifespan``."""
    from oncely.api.app import OncelyAPI

    s = settings or Settings()
    clients = resources if resources is not None else (lambda: open_resources(s))
    return OncelyAPI(app, api_config(s), clients, auth=auth)


def asgi_app() -> FastAPI:
    """ASGI factory: ``uvicorn --factory oncely.bootstrap:asgi_app`` (or
    gunicorn with uvicorn workers). Settings and ``ONCELY_APP`` from the
    environment; clients opened by the lifespan."""
    from oncely.api.app import create_app

    settings = Settings()
    return create_app(http_api(app_from(settings), settings))


class _QuietServer(uvicorn.Server):
    """uvicorn without its own signal handlers: ``stop_on_signals`` owns them,
    so one Ctrl-C stops the API and every other service in the process."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class ApiServer:
    def __init__(self, app: App, res: Resources, *, host: str, port: int) -> None:
        from oncely.api.app import create_app
        from oncely.api.server import bounded_protocol

        self._api = http_api(app, res.settings, resources=res)
        # With a metrics port, /metrics leaves the public port (health_server).
        public_metrics = res.settings.metrics_port is None
        s = res.settings
        # httptools with bounds on the request head's size and time
        # (docs/settings.md, docs/decisions.md).
        config = uvicorn.Config(
            create_app(self._api, public_metrics=public_metrics),
            host=host,
            port=port,
            log_config=None,
            access_log=False,
            lifespan="off",
            http=bounded_protocol(
                head_timeout_s=s.http_header_timeout_s, max_head_bytes=s.http_max_header_bytes
            ),
            timeout_keep_alive=s.http_keep_alive_s,
            # X-Forwarded-For / -Proto from these proxies only (docs/console.md).
            proxy_headers=True,
            forwarded_allow_ips=s.forwarded_allow_ips,
        )
        self._server = _QuietServer(config)

    async def run(self) -> None:
        try:
            await self._server.serve()
        finally:
            await self._api.aclose()

    def stop(self) -> None:
        self._server.should_exit = True

    async def serving(self, running: asyncio.Future[Any]) -> bool:
        """Wait until the server listens (True), or ``running`` (the task
        that runs it) ends first (False). uvicorn sets a flag, no event."""
        while not self._server.started:
            if running.done():
                return False
            await asyncio.sleep(0.02)
        return True


async def serve_api(settings: Settings, *, host: str, port: int) -> None:
    app = app_from(settings)
    async with open_resources(settings) as res:
        await require_current_schema(res)
        server = ApiServer(app, res, host=host, port=port)
        health = health_server(res, list(jobs_for(app, res).streams.values()), [])
        await run_services(server, *([health] if health else []))


# -- workers ----------------------------------------------------------------------


class WorkerGroup:
    """One ``Worker`` and one ``Reconciler`` per workflow of the app, one
    ``Worker`` per shadow variant (ONCELY_SHADOW), the timers that resume
    waiting jobs, and the job retention, in one process under one task
    group: if any of them fails, the others stop and the process exits with
    the error.

    ``models`` gives the adapter for another model name (a variant's); by
    default the OpenAI-compatible adapter's ``with_model``."""

    def __init__(
        self, app: App, res: Resources, llm: LLM, *, models: Callable[[str], LLM] | None = None
    ) -> None:
        s = res.settings
        self.jobs = jobs_for(app, res)
        self.checkpoints = Checkpoints(self.jobs)
        self._models = models or _model_switch(llm)
        self._fleet = FleetLimiter(res.redis, limits(s))
        self._wake_relay = OutboxWakeUp(res.pool)
        self._config, self._steps = worker_config(s), step_config(s)
        self._settings = s
        self.cooldown = Cooldown(res.redis, cooldown_policy(s))
        self.ledger = ledger_for(res)
        # Adapters of fallbacks on endpoints of their own, closed with the group.
        self._endpoints: dict[tuple[ModelSpec, str], OpenAICompatible] = {}
        plan = shadow_plan(s)
        self.shadow_workers = [
            self._shadow_worker(app[spec.workflow], spec, res)
            for spec in plan.shadows
            if spec.workflow in app.names
        ]
        self.workers = [self._worker(w, plan, res) for w in app]
        self.reconcilers = [Reconciler(self.jobs, w.name, after_s=s.reconcile_after_s) for w in app]
        self.retention = Retention(self.jobs, retention_s=s.job_retention_s)
        self.timers = Timers(self.checkpoints)

    def _worker(self, w: Workflow[Any, Any], plan: ShadowPlan, res: Resources) -> Worker:
        name = plan.primary.get(w.name)
        variant = w.variant(name) if name else None
        if variant is not None:
            log.info("variant.primary", workflow=w.name, variant=variant.name)
        shadows = [
            (spec.variant, spec.rate, Stream(res.redis, names.shadow_keys(w.name, spec.variant)))
            for spec in plan.for_workflow(w.name)
        ]
        handler = WorkflowHandler(
            w,
            self.jobs,
            LimitedLLM(self._llm_for(variant), self._fleet),
            self._steps_for(variant),
            self._wake_relay,
            variant=variant,
            shadows=ShadowDispatch(shadows) if shadows else None,
            checkpoints=self.checkpoints,
            route=ModelRoute(self._fallbacks(w), self.cooldown, self.ledger),
        )
        return Worker(
            self.jobs.streams[w.name],
            handler,
            self._config,
            workflow=w.name,
            on_dead=self.jobs.mark_dead,
            on_failed=self.jobs.record_deliveries,
            is_cancelled=self.checkpoints.is_cancelled,
        )

    def _shadow_worker(self, w: Workflow[Any, Any], spec: ShadowSpec, res: Resources) -> Worker:
        """Shadow calls count against their share of the fleet limits, and a
        shadow worker holds that share of a worker's handler slots."""
        s = res.settings
        variant = w.variant(spec.variant)
        share = FleetLimiter(res.redis, limits(s), share=s.shadow_rpm_share)
        store = ShadowResults(res.pool, statement_timeout_s=s.pg_statement_timeout_s)
        judge = w.evaluator if isinstance(w.evaluator, ModelJudge) else None
        handler = ShadowHandler(
            w,
            variant,
            store,
            LimitedLLM(self._llm_for(variant), share),
            self._steps_for(variant),
            judge_llm=(
                LimitedLLM(self._models(judge.model or self._steps.model_name), share)
                if judge is not None
                else None
            ),
            events=self.checkpoints.events,
            ledger=self.ledger,
        )
        concurrency = max(1, round(self._config.concurrency * s.shadow_rpm_share))
        return Worker(
            Stream(res.redis, names.shadow_keys(w.name, variant.name)),
            handler,
            replace(self._config, concurrency=concurrency),
            workflow=f"{w.name}:shadow:{variant.name}",
            on_dead=handler.record_dead,
        )

    def _fallbacks(self, w: Workflow[Any, Any]) -> tuple[Target, ...]:
        """The workflow's fallbacks (its own, else ONCELY_LLM_FALLBACKS): a
        name alone is another model of the primary's endpoint; the N-th's
        key is ONCELY_LLM_API_KEY_<N>, else the primary's."""
        s = self._settings
        specs = parse_models(w.fallbacks if w.fallbacks is not None else s.llm_fallbacks)
        targets = []
        for number, spec in enumerate(specs, start=1):
            if spec.base_url is None:
                targets.append(Target(spec.name, self._models(spec.name)))
                continue
            key = s.llm_api_keys.get(number, s.llm_api_key).get_secret_value()
            adapter = self._endpoints.get((spec, key))
            if adapter is None:
                adapter = OpenAICompatible.connect(spec.base_url, key, spec.name)
                self._endpoints[spec, key] = adapter
            targets.append(Target(spec.name, adapter))
        return tuple(targets)

    def _llm_for(self, variant: Variant | None) -> LLM:
        model = variant.model if variant is not None else None
        return self._models(model or self._steps.model_name)

    def _steps_for(self, variant: Variant | None) -> StepConfig:
        if variant is None or variant.model is None:
            return self._steps
        return replace(self._steps, model_name=variant.model)

    @property
    def loops(self) -> list[Worker]:
        return [*self.workers, *self.shadow_workers]

    @property
    def services(self) -> list[Service]:
        return [
            *self.workers,
            *self.shadow_workers,
            *self.reconcilers,
            self.retention,
            self.timers,
        ]

    async def run(self) -> None:
        """Every service until stopped; the ledger writes its last calls
        once they have all ended."""
        try:
            async with self.ledger.running(), asyncio.TaskGroup() as group:
                for service in self.services:
                    group.create_task(service.run())
        finally:
            for adapter in self._endpoints.values():
                await adapter.aclose()

    def stop(self) -> None:
        for service in self.services:
            service.stop()


def _model_switch(llm: LLM) -> Callable[[str], LLM]:
    """Another model on the same endpoint (the adapter's ``with_model``); an
    adapter without one serves every model name itself."""
    if isinstance(llm, OpenAICompatible):
        return llm.with_model
    return lambda _model: llm


async def run_worker(settings: Settings, workflows: list[str] | None = None) -> None:
    app = app_from(settings, workflows)
    async with open_resources(settings) as res, connect_llm(settings) as llm:
        await require_current_schema(res)
        group = WorkerGroup(app, res, llm)
        health = health_server(
            res,
            list(group.jobs.streams.values()),
            [*(w.progress for w in group.loops), group.timers.progress],
        )
        await run_services(group, *([health] if health else []))


def health_server(
    res: Resources, streams: list[Stream], loops: list[Progress]
) -> HealthServer | None:
    """``/metrics``, ``/healthz``, ``/readyz`` on ``ONCELY_METRICS_PORT``, if set."""
    s = res.settings
    if s.metrics_port is None:
        return None
    # A loop may wait for a free slot as long as a handler may run.
    stale_after_s = max(60.0, s.job_budget_s + s.job_grace_s + 30)
    config = HealthConfig(port=s.metrics_port, stale_after_s=stale_after_s)
    return HealthServer(config, redis=res.redis, pool=res.pool, streams=streams, loops=loops)


async def run_services(*services: Service) -> None:
    """Run services side by side until SIGTERM/SIGINT stops them all; one that
    fails stops the others and the process."""
    settle_heap()
    with stop_on_signals(*(s.stop for s in services)):
        async with asyncio.TaskGroup() as group:
            for service in services:
                group.create_task(service.run())


def settle_heap() -> None:
    """Once a server process has loaded everything it needs: the objects it
    holds from then on (modules, the app, pools) are frozen out of the
    cycle collector's scans, and young objects are collected every 20,000
    allocations rather than 700. A full collection then scans only what
    requests made, not the whole heap: one took 67–84 ms in ``oncely api``
    under load, stalling every request in flight (bench/README.md, Intake)."""
    gc.freeze()
    gc.set_threshold(20_000, 50, 100)


# -- the relay --------------------------------------------------------------------


def build_relay(app: App, res: Resources) -> tuple[Relay, EffectRouter]:
    """The relay and its router; the caller closes the router after the relay stops."""
    router = build_router(app.effects(), senders_config(res.settings))
    relay = Relay(
        OutboxStore(res.pool),
        router,
        relay_config(res.settings),
        database_url=res.settings.database_url,
    )
    return relay, router


async def run_relay(settings: Settings) -> None:
    app = app_from(settings)
    async with open_resources(settings) as res:
        await require_current_schema(res)
        relay, router = build_relay(app, res)
        health = health_server(res, list(jobs_for(app, res).streams.values()), [relay.progress])
        try:
            await run_services(relay, *([health] if health else []))
        finally:
            await router.aclose()
