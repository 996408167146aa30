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

import importlib
from typing import TYPE_CHECKING, Any

# Each name, and the module of this package that defines it.
_HOMES = {
    "api_config": "configs",
    "ApiServer": "processes",
    "app_from": "configs",
    "asgi_app": "processes",
    "budgets": "clients",
    "build_relay": "processes",
    "client_bounds": "configs",
    "ClientBounds": "configs",
    "connect_llm": "clients",
    "cooldown_policy": "configs",
    "health_server": "processes",
    "http_api": "processes",
    "jobs_for": "clients",
    "ledger_for": "clients",
    "limits": "configs",
    "make_redis": "clients",
    "open_resources": "clients",
    "postgres_pool": "clients",
    "relay_config": "configs",
    "require_current_schema": "clients",
    "require_urls": "clients",
    "Resources": "clients",
    "retry_policy": "configs",
    "run_relay": "processes",
    "run_services": "processes",
    "run_worker": "processes",
    "senders_config": "configs",
    "serve_api": "processes",
    "settle_heap": "processes",
    "shadow_plan": "configs",
    "shadow_streams": "clients",
    "ShadowPlan": "configs",
    "step_config": "configs",
    "stop_on_signals": "processes",
    "worker_config": "configs",
    "WorkerGroup": "processes",
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
    "make_redis",
    "open_resources",
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
        open_resources,
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
        stop_on_signals,
    )


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'oncely.bootstrap' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"oncely.bootstrap.{home}"), name)
    globals()[name] = value
    return value
