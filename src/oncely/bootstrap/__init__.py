"""The composition root: settings in, configs, clients and processes out.

- ``configs``: settings into the config dataclasses every library component
  takes (the only place, with the CLI, that reads ``Settings``);
- ``clients``: the Redis client, the PostgreSQL pool, the model client and
  the stores built on them;
- ``processes``: the API server, the workers, the relay, their health
  server, and the signals that stop them.

The names of all three are importable from here (``uvicorn --factory
oncely.bootstrap:asgi_app``), each loaded when first used, so that a command
that needs the clients does not load the API server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from oncely.lazy import exports

# Each name, and the module of this package that defines it.
_HOMES = {
    "api_config": "oncely.bootstrap.configs",
    "ApiServer": "oncely.bootstrap.processes",
    "app_from": "oncely.bootstrap.configs",
    "asgi_app": "oncely.bootstrap.processes",
    "budgets": "oncely.bootstrap.clients",
    "build_relay": "oncely.bootstrap.processes",
    "client_bounds": "oncely.bootstrap.configs",
    "ClientBounds": "oncely.bootstrap.configs",
    "connect_llm": "oncely.bootstrap.clients",
    "cooldown_policy": "oncely.bootstrap.configs",
    "health_server": "oncely.bootstrap.processes",
    "http_api": "oncely.bootstrap.processes",
    "jobs_for": "oncely.bootstrap.clients",
    "ledger_for": "oncely.bootstrap.clients",
    "limits": "oncely.bootstrap.configs",
    "listen_url": "oncely.bootstrap.configs",
    "make_redis": "oncely.bootstrap.clients",
    "open_pool": "oncely.bootstrap.clients",
    "open_resources": "oncely.bootstrap.clients",
    "pooler_refusal": "oncely.bootstrap.clients",
    "postgres_pool": "oncely.bootstrap.clients",
    "relay_config": "oncely.bootstrap.configs",
    "require_current_schema": "oncely.bootstrap.clients",
    "require_urls": "oncely.bootstrap.clients",
    "Resources": "oncely.bootstrap.clients",
    "retry_policy": "oncely.bootstrap.configs",
    "run_relay": "oncely.bootstrap.processes",
    "run_services": "oncely.bootstrap.processes",
    "run_worker": "oncely.bootstrap.processes",
    "senders_config": "oncely.bootstrap.configs",
    "serve_api": "oncely.bootstrap.processes",
    "settle_heap": "oncely.bootstrap.processes",
    "shadow_plan": "oncely.bootstrap.configs",
    "shadow_streams": "oncely.bootstrap.clients",
    "standalone_app": "oncely.bootstrap.processes",
    "ShadowPlan": "oncely.bootstrap.configs",
    "step_config": "oncely.bootstrap.configs",
    "stop_on_signals": "oncely.bootstrap.processes",
    "worker_config": "oncely.bootstrap.configs",
    "WorkerGroup": "oncely.bootstrap.processes",
}

__all__ = [
    "ApiServer",
    "ClientBounds",
    "Resources",
    "ShadowPlan",
    "WorkerGroup",
    "api_config",
    "app_from",
    "asgi_app",
    "budgets",
    "build_relay",
    "client_bounds",
    "connect_llm",
    "cooldown_policy",
    "health_server",
    "http_api",
    "jobs_for",
    "ledger_for",
    "limits",
    "listen_url",
    "make_redis",
    "open_pool",
    "open_resources",
    "pooler_refusal",
    "postgres_pool",
    "relay_config",
    "require_current_schema",
    "require_urls",
    "retry_policy",
    "run_relay",
    "run_services",
    "run_worker",
    "senders_config",
    "serve_api",
    "settle_heap",
    "shadow_plan",
    "shadow_streams",
    "standalone_app",
    "step_config",
    "stop_on_signals",
    "worker_config",
]

if TYPE_CHECKING:
    from oncely.bootstrap.clients import (
        Resources,
        budgets,
        connect_llm,
        jobs_for,
        ledger_for,
        make_redis,
        open_pool,
        open_resources,
        pooler_refusal,
        postgres_pool,
        require_current_schema,
        require_urls,
        shadow_streams,
    )
    from oncely.bootstrap.configs import (
        ClientBounds,
        ShadowPlan,
        api_config,
        app_from,
        client_bounds,
        cooldown_policy,
        limits,
        listen_url,
        relay_config,
        retry_policy,
        senders_config,
        shadow_plan,
        step_config,
        worker_config,
    )
    from oncely.bootstrap.processes import (
        ApiServer,
        WorkerGroup,
        asgi_app,
        build_relay,
        health_server,
        http_api,
        run_relay,
        run_services,
        run_worker,
        serve_api,
        settle_heap,
        standalone_app,
        stop_on_signals,
    )


__getattr__ = exports(globals(), _HOMES)
