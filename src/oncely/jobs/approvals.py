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

from jsonschema.exceptions import SchemaError
from pydantic import ValidationError

from oncely import metrics
from oncely.decisions import approval_event, uncertain_event
from oncely.identity import fingerprint
from oncely.jobs.checkpoints import Checkpoints, EventOutcome
from oncely.tools import schema_validator
from oncely.workflow import Workflow


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


class ArgumentsRefused(ValueError):
    """A person's edited arguments fail the pending tool's schema:
    ``errors`` says where (``edited_arguments_errors``)."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__("the edited arguments fail the tool's schema")
        self.errors = errors


async def edited_arguments_errors(
    workflow: Workflow[Any, Any],
    checkpoints: Checkpoints,
    job_id: uuid.UUID,
    tenant: str,
    call_id: str,
    arguments: dict[str, Any],
) -> list[dict[str, Any]]:
    """Where a person's edited ``arguments`` fail the schema of the tool
    the job waits on a decision for (``call_id``), as FastAPI lists errors,
    each ``loc`` from ``arguments``; none when they pass or the job waits on
    no such approval (the decision then finds no pending call). The API and
    the CLI both check with it before deciding."""
    waiting_for, detail = await checkpoints.waiting_detail(workflow.name, job_id, tenant)
    if waiting_for != approval_event(call_id) or not detail:
        return []
    pending = detail.get("approval") or {}
    tool = workflow.approval_tool(str(pending.get("tool")))
    if tool is not None:
        try:
            tool.edited(arguments)
        except ValidationError as exc:
            return [
                {"loc": ["arguments", *e["loc"]], "msg": e["msg"], "type": e["type"]}
                for e in exc.errors(include_url=False, include_input=False)
            ]
        return []
    # A framework's tool: the JSON schema its run kept with the wait.
    schema = pending.get("schema")
    return schema_errors(schema, arguments) if isinstance(schema, dict) else []


def schema_errors(schema: dict[str, Any], arguments: dict[str, Any]) -> list[dict[str, Any]]:
    """Where ``arguments`` fail a tool's JSON ``schema`` (a schema that is
    itself broken checks nothing)."""
    try:
        validator = schema_validator(schema)
    except SchemaError:
        return []
    found = sorted(validator.iter_errors(arguments), key=lambda e: list(e.absolute_path))
    return [
        {
            "loc": ["arguments", *e.absolute_path],
            "msg": e.message[:300],
            "type": f"json_schema.{e.validator}",
        }
        for e in found[:20]
    ]
