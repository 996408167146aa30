"""A person's decision on a call a job waits on, as the API, the console
and the CLI take it: an approval of an agent's tool call (docs/agents.md,
``oncely jobs approve``), or the word on an at-most-once call whose outcome
is unknown (docs/at-most-once.md, ``oncely jobs resolve``). Stored as the
job's event (``approval:<call_id>``, ``uncertain:<call_id>``) with its
fingerprint (the same decision again is a duplicate, another one a
conflict), and the job queued again if it waits on that call. The caller
enqueues ``resumed``: the API with its stored response, the others at once."""

from __future__ import annotations

import uuid
from typing import Any, Literal

from oncely import metrics
from oncely.decisions import approval_event, uncertain_event
from oncely.identity import fingerprint
from oncely.jobs.checkpoints import Checkpoints, EventOutcome


async def decide(
    checkpoints: Checkpoints,
    job_id: uuid.UUID,
    call_id: str,
    decision: dict[str, Any],
    *,
    by: str,
    tenant: str | None = None,
    kind: str | None = None,
    on: Literal["approval", "uncertain"] = "approval",
) -> EventOutcome | None:
    """Store ``decision`` for the job's pending call ``call_id``: an
    approval (``{"approved", "arguments"?, "reason"?}``), or with ``on=
    "uncertain"`` an ``UncertainDecision``'s JSON; with who decided (``by``: ``key:<id>``
    for an API key, ``console``, ``cli:<user>``). The same decision by
    someone else is a duplicate, not a conflict: the first one's author
    stays. ``tenant`` and ``kind``: the job must be theirs (the API); None:
    any job (operators). None: no such job."""
    if tenant is None or kind is None:
        job = await checkpoints.jobs.detail(kind, job_id)
        if job is None:
            return None
        tenant, kind = job.tenant, job.kind
    outcome = await checkpoints.receive_event(
        kind,
        job_id,
        tenant,
        approval_event(call_id) if on == "approval" else uncertain_event(call_id),
        {**decision, "by": by},
        fingerprint(decision),
        awaited=True,
    )
    if on == "uncertain" and outcome is not None and outcome.outcome == "received":
        chose = next(c for c in ("resend", "failed", "result") if c in decision)
        metrics.UNCERTAIN_RESOLVED.labels(workflow=kind, how=chose).inc()
    return outcome
