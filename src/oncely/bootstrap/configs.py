"""Settings into the config dataclasses the library components take:
the only place (with the CLI) that reads ``Settings``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from oncely.app import App, load_app
from oncely.jobs.kit import StepConfig
from oncely.llm.cooldown import CooldownPolicy
from oncely.llm.limiter import Limits
from oncely.queue.worker import WorkerConfig
from oncely.retry import RetryPolicy
from oncely.settings import Settings
from oncely.shadow.config import ShadowSpec, check_workflows, parse_primary, parse_shadow

if TYPE_CHECKING:
    from oncely.api.app import ApiConfig
    from oncely.outbox.relay import RelayConfig
    from oncely.senders import SendersConfig


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
        budget_reserve_tokens=s.budget_reserve_tokens,
        budget_hold_s=s.budget_hold_s,
        max_headers=s.http_max_headers,
        max_header_bytes=s.http_max_header_bytes,
        body_timeout_s=s.http_body_timeout_s,
        streams_per_tenant=s.streams_per_tenant,
        stream_maxlen=s.stream_maxlen,
        stream_ttl_s=s.stream_ttl_s,
        stream_heartbeat_s=s.stream_heartbeat_s,
        streams_per_process=s.streams_per_process,
        cors_origins=tuple(o.strip() for o in s.cors_origins.split(",") if o.strip()),
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
        call_timeout_s=s.call_timeout_s,
        map_max_items=s.map_max_items,
    )


def limits(s: Settings) -> Limits:
    return Limits(rpm=s.llm_rpm, tpm=s.llm_tpm, pause_max_s=s.llm_retry_after_max_s)


def cooldown_policy(s: Settings) -> CooldownPolicy:
    return CooldownPolicy(
        failures=s.llm_cooldown_failures,
        window_s=s.llm_cooldown_window_s,
        cooldown_s=s.llm_cooldown_s,
        probe_every_s=s.llm_cooldown_probe_s,
        share=s.llm_cooldown_share,
        tenants=s.llm_cooldown_tenants,
        # A probe is one call: out for at most one attempt's time.
        probe_s=s.llm_timeout_s + 5,
    )


def relay_config(s: Settings) -> RelayConfig:
    from oncely.outbox.relay import RelayConfig  # with the senders' HTTP clients

    return RelayConfig(
        max_attempts=s.relay_max_attempts,
        lease_s=s.relay_lease_s,
        send_timeout_s=s.sender_timeout_s,
        batch=s.relay_batch,
        concurrency=s.relay_concurrency,
        poll_s=s.relay_poll_s,
        retention_s=s.outbox_retention_s,
    )


def listen_url(s: Settings) -> str | None:
    """Where the relay LISTENs for new outbox rows; None: it only polls,
    every ``ONCELY_RELAY_POLL_S``. A transaction pooler hands the LISTEN's
    server connection to other clients once its transaction ends, so a
    notification would never arrive: behind one, only a direct URL
    (``ONCELY_DATABASE_LISTEN_URL``) can listen."""
    if s.database_listen_url:
        return s.database_listen_url
    if s.database_pooler == "transaction":
        return None
    return s.database_url


def senders_config(s: Settings) -> SendersConfig:
    from oncely.senders import SendersConfig  # with the senders' HTTP clients

    return SendersConfig(
        email=s.sender,
        email_url=s.sender_url,
        timeout_s=s.sender_timeout_s,
        call_answer_max_bytes=s.call_answer_max_bytes,
        webhook_secret=s.webhook_secret.get_secret_value(),
        smtp_from=s.smtp_from,
        webhook_urls=dict(s.workflow_webhook_urls),
        default_webhook_url=s.webhook_url,
    )


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


def app_from(s: Settings, only: list[str] | None = None) -> App:
    """The settings' app, narrowed to the workflows named in ``only``."""
    return load_app(s.app).only(only or [])


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
