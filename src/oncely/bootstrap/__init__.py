"""The composition root: settings in, configs, clients and processes out.

- ``configs``: settings into the config dataclasses every library component
  takes (the only place, with the CLI, that reads ``Settings``);
- ``clients``: the Redis client, the PostgreSQL pool, the model client and
  the stores built on them;
- ``processes``: the API server, the workers, the relay, their health
  server, and the signals that stop them.

Their names are here too: ``uvicorn --factory oncely.bootstrap:asgi_app``.
"""

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
