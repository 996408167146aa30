"""Every Redis key, stream and group name oncely uses, in one place.

The braces are Redis Cluster hash tags: everything about the summaries
stream lives in one slot, so MULTI/EXEC and Lua across these keys work on a
cluster too.
"""

from __future__ import annotations

IDEMPOTENCY_PREFIX = "oncely:idem:"

SUMMARIES_STREAM = "oncely:{summaries}:stream"
SUMMARIES_DEAD = "oncely:{summaries}:dead"
# job_id -> stream entry id of every message not yet acknowledged; the
# reconciler uses it to tell "still in the stream" from "lost".
SUMMARIES_INDEX = "oncely:{summaries}:index"
SUMMARIES_GROUP = "summarisers"
# Held (with a TTL) by the one process running a reconcile pass.
RECONCILE_LOCK = "oncely:{summaries}:reconcile-lock"

# The fleet-wide model limiter: a pause after a 429, and GCRA state per limit.
LLM_PAUSE = "oncely:limiter:llm:pause"
LLM_RPM = "oncely:limiter:llm:rpm"
LLM_TPM = "oncely:limiter:llm:tpm"


def idempotency_key(scope_digest: str) -> str:
    return IDEMPOTENCY_PREFIX + scope_digest
