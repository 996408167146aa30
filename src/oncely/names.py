"""Every Redis key, stream and group name oncely uses, in one place.

Each workflow has its own keys, all carrying the workflow's name as a Redis
Cluster hash tag (``oncely:{<name>}:…``): a workflow's stream, dead letters
and index live in one slot, so MULTI/EXEC and Lua across them work on a
cluster too.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

IDEMPOTENCY_PREFIX = "oncely:idem:"
# Bumped whenever an API key is revoked or erased: API processes that see it
# change empty their key caches (oncely.api.auth.Revocations).
API_KEYS_GENERATION = "oncely:api-keys:generation"
# The tenant budgets the API enforces, as it last started with them (JSON),
# for the operator commands run without its environment.
BUDGET_LIMITS = "oncely:budget-limits"
# Each long-running process's clock against PostgreSQL's, as it last measured
# it: process name -> JSON (oncely.clock.ClockWatch), for `oncely status`.
CLOCK_OFFSETS = "oncely:clock-offsets"

# The fleet-wide model limiter: a pause after a 429, and GCRA state per limit.
# One hash tag: its Lua script reads all three, which a cluster allows only
# within one slot.
LLM_PAUSE = "oncely:{limiter}:llm:pause"
LLM_RPM = "oncely:{limiter}:llm:rpm"
LLM_TPM = "oncely:{limiter}:llm:tpm"
# A share of those limits (ONCELY_SHADOW_RPM_SHARE): shadow calls count
# against the fleet's limits and against these, so they take at most their
# share. Same hash tag, so one script still reads every key.
LLM_SHARE_RPM = "oncely:{limiter}:llm:share:rpm"
LLM_SHARE_TPM = "oncely:{limiter}:llm:share:tpm"


@dataclass(frozen=True)
class WorkflowKeys:
    """The Redis keys of one workflow."""

    workflow: str
    stream: str
    dead: str
    # job_id -> stream entry id of every message not yet acknowledged; the
    # reconciler uses it to tell "still in the stream" from "lost".
    index: str
    group: str
    # Held (with a TTL) by the one process running a reconcile pass.
    reconcile_lock: str
    # Jobs waiting out a redelivery backoff: job_id -> due time (a sorted set),
    # and job_id -> the message to put back then (a hash).
    delayed: str
    delayed_messages: str
    # Jobs cancelled lately: job_id -> when (a sorted set, trimmed to a day),
    # so that workers running them stop at their next lease renewal.
    cancelled: str
    # The models delayed jobs wait for (m:<model>), and when a job may next
    # be let out to probe each (p:<scope>:<model>): a hash
    # (docs/model-routing.md, "The cooldown").
    cooling: str

    def waiting_on(self, model: str) -> str:
        """The delayed jobs waiting for ``model``'s cooldown: "<scope> <job_id>"
        -> the due time they were delayed to (a sorted set)."""
        return f"{self.cooling}:{model}"


def workflow_keys(workflow: str, group: str) -> WorkflowKeys:
    tag = f"oncely:{{{workflow}}}"
    return WorkflowKeys(
        workflow=workflow,
        stream=f"{tag}:stream",
        dead=f"{tag}:dead",
        index=f"{tag}:index",
        group=group,
        reconcile_lock=f"{tag}:reconcile-lock",
        delayed=f"{tag}:delayed",
        delayed_messages=f"{tag}:delayed-messages",
        cancelled=f"{tag}:cancelled",
        cooling=f"{tag}:cooling",
    )


def shadow_keys(workflow: str, variant: str) -> WorkflowKeys:
    """The keys of one shadow variant's work for a workflow (docs/shadow.md):
    a stream, group, dead letters, index and delayed set of its own, so
    shadow runs never touch the workflow's stream, yet under the workflow's
    hash tag, in its slot."""
    tag = f"oncely:{{{workflow}}}:shadow:{variant}"
    return WorkflowKeys(
        workflow=workflow,
        stream=f"{tag}:stream",
        dead=f"{tag}:dead",
        index=f"{tag}:index",
        group="shadow-workers",
        reconcile_lock=f"{tag}:reconcile-lock",
        delayed=f"{tag}:delayed",
        delayed_messages=f"{tag}:delayed-messages",
        cancelled=f"{tag}:cancelled",
        cooling=f"{tag}:cooling",
    )


@functools.lru_cache(maxsize=4096)
def tenant_digest(tenant: str) -> str:
    """How Redis names a tenant, never by its name: enough of its SHA-256
    to find its keys (cached: every request of a tenant hashes the same name)."""
    return hashlib.sha256(tenant.encode()).hexdigest()[:16] if tenant else ""


def tenant_rate_key(tenant_digest: str) -> str:
    """GCRA state of one tenant's intake limit (ONCELY_TENANT_RPM); expires."""
    return f"oncely:tenant-rate:{tenant_digest}"


def idempotency_key(scope_digest: str) -> str:
    return IDEMPOTENCY_PREFIX + scope_digest


def console_session(session_digest: str) -> str:
    """A console session (by the SHA-256 of its id); expires with the session."""
    return f"oncely:console:session:{session_digest}"


def console_login_failures(client_digest: str) -> str:
    """Failed console sign-ins of one client address in the current window; expires."""
    return f"oncely:console:login-failures:{client_digest}"


def model_cooldown(model: str) -> list[str]:
    """A model's cooldown, shared by the fleet (oncely.llm.cooldown): its
    scopes' cooldowns, the window's failing jobs, the window's counts per
    tenant. Hash-tagged by the model, so its scripts run on a cluster too.
    Each expires."""
    base = f"oncely:{{cooldown:{model}}}"
    return [f"{base}:scopes", f"{base}:jobs", f"{base}:counts"]


def job_events(workflow: str, job_id: str) -> str:
    """One job's live events (oncely.live.events), under its workflow's hash
    tag. Bounded, and expires after its last event."""
    return f"oncely:{{{workflow}}}:events:{job_id}"


def open_streams(tenant_digest: str) -> str:
    """The live streams one tenant has open, each scored by when it lapses
    unless renewed (ONCELY_STREAMS_PER_TENANT). Expires."""
    return f"oncely:streams:{tenant_digest}"


# The key stream tokens are signed with, made once by the first API process.
STREAM_TOKEN_KEY = "oncely:stream-token-key"


@dataclass(frozen=True)
class BudgetKeys:
    """One tenant's budget keys for one UTC day (``YYYY-MM-DD``), in one slot
    (oncely.usage.budgets); all expire. ``spend``: tokens and USD spent, and
    the tokens ``reserved`` for accepted jobs; ``holds``: each job's
    reservation's expiry (a sorted set); ``estimates``: its tokens."""

    spend: str
    holds: str
    estimates: str


def tenant_budget(tenant_digest: str, day: str) -> BudgetKeys:
    tag = f"oncely:{{budget:{tenant_digest}:{day}}}"
    return BudgetKeys(f"{tag}:spend", f"{tag}:holds", f"{tag}:estimates")
