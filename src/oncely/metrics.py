"""Every Prometheus metric oncely exports, defined once.

Job, delivery and model metrics carry a ``workflow`` label: one deployment
runs several workflows, and each has its own backlog and failure modes.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter(
    "oncely_requests_total", "API requests by route and status class", ["route", "outcome"]
)
IDEMPOTENCY_REPLAYS = Counter(
    "oncely_idempotency_replays_total", "Responses replayed from the store", ["route"]
)
IDEMPOTENCY_LOCKS_LOST = Counter(
    "oncely_idempotency_locks_lost_total", "Requests that outlived their idempotency lock"
)
JOBS_ACCEPTED = Counter("oncely_jobs_accepted_total", "Jobs accepted by the API", ["workflow"])
JOBS = Counter("oncely_jobs_total", "Job deliveries by outcome", ["workflow", "outcome"])
DELIVERIES = Counter(
    "oncely_deliveries_total", "Stream messages handed to handlers", ["workflow", "kind"]
)
DEAD_LETTERS = Counter(
    "oncely_dead_letters_total", "Messages dead-lettered", ["workflow", "reason"]
)
LEASES_LOST = Counter(
    "oncely_leases_lost_total", "In-flight messages taken by another worker", ["workflow"]
)
HANDLERS_IN_FLIGHT = Gauge(
    "oncely_handlers_in_flight", "Handlers running in this worker", ["workflow"]
)
MODEL_CALLS = Counter(
    "oncely_model_calls_total",
    "Model calls by workflow, model and outcome class",
    ["workflow", "model", "outcome"],
)
MODEL_RETRIES = Counter(
    "oncely_model_retries_total", "In-process model retries", ["workflow", "reason"]
)
MODEL_TOKENS = Counter(
    "oncely_model_tokens_total",
    "Tokens the provider reported, by workflow, model and kind (prompt, completion)",
    ["workflow", "model", "kind"],
)
MODEL_INVALID_OUTPUTS = Counter(
    "oncely_model_invalid_outputs_total",
    "Answers that did not validate against the workflow's result model",
    ["workflow", "model"],
)
MODEL_COST = Counter(
    "oncely_model_cost_usd_total",
    "What model calls cost in USD (ONCELY_LLM_PRICES; calls of unpriced models count nothing)",
    ["workflow", "model"],
)
MODEL_COOLDOWN = Gauge(
    "oncely_model_cooldown",
    "1 while this process skips the model: the fleet's cooldown after repeated failures",
    ["model"],
)
# Alert on any increase: the provider's account has no credit left, or hit
# its spend limit, and every call to that model fails until someone pays
# (docs/providers.md, Dry accounts).
MODEL_PROVIDER_QUOTA = Counter(
    "oncely_model_provider_quota_total",
    "Model calls refused because the provider account's credit or spend limit is exhausted",
    ["model"],
)
MODEL_FLEX_FALLBACKS = Counter(
    "oncely_model_flex_fallbacks_total",
    "Flex-lane calls sent on at the standard tier once their flex retries met no capacity",
    ["workflow", "model"],
)
BATCHES = Counter(
    "oncely_batches_total",
    "Batch-lane batches: created, adopted after a crash, and how they ended",
    ["event"],
)
BATCH_LINES = Counter(
    "oncely_batch_lines_total",
    "Batch-lane lines: intended (stored before their batch), answered, failed",
    ["outcome"],
)
CHECKPOINTS_WRITTEN = Counter(
    "oncely_checkpoints_written_total",
    "Checkpoints of multi-step runs written (steps, model calls, waits, sleeps)",
    ["workflow"],
)
CHECKPOINT_REPLAYS = Counter(
    "oncely_checkpoint_replays_total",
    "Checkpoints a run found stored and did not run again",
    ["workflow", "kind"],
)
NONDETERMINISTIC = Counter(
    "oncely_jobs_nondeterministic_total",
    "Runs that asked for another checkpoint than the one stored (the job is dead)",
    ["workflow"],
)
REPLAY_DIVERGENCE = Counter(
    "oncely_replay_divergence_total",
    "Replays that asked a stored call or model turn with another request than the stored one's",
    ["workflow", "kind"],
)
LIMITER_FAIL_OPEN = Counter(
    "oncely_limiter_fail_open_total",
    "Model calls paced by this process alone because the fleet limiter's Redis did not answer",
)
UNCERTAIN_CALLS = Counter(
    "oncely_uncertain_calls_total",
    "At-most-once calls whose outcome was unknown and that a person was asked about",
    ["workflow"],
)
UNCERTAIN_RESOLVED = Counter(
    "oncely_uncertain_resolved_total",
    "At-most-once calls of unknown outcome, by how they were decided (reconcile, resend,"
    " result, failed)",
    ["workflow", "how"],
)
OUTBOX_SENDS = Counter("oncely_outbox_sends_total", "Relay sends by outcome", ["outcome"])
CALLS = Counter(
    "oncely_calls_total",
    "Calls that answer, by how they ended (answered, refused, invalid_answer, attempts,"
    " undeliverable, timeout)",
    ["workflow", "topic", "outcome"],
)
TOOL_CALLS = Counter(
    "oncely_tool_calls_total",
    "Agents' tool calls by result status (ok, error, rejected)",
    ["workflow", "tool", "status"],
)
OUTBOX_LAG = Histogram(
    "oncely_outbox_lag_seconds",
    "Outbox row creation to successful send",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

JOB_SECONDS = Histogram(
    "oncely_job_seconds",
    "One delivery of a job, from handler start to its outcome",
    ["workflow"],
    buckets=_LATENCY_BUCKETS,
)
MODEL_CALL_SECONDS = Histogram(
    "oncely_model_call_seconds",
    "One model call attempt, by workflow and model",
    ["workflow", "model"],
    buckets=_LATENCY_BUCKETS,
)

# Backlog, read from Redis and PostgreSQL when /metrics is scraped.
STREAM_LENGTH = Gauge("oncely_stream_length", "Entries in the workflow's stream", ["workflow"])
STREAM_PENDING = Gauge(
    "oncely_stream_pending", "Entries delivered and not yet acknowledged", ["workflow"]
)
STREAM_OLDEST_PENDING_AGE = Gauge(
    "oncely_stream_oldest_pending_age_seconds",
    "Age of the oldest unacknowledged entry (0 when none)",
    ["workflow"],
)
DELAYED_JOBS = Gauge("oncely_delayed_jobs", "Jobs waiting out a redelivery backoff", ["workflow"])
JOBS_WAITING = Gauge("oncely_jobs_waiting", "Jobs waiting for an event or a time", ["workflow"])
DEAD_LETTER_BACKLOG = Gauge(
    "oncely_dead_letter_entries", "Entries in the dead-letter stream", ["workflow"]
)
OUTBOX_UNSENT = Gauge("oncely_outbox_unsent", "Outbox rows not yet sent (not failed)")
OUTBOX_FAILED = Gauge("oncely_outbox_failed", "Outbox rows that gave up")
OUTBOX_OLDEST_UNSENT_AGE = Gauge(
    "oncely_outbox_oldest_unsent_age_seconds", "Age of the oldest unsent outbox row (0 when none)"
)
DB_CONNECT_ERRORS = Counter(
    "oncely_db_connect_errors_total",
    "PostgreSQL connection attempts that failed, by reason (too_many_clients, auth,"
    " unreachable, other)",
    ["reason"],
)
CLOCK_OFFSET = Gauge(
    "oncely_clock_offset_seconds",
    "This process's clock minus PostgreSQL's, as last measured (docs/production.md, Clocks)",
)
