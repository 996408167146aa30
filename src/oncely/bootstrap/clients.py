"""Building what the processes share from settings: the Redis client, the
PostgreSQL pool, the model client, and the stores made of them."""

from __future__ import annotations

import math
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import conninfo
from psycopg_pool import AsyncConnectionPool, PoolTimeout
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException

from oncely import names
from oncely.app import App
from oncely.bootstrap.configs import client_bounds, shadow_plan
from oncely.jobs.store import Jobs
from oncely.queue.stream import Stream
from oncely.redis_client import ClusterClient, HiredisPacked, RedisClient, SharedConnectionRedis
from oncely.settings import Settings
from oncely.sql.bounded import Pool, TransactionPooled, run_transaction
from oncely.sql.connect import CountedConnection, refusal_line
from oncely.sql.migrate import SchemaMismatch, schema_state
from oncely.usage.budgets import BudgetLimits, Budgets
from oncely.usage.ledger import Ledger
from oncely.usage.prices import Prices

if TYPE_CHECKING:
    from oncely.llm.base import ModelClient
    from oncely.llm.batches import BatchAPI


@dataclass(frozen=True)
class Resources:
    settings: Settings
    redis: RedisClient
    pool: AsyncConnectionPool


def require_urls(settings: Settings) -> tuple[str, str]:
    if not settings.redis_url or not settings.database_url:
        if settings.data_dir.is_dir():  # a dev stack's data, and none running from it
            raise SystemExit(
                f"no oncely dev is running from {settings.data_dir}: start it (oncely dev),"
                " or set ONCELY_REDIS_URL and ONCELY_DATABASE_URL"
            )
        raise SystemExit(
            "set ONCELY_REDIS_URL and ONCELY_DATABASE_URL (or run `oncely dev`, "
            "which starts embedded servers; for one started with --data-dir X, "
            "set ONCELY_DATA_DIR=X)"
        )
    return settings.redis_url, settings.database_url


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


def postgres_pool(database_url: str, s: Settings, kind: str = "cli") -> AsyncConnectionPool:
    """The pool of a process of ``kind`` (api, worker, relay, cli: its
    ``application_name`` in ``pg_stat_activity`` unless the URL names one).

    It holds ``ONCELY_PG_POOL_MIN`` connections, grows on demand up to
    ``Settings.pool_max(kind)``, and closes one unused for
    ``ONCELY_PG_POOL_IDLE_S`` at a time (docs/production.md, Connection
    budget); every failed connect is counted and logged
    (``oncely.sql.connect``).

    How the server's statement bound is set depends on
    what stands in front of PostgreSQL (``ONCELY_DATABASE_POOLER``): the
    startup ``options`` when nothing does; a ``SET`` once per connection
    behind a session pooler (which refuses ``options``); ``SET LOCAL`` in
    each transaction behind a transaction pooler, with no prepared
    statements either, since the next transaction may run on another
    server connection, where the statement was never prepared."""
    bounds = client_bounds(s)
    timeout_ms = int(bounds.statement_timeout_s * 1000)
    params = conninfo.conninfo_to_dict(database_url)
    kwargs: dict[str, Any] = {
        # Each statement commits on its own unless code opens
        # ``conn.transaction()``: no BEGIN/COMMIT round trips for single
        # statements, which is every hot-path write.
        "autocommit": True,
        # libpq counts whole seconds, at least 2.
        "connect_timeout": max(2, math.ceil(bounds.connect_timeout_s)),
    }
    if not params.get("application_name"):
        kwargs["application_name"] = f"oncely-{kind}"
    options: dict[str, Any] = {
        "connection_class": CountedConnection,
        "min_size": s.pg_pool_min,
        "max_size": s.pool_max(kind),
        "max_idle": s.pg_pool_idle_s,
        "open": False,
        # The longest wait for a free connection: a request fails fast when
        # the pool has none (server down or frozen) instead of queueing.
        "timeout": bounds.connect_timeout_s,
        # Give up replacing a lost connection after a second; the pool grows
        # again on demand, so a returning server serves at once instead of
        # after a backoff of many seconds.
        "reconnect_timeout": 1.0,
        "kwargs": kwargs,
    }
    if s.database_pooler == "transaction":
        kwargs["prepare_threshold"] = None
        return TransactionPooled(database_url, statement_timeout_ms=timeout_ms, **options)
    if s.database_pooler == "session":

        async def bound_session(conn: psycopg.AsyncConnection[Any]) -> None:
            await conn.execute(f"SET statement_timeout = {timeout_ms}")

        return Pool(database_url, configure=bound_session, **options)
    kwargs["options"] = f"{params.get('options') or ''} -c statement_timeout={timeout_ms}".strip()
    return Pool(database_url, **options)


class DatabaseRefused(Exception):
    """PostgreSQL (or a pooler before it) refused a process's first
    connections; the message is one line saying what it said and, where it
    is known, what to set. A command exits 69 on it, as on any server that
    does not answer."""


async def open_pool(pool: AsyncConnectionPool, database_url: str, s: Settings) -> None:
    """Open ``pool``, its first connections made; when they cannot be, one
    line that says why (the pool itself only says it gave up waiting)."""
    bounds = client_bounds(s)
    try:
        await pool.open(wait=True, timeout=max(10, bounds.connect_timeout_s))
    except PoolTimeout:
        await pool.close()
        kwargs = pool.kwargs if isinstance(pool.kwargs, dict) else {}
        refused = await _why_not_connected(database_url, kwargs)
        if refused is not None:
            raise DatabaseRefused(refused) from None
        raise


async def _why_not_connected(database_url: str, kwargs: dict[str, Any]) -> str | None:
    """Why the pool's first connections could not be made, as one line: a
    pooler refusing what the pool sends at connect time names the setting
    that fixes it; any other refusal (no such database, a password) is what
    the server said (None: a connect now works, the pool was only slow)."""
    try:
        conn = await psycopg.AsyncConnection.connect(database_url, **kwargs)
    except psycopg.OperationalError as exc:
        return pooler_refusal(str(exc)) or f"PostgreSQL refused the connection: {refusal_line(exc)}"
    await conn.close()
    return None


def pooler_refusal(error: str) -> str | None:
    """PgBouncer (and poolers like it) answer a startup parameter it does not
    pass on with ``unsupported startup parameter: <name>``; that line, with
    what to set, or None for any other error."""
    found = re.search(r"unsupported startup parameter:\s*(\S+)", error)
    if found is None:
        return None
    return (
        f"PostgreSQL's connection pooler (PgBouncer or the like) refused the startup "
        f"parameter `{found.group(1)}`: set ONCELY_DATABASE_POOLER=transaction (session "
        "for a session-mode pooler) and take any `options` out of ONCELY_DATABASE_URL "
        "(docs/production.md, Behind a connection pooler)"
    )


@asynccontextmanager
async def open_resources(settings: Settings, kind: str = "cli") -> AsyncIterator[Resources]:
    """The Redis client and the PostgreSQL pool of a process of ``kind``
    (``postgres_pool``), closed on the way out."""
    redis_url, database_url = require_urls(settings)
    bounds = client_bounds(settings)
    redis = make_redis(
        redis_url,
        cluster=settings.redis_cluster,
        timeout_s=bounds.redis_timeout_s,
        connect_timeout_s=bounds.connect_timeout_s,
        shared=settings.redis_shared_connection,
    )
    pool = postgres_pool(database_url, settings, kind)
    await open_pool(pool, database_url, settings)
    try:
        yield Resources(settings, redis, pool)
    finally:
        await pool.close()
        await redis.aclose()


async def require_current_schema(res: Resources) -> None:
    """Long-running processes refuse a database that is behind or ahead of
    this code (one readable line; ``oncely migrate`` first when upgrading)."""
    state = await run_transaction(
        res.pool, schema_state, timeout_s=res.settings.pg_statement_timeout_s
    )
    problem = state.problem()
    if problem:
        raise SchemaMismatch(problem)


def jobs_for(app: App, res: Resources) -> Jobs:
    streams = {w.name: Stream(res.redis, w.keys) for w in app}
    return Jobs(res.pool, streams, statement_timeout_s=res.settings.pg_statement_timeout_s)


def connect_llm(s: Settings) -> ModelClient:
    """The primary model's client, in its dialect (ONCELY_LLM_PROVIDER, or
    the prefix of ONCELY_LLM_MODEL)."""
    key = s.llm_api_key.get_secret_value()
    return connect_model(s, s.llm_base_url, key, s.llm_model, s.llm_provider)


def connect_model(
    s: Settings, base_url: str, api_key: str, model: str, dialect: str = "chat"
) -> ModelClient:
    """A client of one endpoint in ``dialect``: ``anthropic``, Anthropic's
    SDK (the ``oncely[anthropic]`` extra); ``responses``, OpenAI's Responses
    API through the ``openai`` SDK; ``chat``, as ``ONCELY_LLM_CLIENT``
    says. Each module is imported here, by the processes that call a model:
    not by `oncely status` and the like."""
    if dialect == "anthropic":
        try:
            from oncely.llm.anthropic_messages import AnthropicMessages
        except ImportError as exc:
            raise RuntimeError(
                f"the anthropic: dialect ({model}) needs the anthropic SDK:"
                " pip install 'oncely[anthropic]'"
            ) from exc
        return AnthropicMessages.connect(base_url, api_key, model, max_tokens=s.llm_max_tokens)
    if dialect == "responses":
        from oncely.llm.openai_responses import OpenAIResponses

        return OpenAIResponses.connect(base_url, api_key, model)
    if s.llm_client == "lean":
        from oncely.llm.lean import LeanOpenAICompatible

        return LeanOpenAICompatible.connect(base_url, api_key, model)
    from oncely.llm.openai_compat import OpenAICompatible

    return OpenAICompatible.connect(base_url, api_key, model)


def connect_batches(s: Settings) -> tuple[dict[str, BatchAPI], Any]:
    """The batch APIs of the primary's endpoint by dialect (docs/lanes.md),
    and the client to close once done: Anthropic's Message Batches for an
    ``anthropic:`` primary, else OpenAI's Files and Batches for ``chat`` and
    ``responses`` lines. A batch line goes to the primary alone, so its
    endpoint and dialect are the only ones asked."""
    key = s.llm_api_key.get_secret_value()
    if s.llm_provider == "anthropic":
        from oncely.llm.anthropic_batches import AnthropicBatches

        claude = AnthropicBatches.connect(s.llm_base_url, key)
        return {"anthropic": claude}, claude
    from oncely.llm.batches import OpenAIBatches

    openai = OpenAIBatches.connect(s.llm_base_url, key)
    return {"chat": openai, "responses": openai.for_dialect("responses")}, openai


def budgets(s: Settings, redis: RedisClient) -> Budgets:
    limits = BudgetLimits(
        s.tenant_daily_tokens, s.tenant_daily_usd, s.budget_reserve_tokens, s.budget_hold_s
    )
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
