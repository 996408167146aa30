"""A person's decision on a tool call an agent's job waits on
(docs/agents.md), as the API, the console and ``oncely jobs approve`` take
it: stored as the job's event ``approval:<call_id>`` with its fingerprint
(the same decision again is a duplicate, another one a conflict), and the
job queued again if it waits on that call. The caller enqueues
``resumed``: the API with its stored response, the others at once."""

from __future__ import annotations

import uuid
from typing import Any

from oncely.agent import approval_event
from oncely.api.keys import fingerprint
from oncely.jobs.checkpoints import Checkpoints, EventOutcome


async def decide(
    checkpoints: Checkpoints,
    job_id: uuid.UUID,
    call_id: str,
    decision: dict[str, Any],
    *,
    tenant: str | None = None,
    kind: str | None = None,
) -> EventOutcome | None:
    """Store ``decision`` (``{"approved", "arguments"?, "reason"?}``) for the
    job's pending tool call ``call_id``. ``tenant`` and ``kind``: the job
    must be theirs (the API); None: any job (operators). None: no such job."""
    if tenant is None or kind is None:
        job = await checkpoints.jobs.detail(kind, job_id)
        if job is None:
            return None
        tenant, kind = job.tenant, job.kind
    return await checkpoints.receive_event(
        kind,
        job_id,
        tenant,
        approval_event(call_id),
        decision,
        fingerprint(decision),
        awaited=True,
    )
