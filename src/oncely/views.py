"""What ``GET <route>/{job_id}`` answers: a job as its tenant sees it
(docs/http-api.md). Subclass ``JobView`` to add fields of your own."""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Generic, Literal, Self, TypeVar, cast

from pydantic import BaseModel, ConfigDict

from oncely.journal import Kind
from oncely.statuses import JobStatus
from oncely.usage.totals import summed

if TYPE_CHECKING:
    from oncely.jobs.records import JobRecord

ResultT = TypeVar("ResultT", bound=BaseModel)


class UsageView(BaseModel):
    """Tokens, model calls and cost: of one model checkpoint, or of every
    model checkpoint of a job."""

    prompt_tokens: int
    completion_tokens: int
    model_calls: int
    # Of the prompt tokens, those served from the provider's cache; of the
    # completion tokens, those spent reasoning (when the provider says).
    cached_tokens: int | None = None
    reasoning_tokens: int | None = None
    # USD (ONCELY_LLM_PRICES); None when a call's model has no price.
    cost_usd: float | None = None
    # The model that answered (a job's: its last model checkpoint's).
    model: str | None = None
    # A job that mapped over child jobs: what its children spent, summed.
    children: UsageView | None = None


class DecisionView(BaseModel):
    """A person's decision on a tool call: approved or not, who decided
    (``key:<id>`` for an API key, ``console``, ``cli:<user>``), and why."""

    approved: bool
    by: str | None = None
    reason: str | None = None


class ResolutionView(BaseModel):
    """A person's word on an at-most-once call of unknown outcome: what they
    chose, who (as ``DecisionView.by``), and the reason of a ``failed``."""

    chose: Literal["resend", "result", "failed"]
    by: str | None = None
    reason: str | None = None


class StepView(BaseModel):
    """One checkpoint of a job, as its tenant sees it (never its value)."""

    key: str
    kind: Kind
    # failed: the work failed and the step went on past it (a replay raises it again).
    status: Literal["done", "waiting", "failed"]
    finished_at: datetime | None = None
    # Model checkpoints: what the call spent (its retries, re-asks and
    # fallbacks included), and the model that answered (a fallback, when one did).
    usage: UsageView | None = None
    model: str | None = None
    # An agent's tool, approval and call-tool checkpoints: the tool's name.
    tool: str | None = None
    # A model turn a replay asked with another request than the stored
    # one's, and was given the stored answer (docs/durable-steps.md).
    diverged: bool = False
    # An approval a person (or the timeout) decided.
    decision: DecisionView | None = None
    # An uncertain call a person decided (docs/at-most-once.md).
    resolution: ResolutionView | None = None


class ApprovalView(BaseModel):
    """A tool call waiting for a person's decision."""

    call_id: str
    tool: str
    arguments: dict[str, Any]


class UncertainView(BaseModel):
    """An at-most-once call whose outcome is unknown (its worker died
    mid-call), waiting for a person's word since ``since``
    (docs/at-most-once.md)."""

    call_id: str
    tool: str
    arguments: dict[str, Any]
    since: datetime


class ChildrenView(BaseModel):
    """A map's children (``ctx.map``) as their parent waits on them:
    ``running`` counts those queued or running, ``queued`` those held back
    by the map's concurrency."""

    workflow: str
    total: int
    done: int = 0
    dead: int = 0
    cancelled: int = 0
    running: int = 0
    queued: int = 0


class WaitingView(BaseModel):
    """What a waiting job waits for until ``until``: the ``event`` (a sleep:
    none of these), a ``call``'s answer (its topic), an ``approval``, a
    person's word on an ``uncertain`` call, or a map's ``children`` (no
    ``until``: until they have all ended)."""

    event: str | None = None
    call: str | None = None
    approval: ApprovalView | None = None
    uncertain: UncertainView | None = None
    children: ChildrenView | None = None
    until: datetime | None = None


# Why a job is dead, as its tenant sees it (docs/http-api.md). The job row
# keeps the detail (the reason, then the last error, which may quote the
# provider's answer) for operators: the console and ``oncely dlq list``.
DEAD_REASONS = {
    "permanent": "the step failed in a way retrying cannot fix",
    "max_age": "the step kept failing until the job was too old to retry",
    "max_deliveries": "deliveries of the job kept stopping before they finished",
    "malformed": "the queued message could not be read",
    "nondeterministic": "the step no longer reaches the checkpoints its stored run reached",
    "agent-limit": "an agent reached one of its run limits (turns, tokens or cost)",
}
# Which limit an agent reached: GET's error says it (``agent-limit: max_turns``).
_AGENT_LIMIT = re.compile(r"\b(max_turns|max_tokens|max_cost_usd|usage_limits|recursion_limit)\b")


DeadReason = Literal[
    "permanent",
    "max_age",
    "max_deliveries",
    "malformed",
    "nondeterministic",
    "agent-limit",
    "agent-limit: max_turns",
    "agent-limit: max_tokens",
    "agent-limit: max_cost_usd",
    "agent-limit: usage_limits",
    "agent-limit: recursion_limit",
    "failed",
]


def tenant_error(error: str | None) -> DeadReason | None:
    """The stable reason of a job row's ``error`` (``failed`` if unknown)."""
    if error is None:
        return None
    reason, _, detail = error.partition(":")
    reason = reason.strip()
    if reason == "agent-limit" and (limit := _AGENT_LIMIT.search(detail)) is not None:
        return cast(DeadReason, f"agent-limit: {limit[1]}")
    return cast(DeadReason, reason) if reason in DEAD_REASONS else "failed"


class JobView(BaseModel, Generic[ResultT]):
    """What ``GET <route>/{job_id}`` answers. Subclass it (and pass ``view=``)
    to add fields of your own; override ``from_record`` to fill them."""

    model_config = ConfigDict(frozen=True)

    job_id: uuid.UUID
    # queued: in line; running: a worker holds it (docs/streaming.md).
    status: JobStatus
    result: ResultT | None = None
    # Set once the job is dead: one of DEAD_REASONS, or "failed".
    error: DeadReason | None = None
    # Every model checkpoint of the job, summed.
    usage: UsageView | None = None
    # While the job waits: for what, until when.
    waiting: WaitingView | None = None
    # A map's child: the job that mapped it (docs/fanout.md).
    parent: uuid.UUID | None = None
    # Its checkpoints, in the order its run reached them.
    steps: list[StepView] = []
    created_at: datetime
    updated_at: datetime

    @classmethod
    def from_record(cls, record: JobRecord) -> Self:
        waiting = None
        if record.status == "waiting" and record.wait_until is not None:
            waiting = waiting_of(record)
        return cls.model_validate(
            {
                "job_id": record.job_id,
                # A child held back by its map's concurrency is in line.
                "status": "queued" if record.status == "held" else record.status,
                "result": record.result,
                "error": tenant_error(record.error),
                "usage": record.usage or _summed(record.steps),
                "waiting": waiting,
                "steps": _steps(record.steps),
                "parent": record.parent_id,
                "created_at": record.created_at,
                "updated_at": record.updated_at,
            }
        )


def _summed(steps: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The usage of every model checkpoint (a job not done yet); None if none."""
    usages = [s["usage"] for s in steps if s.get("usage")]
    return summed(usages) if usages else None


def waiting_of(record: JobRecord) -> dict[str, Any]:
    """What a waiting job waits on, until when (a map: until its children
    have ended, with what they count now)."""
    detail = record.waiting_detail
    if detail is not None and "children" in detail:
        return {"children": {**detail["children"], **(record.children or {})}}
    if detail is not None:
        return {**detail, "until": record.wait_until}
    return {"event": record.waiting_for, "until": record.wait_until}


def pending_approval(record: JobRecord) -> dict[str, Any] | None:
    """The tool call a waiting job waits on a decision for, if it does."""
    return _pending(record, "approval")


def pending_uncertain(record: JobRecord) -> dict[str, Any] | None:
    """The at-most-once call of unknown outcome a waiting job waits on a
    person's word for, if it does."""
    return _pending(record, "uncertain")


def _pending(record: JobRecord, kind: str) -> dict[str, Any] | None:
    if record.status != "waiting" or not record.waiting_detail:
        return None
    pending = record.waiting_detail.get(kind)
    return dict(pending) if isinstance(pending, dict) else None


def waited_on(record: JobRecord) -> str:
    """What a waiting job waits on, in words (the console and the CLI)."""
    detail = record.waiting_detail or {}
    if "call" in detail:
        return f"the answer to call {detail['call']!r}"
    if "children" in detail:
        children = detail["children"]
        return f"{children.get('total')} child jobs of {children.get('workflow')!r}"
    if "approval" in detail:
        approval = detail["approval"]
        return f"a decision on {approval.get('tool')!r} (call {approval.get('call_id')!r})"
    if "uncertain" in detail:
        uncertain = detail["uncertain"]
        return (
            f"a person's word on {uncertain.get('tool')!r}, whose outcome is unknown"
            f" (call {uncertain.get('call_id')!r})"
        )
    if record.waiting_for:
        return f"event {record.waiting_for!r}"
    return "its sleep to end"


def _steps(steps: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each checkpoint with the model that answered it, from its usage, and
    an agent's tool from its key."""
    return [
        {**s, "model": (s.get("usage") or {}).get("model"), "tool": tool_of(s["key"], s["kind"])}
        for s in steps
    ]


def tool_of(key: str, kind: str) -> str | None:
    """The tool an agent's checkpoint belongs to: a tool call's checkpoints
    are ``<agent>/<tool>/tool|call|approval`` (``support/refund#2/call`` →
    ``refund``); None for any other checkpoint."""
    parts = key.split("/")
    if kind not in ("tool", "call", "approval") or len(parts) < 2 or parts[-1] != kind:
        return None
    return parts[-2].partition("#")[0]
