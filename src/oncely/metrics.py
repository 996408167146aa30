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
OUTBOX_SENDS = Counter("oncely_outbox_sends_total", "Relay sends by outcome", ["outcome"])
OUTBOX_LAG = Histogram(
    "oncely_outbox_lag_seconds",
    "Outbox row creation to successful send",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
