"""Every knob oncely has, read once at the edge (env prefix ``ONCELY_``).

Only the composition root (``oncely.bootstrap``) reads these; it maps them to
the component configs the library modules take.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict


class _Numbered(PydanticBaseSettingsSource):
    """Variables whose names carry a key, gathered into one mapping field:
    ``ONCELY_<WORKFLOW>_WEBHOOK_URL`` into ``workflow_webhook_urls`` (by
    workflow, lower-cased), ``ONCELY_LLM_API_KEY_<N>`` into
    ``llm_api_keys`` (by fallback number)."""

    _FIELDS = (
        ("workflow_webhook_urls", re.compile(r"^ONCELY_([A-Z][A-Z0-9_]*)_WEBHOOK_URL$")),
        ("llm_api_keys", re.compile(r"^ONCELY_LLM_API_KEY_([1-9][0-9]*)$")),
    )

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        gathered: dict[str, Any] = {}
        for field_name, pattern in self._FIELDS:
            found = {
                m.group(1).lower(): value
                for name, value in os.environ.items()
                if (m := pattern.match(name))
            }
            if found:
                gathered[field_name] = found
        return gathered


# The shortest console key accepted (ONCELY_CONSOLE_KEY).
CONSOLE_KEY_MIN = 32
# Each process's most PostgreSQL connections when ONCELY_PG_POOL_MAX is unset
# (Settings.pool_max).
API_POOL_MAX = 20
POOL_MAX = 10


class Settings(BaseSettings):
    """Flat settings; the CLI builds one instance and passes it down."""

    # Every number finite: an infinite timeout is no bound (and breaks the
    # drivers that take whole seconds).
    model_config = SettingsConfigDict(env_prefix="ONCELY_", extra="ignore", allow_inf_nan=False)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (
            init_settings,
            env_settings,
            _Numbered(settings_cls),
            dotenv_settings,
            file_secret_settings,
        )

    # The app whose workflows every process serves, as module:attribute.
    app: str = "oncely.builtin:app"

    # Servers. Unset means "start embedded ones" in `oncely dev` and the tests.
    redis_url: str | None = None
    # ONCELY_REDIS_URL names any node of a Redis Cluster (docs/production.md, Redis Cluster).
    redis_cluster: bool = False
    # On one server over redis://: short commands of every task share one
    # connection (docs/settings.md). False: redis-py's own pool only, e.g.
    # after upgrading redis-py past the versions this was written against.
    redis_shared_connection: bool = True
    database_url: str | None = None
    # What stands between oncely and PostgreSQL (docs/production.md, Behind a
    # connection pooler): `transaction` for PgBouncer's transaction mode and
    # the like (no prepared statements, no session state, polling for the
    # relay unless `database_listen_url` is given), `session` for a pooler
    # that keeps one server connection per client (no startup `options`).
    database_pooler: Literal["none", "session", "transaction"] = "none"
    # A direct URL (no transaction pooler) the relay LISTENs on.
    database_listen_url: str | None = None
    data_dir: Path = Path(".oncely")

    # Model provider. The base URL is written as OpenAI's (ending in /v1) for
    # every dialect. The model may name its dialect first (`anthropic:claude-x`,
    # docs/providers.md): it is then split off into `llm_provider`.
    llm_base_url: str = "http://127.0.0.1:8101/v1"
    llm_api_key: SecretStr = SecretStr("oncely-dev")
    llm_model: str = "oncely-fake"
    # The primary's dialect: `chat` (OpenAI chat completions, what
    # OpenAI-compatible servers speak), `responses` (OpenAI's Responses API,
    # through the same `openai` SDK) or `anthropic` (Anthropic's Messages
    # API through the `anthropic` SDK: the oncely[anthropic] extra).
    llm_provider: Literal["chat", "responses", "anthropic"] = "chat"
    # Background calls (docs/providers.md): a `responses:` call whose
    # attempt may take longer than this (its timeout, ONCELY_LLM_TIMEOUT_S,
    # is longer) is created in background mode, its response id stored
    # before the worker waits, so a delivery after a crash re-attaches to
    # it instead of paying for it again. 0: never.
    llm_background_s: float = Field(30.0, ge=0)
    # A flex-lane attempt's time (docs/lanes.md): OpenAI's flex tier answers
    # slower than the standard one (still within the delivery's budget).
    llm_flex_timeout_s: float = Field(900.0, gt=0)
    # The batch lane (docs/lanes.md): calls of a model are gathered into a
    # batch once this many wait, or the oldest waited this long; a waiting
    # job looks for its answer, and a batch is polled, every `_POLL_S`; a
    # process creating a batch holds it `_LEASE_S` (longer than creating
    # one takes): a batch gathered by a process that died is looked for at
    # the provider, by its id in the batch's metadata, once that has passed.
    batch_gather_s: float = Field(60.0, ge=0)
    batch_max_calls: int = Field(10_000, ge=1, le=50_000)
    batch_poll_s: float = Field(30.0, gt=0)
    batch_lease_s: float = Field(300.0, gt=0)
    # The most tokens an answer may take where the dialect asks for a bound
    # (Anthropic's `max_tokens` is required).
    llm_max_tokens: int = Field(4096, ge=1)
    # How the worker talks to the endpoint: `openai`, the official SDK; `lean`,
    # straight HTTP (oncely.llm.lean), the same calls for less CPU per call.
    llm_client: Literal["openai", "lean"] = "openai"
    llm_timeout_s: float = Field(20.0, gt=0)
    llm_max_attempts: int = Field(4, ge=1)
    llm_backoff_base_s: float = Field(0.5, gt=0)
    llm_backoff_max_s: float = Field(10.0, gt=0)
    llm_retry_after_max_s: float = Field(30.0, ge=0)
    llm_rpm: int = Field(0, ge=0)
    llm_tpm: int = Field(0, ge=0)
    llm_invalid_output_retries: int = Field(2, ge=0)
    # Models a call moves on to, in order, once the one before has used up
    # its retries on a transient failure: `name` or `name@base_url`
    # (docs/model-routing.md). The N-th's key: ONCELY_LLM_API_KEY_<N>, else
    # ONCELY_LLM_API_KEY.
    llm_fallbacks: str = ""
    llm_api_keys: dict[int, SecretStr] = Field(default_factory=dict)
    # The cooldown (docs/model-routing.md): a tenant with this many failing
    # jobs (distinct; 429s never count) in the window, at least the share of
    # its calls, has the model skipped for its calls; the fleet, once that
    # many jobs of at least `_TENANTS` failing tenants (the share of those
    # active) failed (failures 0: off). While it cools, one call in the
    # scope probes it every `_PROBE_S` (or the provider's longer
    # Retry-After, up to `_S`); the first answer ends it for the fleet, and
    # the jobs waiting for it go on. `_S` is also the longest such a job
    # stays away before it looks again.
    llm_cooldown_failures: int = Field(5, ge=0)
    llm_cooldown_window_s: float = Field(30.0, gt=0)
    llm_cooldown_s: float = Field(60.0, gt=0)
    llm_cooldown_probe_s: float = Field(5.0, gt=0)
    llm_cooldown_share: float = Field(0.5, gt=0, le=1)
    llm_cooldown_tenants: int = Field(3, ge=1)
    # USD per million tokens in/out, per model: `gpt-4.1-mini=0.40/1.60,llama3=0/0`;
    # optionally cache read and cache write third and fourth (`claude-x=3/15/0.3/3.75`).
    llm_prices: str = ""
    # Per tenant per UTC day (0: no budget): over it, the intake answers 429.
    tenant_daily_tokens: int = Field(0, ge=0)
    tenant_daily_usd: float = Field(0.0, ge=0)
    # What the intake reserves of a tenant's token budget for each job it
    # accepts, beyond the request's own size, and how long a reservation no
    # spend released lasts (oncely.usage.budgets).
    budget_reserve_tokens: int = Field(1000, ge=0)
    budget_hold_s: float = Field(3600.0, gt=0)
    # The usage ledger: how often each worker writes its calls, how long rows are kept.
    ledger_flush_s: float = Field(0.25, gt=0)
    ledger_retention_s: float = Field(90 * 86400.0, gt=0)

    # Shadow runs (docs/shadow.md): per workflow,
    # variants run beside the primary on a sample of jobs, never acted on
    # (`triage=fake-v2:0.2,summaries=fake-v2:0.05`).
    shadow: str = ""
    # The share of ONCELY_LLM_RPM / ONCELY_LLM_TPM shadow calls may take.
    shadow_rpm_share: float = Field(0.2, gt=0, le=1)
    # Per workflow, the variant its jobs run on (`triage=fake-v2`): promotion.
    primary: str = ""

    # Notifications.
    sender: Literal["http", "webhook", "smtp"] = "http"
    sender_url: str = "http://127.0.0.1:8102/v1/messages"
    sender_timeout_s: float = Field(10.0, gt=0)
    webhook_secret: SecretStr = SecretStr("")
    # Where a workflow's webhook effects go: ONCELY_<WORKFLOW>_WEBHOOK_URL,
    # else this one (in `oncely dev`: the fake provider's /v1/events).
    webhook_url: str | None = None
    workflow_webhook_urls: dict[str, str] = Field(default_factory=dict)
    smtp_from: str = "oncely@localhost"

    # Idempotent intake.
    idempotency_lock_ttl_s: float = Field(30.0, gt=0)
    idempotency_result_ttl_s: int = Field(86400, gt=0)
    # How long oncely.mcp.idempotent keeps a key's result in an MCP server's
    # own database (docs/mcp.md, "Servers you own").
    mcp_keys_ttl_s: float = Field(7 * 86400.0, gt=0)
    # A running request renews its key at most this long, then ends 503.
    idempotency_max_hold_s: float = Field(120.0, gt=0)
    max_body_bytes: int = Field(1_048_576, gt=0)
    # Intake requests per minute per tenant, fleet-wide (0: no limit).
    tenant_rpm: int = Field(0, ge=0)
    # How long each API process trusts a key it looked up (0: ask every time).
    api_key_cache_s: float = Field(10.0, ge=0)
    # Unknown API keys one client address may present per minute, per API
    # process, before its unknown keys are answered 429 unlooked-up (0: off).
    api_key_unknown_per_min: int = Field(60, ge=0)
    # The HTTP server's bounds on a client (docs/settings.md):
    # request line and headers together, header fields, time to send them,
    # time to send the body, idle keep-alive.
    http_max_header_bytes: int = Field(16_384, ge=1024)
    http_max_headers: int = Field(100, ge=1)
    http_header_timeout_s: float = Field(10.0, gt=0)
    http_body_timeout_s: float = Field(30.0, gt=0)
    http_keep_alive_s: int = Field(5, ge=1)
    # The web console's operator key (/console); unset: no console (404).
    # At least 32 characters: it is the only thing between the internet and
    # every tenant's data.
    console_key: SecretStr | None = None
    # Proxies whose X-Forwarded-For / X-Forwarded-Proto the API believes
    # (comma-separated addresses or networks, "*" for any): the client
    # address the console's sign-in throttle counts, and the https that makes
    # its cookie Secure behind a TLS proxy.
    forwarded_allow_ips: str = "127.0.0.1"
    # Browser origins allowed to call the API from another origin (CORS),
    # comma-separated (`https://app.example.com`); empty: none, the browser's
    # same-origin rule stands. Never "*": the API takes credentials.
    cors_origins: str = ""
    # A queued job with no stream entry this long is dispatched again
    # (docs/production.md, "Failover"): the repair time after Redis lost data.
    reconcile_after_s: float = Field(30.0, gt=0)

    # Stream worker.
    worker_concurrency: int = Field(64, ge=1)
    claim_idle_ms: int = Field(30_000, ge=0)
    max_deliveries: int = Field(5, ge=1)
    job_budget_s: float = Field(60.0, gt=0)
    # A handler still running this long past its budget is cancelled and its
    # entry left for redelivery.
    job_grace_s: float = Field(10.0, ge=0)
    # Redelivery after a transient failure: exponential, jittered backoff.
    redelivery_base_s: float = Field(15.0, gt=0)
    redelivery_max_s: float = Field(900.0, gt=0)
    # Transient failures dead-letter a job only once it is this old (counted
    # from its last resume, for a job that waited).
    job_max_age_s: float = Field(86400.0, gt=0)
    # The longest ctx.wait_for_event, and its default timeout (30 days).
    wait_max_s: float = Field(30 * 86400.0, gt=0)
    # Live job streams (docs/streaming.md): open streams per tenant (then
    # 429), a job's events kept in Redis (about) and how long after the last.
    streams_per_tenant: int = Field(100, ge=1)
    stream_maxlen: int = Field(10_000, ge=100)
    stream_ttl_s: float = Field(3600.0, gt=0)
    # A comment line this often on an idle stream (proxies close idle ones).
    stream_heartbeat_s: float = Field(15.0, gt=0, le=300)
    # Open streams one API process serves at once (then 503): each costs a
    # bounded amount of memory, this bounds their sum.
    streams_per_process: int = Field(1000, ge=1)
    # A call's default timeout (`ctx.call`, a call tool): then CallFailed.
    call_timeout_s: float = Field(86400.0, gt=0)
    # The most of a call's answer read and stored: past it the call fails.
    call_answer_max_bytes: int = Field(1_048_576, gt=0)
    # The most items one `ctx.map` takes (docs/fanout.md).
    map_max_items: int = Field(10_000, ge=1)
    # Schedules (docs/fanout.md): the tenant their jobs belong to, and what
    # runs of the ticks missed while every process was down (the latest, once).
    schedule_tenant: str = Field("scheduler", min_length=1, max_length=200)
    schedule_catch_up: Literal["latest", "none"] = "latest"
    block_ms: int = Field(1000, ge=1)
    shutdown_grace_s: float = Field(25.0, ge=0)
    stream_trim_every_s: float = Field(30.0, gt=0)

    # Outbox relay.
    relay_max_attempts: int = Field(10, ge=1)
    # How long a relay's claim on an outbox row lasts unless renewed: a live
    # relay renews its rows every third of it (a send for at most
    # sender_timeout_s), so a dead relay's rows are sent again within about
    # this plus relay_poll_s (oncely.outbox.relay.RelayConfig).
    relay_lease_s: float = Field(3.0, gt=0)
    relay_batch: int = Field(100, ge=1)
    relay_concurrency: int = Field(64, ge=1)
    relay_poll_s: float = Field(1.0, gt=0)
    outbox_retention_s: float = Field(7 * 86400.0, gt=0)
    # Finished jobs, their results and sent outbox rows older than this are deleted.
    job_retention_s: float = Field(30 * 86400.0, gt=0)

    # Processes. With a metrics port, worker and relay serve /metrics,
    # /healthz and /readyz on it.
    metrics_port: int | None = Field(None, ge=1, le=65535)
    # Export traces over OTLP/HTTP (the otel extra; OTEL_EXPORTER_OTLP_* settings).
    otel: bool = False
    log_format: Literal["console", "json"] = "json"
    log_level: str = "INFO"
    # Each process's PostgreSQL pool (docs/production.md, Connection budget):
    # it grows on demand up to the max and closes a connection unused for
    # pg_pool_idle_s, one at a time, down to the min. Unset, the max is
    # per process (``pool_max``).
    pg_pool_min: int = Field(1, ge=1)
    pg_pool_max: int | None = Field(None, ge=1)
    pg_pool_idle_s: float = Field(60.0, gt=0)
    # Bounds on every call to the servers (and on connecting to them).
    redis_timeout_s: float = Field(5.0, gt=0)
    pg_statement_timeout_s: float = Field(10.0, gt=0)
    connect_timeout_s: float = Field(5.0, gt=0)

    def pool_max(self, kind: str) -> int:
        """The most PostgreSQL connections a process of ``kind`` (api,
        worker, relay, cli) holds: ``ONCELY_PG_POOL_MAX`` when set, else 20
        for the API and 10 for the others (docs/production.md, Connection
        budget). A worker holds a connection only while a statement runs and
        ran as fast with 8 as with 20 (bench/pool_budget.py); the API runs
        one statement per request in flight, and waiting for a connection
        cost it a sixth of its requests per second at 32 in flight
        (bench/intake.py)."""
        if self.pg_pool_max is not None:
            return self.pg_pool_max
        return API_POOL_MAX if kind == "api" else POOL_MAX

    @model_validator(mode="after")
    def _pool_fits(self) -> Settings:
        smallest = self.pool_max("worker")
        if self.pg_pool_min > smallest:
            raise ValueError(
                f"ONCELY_PG_POOL_MIN ({self.pg_pool_min}) is above ONCELY_PG_POOL_MAX "
                f"({self.pg_pool_max if self.pg_pool_max is not None else f'unset: {smallest}'})"
            )
        return self

    @field_validator("redis_url", "database_url", "database_listen_url")
    @classmethod
    def _server_url(cls, value: str | None, info: ValidationInfo) -> str | None:
        """A server's URL the driver will take, checked here so that a wrong
        one is one line naming the setting (never its value: a password)."""
        if value is None or value == "":
            return value or None
        redis = info.field_name == "redis_url"
        schemes = ("redis", "rediss", "unix") if redis else ("postgresql", "postgres")
        if "://" not in value:
            if redis:
                raise ValueError(f"a URL is wanted: {' or '.join(s + '://' for s in schemes)}…")
            if "=" not in value:
                raise ValueError("neither a postgresql:// URL nor libpq's key=value settings")
            return value  # libpq's key=value form
        parts = urlsplit(value)
        if parts.scheme not in schemes:
            raise ValueError(f"the scheme must be {' or '.join(schemes)}")
        try:
            parts.port  # noqa: B018 (a port out of range raises)
        except ValueError:
            raise ValueError("the port is not a number from 1 to 65535") from None
        db = parts.path.lstrip("/")
        if redis and parts.scheme != "unix" and db and not db.isdigit():
            raise ValueError("the database after the last / is not a number")
        return value

    @field_validator("shadow")
    @classmethod
    def _shadow_parses(cls, value: str) -> str:
        from oncely.shadow.config import parse_shadow

        parse_shadow(value)
        return value

    @field_validator("cors_origins")
    @classmethod
    def _origins_listed(cls, value: str) -> str:
        for origin in (o.strip() for o in value.split(",") if o.strip()):
            if origin == "*" or "://" not in origin or origin.endswith("/"):
                raise ValueError(f"{origin!r}: list each origin as scheme://host[:port] (never *)")
        return value

    @model_validator(mode="after")
    def _dialect_of_the_model(self) -> Settings:
        """``ONCELY_LLM_MODEL=anthropic:claude-x`` is the model ``claude-x``
        in the ``anthropic`` dialect; a dialect named twice must agree."""
        from oncely.llm.routing import split_dialect

        dialect, name = split_dialect(self.llm_model)
        if dialect is None:
            return self
        provider_set = "llm_provider" in self.model_fields_set
        if provider_set and self.llm_provider != dialect:
            raise ValueError(
                f"ONCELY_LLM_MODEL names the {dialect} dialect, ONCELY_LLM_PROVIDER"
                f" {self.llm_provider}: name one, or the same"
            )
        self.llm_model = name
        self.llm_provider = dialect
        return self

    @field_validator("llm_fallbacks")
    @classmethod
    def _fallbacks_parse(cls, value: str) -> str:
        from oncely.llm.routing import parse_models

        parse_models(value)
        return value

    @field_validator("llm_prices")
    @classmethod
    def _prices_parse(cls, value: str) -> str:
        from oncely.usage.prices import Prices

        Prices.parse(value)
        return value

    @field_validator("console_key")
    @classmethod
    def _console_key_is_long(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < CONSOLE_KEY_MIN:
            raise ValueError(
                f"at least {CONSOLE_KEY_MIN} characters, got "
                f"{len(value.get_secret_value())}; make one with: python3 -c "
                "'import secrets; print(secrets.token_urlsafe(32))'"
            )
        return value

    @field_validator("primary")
    @classmethod
    def _primary_parses(cls, value: str) -> str:
        from oncely.shadow.config import parse_primary

        parse_primary(value)
        return value
