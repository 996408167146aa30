"""Running the processes: the API server, the workers of an app's
workflows, the relay, their health server, and the signals that stop them."""

from __future__ import annotations

import asyncio
import gc
import signal
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import structlog
import uvicorn

from oncely import names
from oncely.app import App
from oncely.bootstrap.clients import (
    Resources,
    connect_batches,
    connect_llm,
    connect_model,
    jobs_for,
    ledger_for,
    open_resources,
    require_current_schema,
)
from oncely.bootstrap.configs import (
    ShadowPlan,
    api_config,
    app_from,
    cooldown_policy,
    limits,
    listen_url,
    relay_config,
    senders_config,
    shadow_plan,
    step_config,
    worker_config,
)
from oncely.clock import ClockWatch, process_name
from oncely.effects import WebhookEffect
from oncely.health import HealthConfig, HealthServer
from oncely.jobs.checkpoints import Checkpoints
from oncely.jobs.handler import WorkflowHandler
from oncely.jobs.kit import StepConfig
from oncely.jobs.reconcile import Reconciler
from oncely.jobs.records import DeliveryReport
from oncely.jobs.retention import Retention
from oncely.jobs.schedules import Scheduler, scheduled
from oncely.jobs.timers import Timers
from oncely.jobs.transitions import Ended
from oncely.live.events import JobEvents, LiveConfig
from oncely.llm.base import LLM, ModelClient
from oncely.llm.batches import Batcher, BatchLines
from oncely.llm.cooldown import Cooldown
from oncely.llm.limiter import FleetLimiter, LimitedLLM
from oncely.llm.model import ModelRoute
from oncely.llm.routing import ModelSpec, Target, parse_models
from oncely.logs import hide_url_secrets
from oncely.outbox.relay import Relay
from oncely.outbox.store import OutboxStore
from oncely.outbox.wakeup import OutboxWakeUp
from oncely.queue.stream import Stream
from oncely.queue.worker import Worker
from oncely.senders import EffectRouter, build_router
from oncely.services import Progress, Service
from oncely.settings import Settings
from oncely.shadow.config import ShadowSpec
from oncely.shadow.dispatch import ShadowDispatch
from oncely.shadow.evaluate import ModelJudge
from oncely.shadow.run import ShadowHandler
from oncely.shadow.store import ShadowResults
from oncely.workflow import Variant, Workflow

if TYPE_CHECKING:
    from fastapi import FastAPI

    from oncely.api.app import OncelyAPI
    from oncely.api.auth import TenantDependency


log = structlog.get_logger("oncely.process")


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
    clients = resources if resources is not None else (lambda: open_resources(s, "api"))
    return OncelyAPI(app, api_config(s), clients, auth=auth)


def standalone_app(api: OncelyAPI, settings: Settings, *, public_metrics: bool = True) -> FastAPI:
    """The API as ``oncely api`` serves it: ``api``'s standalone app
    (``create_app``) and, with ``ONCELY_CONSOLE_KEY``, the web console at
    /console (the API itself knows nothing of the console)."""
    from oncely.api.app import create_app

    served = create_app(api, public_metrics=public_metrics)
    if settings.console_key is not None:
        from oncely.console import mount_console

        mount_console(served, api, settings.console_key.get_secret_value())
    return served


def asgi_app() -> FastAPI:
    """ASGI factory: ``uvicorn --factory oncely.bootstrap:asgi_app`` (or
    gunicorn with uvicorn workers). Settings and ``ONCELY_APP`` from the
    environment; clients opened by the lifespan. uvicorn's access log, on
    by default here, never shows a stream token (``logs.hide_url_secrets``)."""
    hide_url_secrets()
    settings = Settings()
    return standalone_app(http_api(app_from(settings), settings), settings)


class _QuietServer(uvicorn.Server):
    """uvicorn without its own signal handlers: ``stop_on_signals`` owns them,
    so one Ctrl-C stops the API and every other service in the process."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class ApiServer:
    def __init__(self, app: App, res: Resources, *, host: str, port: int) -> None:
        from oncely.api.server import bounded_protocol

        self._api = http_api(app, res.settings, resources=res)
        # With a metrics port, /metrics leaves the public port (health_server).
        public_metrics = res.settings.metrics_port is None
        s = res.settings
        # httptools with bounds on the request head's size and time
        # (docs/settings.md, docs/decisions.md).
        config = uvicorn.Config(
            standalone_app(self._api, s, public_metrics=public_metrics),
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
        await self._api.publish_limits()
        try:
            await self._server.serve()
        finally:
            await self._api.aclose()

    def stop(self) -> None:
        # Open streams end now (their clients resume with Last-Event-ID), or
        # the server would wait for them to end on their own.
        self._api.live.stop()
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
    async with open_resources(settings, "api") as res:
        await require_current_schema(res)
        server = ApiServer(app, res, host=host, port=port)
        health = health_server(res, list(jobs_for(app, res).streams.values()), [])
        await run_services(server, clock_watch(res, "api"), *([health] if health else []))


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
        self._wake_relay = OutboxWakeUp(res.pool, timeout_s=res.settings.pg_statement_timeout_s)
        self._config, self._steps = worker_config(s), step_config(s)
        self._settings = s
        self.cooldown = Cooldown(res.redis, cooldown_policy(s))
        self.events = JobEvents(res.redis, LiveConfig(s.stream_maxlen, s.stream_ttl_s))
        # What follows a job's status change and its end (oncely.jobs.transitions);
        # a workflow's shadow variants subscribe with its worker (_worker).
        self.jobs.transitions.subscribe(self.events.status_changed)
        self.jobs.transitions.when_ended(self.checkpoints.children.on_end)
        self.ledger = ledger_for(res)
        # The batch lane's lines, and what gathers them into batches of the
        # primary's endpoint, in its dialect (docs/lanes.md).
        self.batch_lines = BatchLines(
            res.pool, poll_s=s.batch_poll_s, statement_timeout_s=s.pg_statement_timeout_s
        )
        batch_apis, self._batch_api = connect_batches(s)
        self.batcher = Batcher(
            self.batch_lines,
            batch_apis,
            gather_s=s.batch_gather_s,
            max_calls=s.batch_max_calls,
            lease_s=s.batch_lease_s,
        )
        # Adapters of fallbacks on endpoints of their own, closed with the group.
        self._endpoints: dict[tuple[ModelSpec, str], ModelClient] = {}
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
        self.schedules = Scheduler(
            self.jobs,
            scheduled(app),
            tenant=s.schedule_tenant,
            catch_up=s.schedule_catch_up,
        )

    def _worker(self, w: Workflow[Any, Any], plan: ShadowPlan, res: Resources) -> Worker:
        name = plan.primary.get(w.name)
        variant = w.variant(name) if name else None
        if variant is not None:
            log.info("variant.primary", workflow=w.name, variant=variant.name)
        shadows = [
            (spec.variant, spec.rate, Stream(res.redis, names.shadow_keys(w.name, spec.variant)))
            for spec in plan.for_workflow(w.name)
        ]
        if shadows:
            self.jobs.transitions.when_ended(ShadowDispatch(w.name, shadows).on_end)
        handler = WorkflowHandler(
            w,
            self.jobs,
            LimitedLLM(self._llm_for(variant), self._fleet),
            self._steps_for(variant),
            self._wake_relay,
            variant=variant,
            checkpoints=self.checkpoints,
            route=ModelRoute(
                self._fallbacks(w),
                self.cooldown,
                self.ledger,
                background_s=self._settings.llm_background_s,
                lane=w.lane,
                flex_timeout_s=self._settings.llm_flex_timeout_s,
                batches=self.batch_lines,
            ),
            events=self.events,
        )
        return Worker(
            self.jobs.streams[w.name],
            handler,
            self._config,
            workflow=w.name,
            on_dead=self._on_dead(w.name),
            on_failed=self._on_failed(w.name),
            is_cancelled=self.checkpoints.is_cancelled,
            cooling=self.cooldown.scopes,
        )

    def _on_dead(self, workflow: str) -> Callable[[str, str, int | None], Awaitable[None]]:
        """A dead job's row, then its end told (its live stream, its map)."""

        async def dead(job_id: str, error: str, generation: int | None) -> None:
            child = await self.jobs.mark_dead(job_id, error, generation)
            await self.jobs.transitions.ended(Ended(workflow, job_id, "dead", child=child))

        return dead

    def _on_failed(self, workflow: str) -> Callable[[Sequence[DeliveryReport]], Awaitable[None]]:
        """Failed deliveries into their jobs' histories; the live streams of
        those redelivered after a backoff told the job is back in line."""

        async def failed(reports: Sequence[DeliveryReport]) -> None:
            await self.jobs.record_deliveries(reports)
            for r in reports:
                if r.outcome == "retry":
                    self.jobs.transitions.changed(workflow, r.job_id, "queued")

        return failed

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
        name alone is another model of the primary's endpoint, in the
        primary's dialect; one with its own endpoint or another dialect gets
        a client of its own (``chat`` unless it names one:
        docs/providers.md). The N-th's key is ONCELY_LLM_API_KEY_<N>, else
        the primary's."""
        s = self._settings
        specs = parse_models(w.fallbacks if w.fallbacks is not None else s.llm_fallbacks)
        targets = []
        for number, spec in enumerate(specs, start=1):
            same_endpoint = spec.base_url is None
            dialect = spec.dialect or (s.llm_provider if same_endpoint else "chat")
            if same_endpoint and dialect == s.llm_provider:
                targets.append(Target(spec.name, self._models(spec.name)))
                continue
            key = s.llm_api_keys.get(number, s.llm_api_key).get_secret_value()
            endpoint = replace(spec, base_url=spec.base_url or s.llm_base_url, dialect=dialect)
            adapter = self._endpoints.get((endpoint, key))
            if adapter is None:
                adapter = connect_model(s, endpoint.base_url or "", key, spec.name, dialect)
                self._endpoints[endpoint, key] = adapter
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
            self.schedules,
            self.batcher,
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
            await self._batch_api.aclose()

    def stop(self) -> None:
        for service in self.services:
            service.stop()


def _model_switch(llm: LLM) -> Callable[[str], LLM]:
    """Another model on the same endpoint (the adapter's ``with_model``); an
    adapter without one serves every model name itself."""
    if isinstance(llm, ModelClient):
        return llm.with_model
    return lambda _model: llm


async def run_worker(settings: Settings, workflows: list[str] | None = None) -> None:
    app = app_from(settings, workflows)
    async with open_resources(settings, "worker") as res, connect_llm(settings) as llm:
        await require_current_schema(res)
        log.info(
            "model.client",
            client=settings.llm_client,
            dialect=settings.llm_provider,
            model=settings.llm_model,
        )
        group = WorkerGroup(app, res, llm)
        health = health_server(
            res,
            list(group.jobs.streams.values()),
            [*(w.progress for w in group.loops), group.timers.progress, group.schedules.progress],
        )
        await run_services(group, clock_watch(res, "worker"), *([health] if health else []))


def health_server(
    res: Resources, streams: list[Stream], loops: list[Progress], *, wake_up: str | None = None
) -> HealthServer | None:
    """``/metrics``, ``/healthz``, ``/readyz`` on ``ONCELY_METRICS_PORT``, if
    set (``wake_up``: how the relay learns of new outbox rows, for /readyz)."""
    s = res.settings
    if s.metrics_port is None:
        return None
    # A loop may wait for a free slot as long as a handler may run.
    stale_after_s = max(60.0, s.job_budget_s + s.job_grace_s + 30)
    config = HealthConfig(port=s.metrics_port, stale_after_s=stale_after_s, wake_up=wake_up)
    return HealthServer(config, redis=res.redis, pool=res.pool, streams=streams, loops=loops)


def clock_watch(res: Resources, kind: str) -> ClockWatch:
    """The process's clock against PostgreSQL's, warned about and reported
    for ``oncely status`` (docs/production.md, Clocks)."""
    return ClockWatch(
        res.pool,
        res.redis,
        process_name(kind),
        timeout_s=res.settings.pg_statement_timeout_s,
    )


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


def build_relay(app: App, res: Resources) -> tuple[Relay, EffectRouter]:
    """The relay and its router; the caller closes the router after the relay stops."""
    router = build_router(app.effects(), senders_config(res.settings))
    checkpoints = Checkpoints(jobs_for(app, res))

    async def resume(job_ids: list[str]) -> None:
        await checkpoints.resume_due(len(job_ids), job_ids)

    calls = {e.topic: w for w, e in app.effects() if isinstance(e, WebhookEffect) and e.answers}
    relay = Relay(
        OutboxStore(res.pool, statement_timeout_s=res.settings.pg_statement_timeout_s),
        router,
        relay_config(res.settings),
        database_url=listen_url(res.settings),
        resume=resume,
        workflow_of=calls,
    )
    return relay, router


async def run_relay(settings: Settings) -> None:
    app = app_from(settings)
    async with open_resources(settings, "relay") as res:
        await require_current_schema(res)
        relay, router = build_relay(app, res)
        wake_up = "notify" if relay.database_url else "poll"
        if wake_up == "poll":
            log.warning(
                "outbox.polling_only",
                reason="ONCELY_DATABASE_POOLER=transaction without ONCELY_DATABASE_LISTEN_URL",
                poll_s=relay.config.poll_s,
            )
        health = health_server(
            res, list(jobs_for(app, res).streams.values()), [relay.progress], wake_up=wake_up
        )
        try:
            await run_services(relay, clock_watch(res, "relay"), *([health] if health else []))
        finally:
            await router.aclose()
