"""What the API answers about jobs, typed: ``Accepted`` for a ``POST``,
``Job`` for a ``GET <route>/{job_id}``, ``EventReceived`` for an event,
``Cancelled`` for a cancel (docs/http-api.md)."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict

from oncely.statuses import FINISHED, JobStatus

R = TypeVar("R")
M = TypeVar("M", bound=BaseModel)


class Accepted(BaseModel):
    """A ``POST`` the server accepted (or, ``replayed``, had accepted before:
    the stored original answer, the same job)."""

    model_config = ConfigDict(frozen=True)

    job_id: uuid.UUID
    status: str
    location: str
    replayed: bool


class JobUsage(BaseModel):
    """Tokens, model calls and cost: of one model checkpoint, or of the whole
    job. ``cost_usd`` is None when a call's model has no price on the server;
    ``model``: the model that answered (the job's last model checkpoint)."""

    model_config = ConfigDict(frozen=True)

    prompt_tokens: int
    completion_tokens: int
    model_calls: int
    cost_usd: float | None = None
    model: str | None = None
    # Reported by some providers only.
    cached_tokens: int | None = None
    reasoning_tokens: int | None = None
    # A job that mapped over child jobs: what they spent, summed.
    children: JobUsage | None = None


class Decision(BaseModel):
    """A person's decision on a tool call (``by``: ``key:<id>``,
    ``console`` or ``cli:<user>``)."""

    model_config = ConfigDict(frozen=True)

    approved: bool
    by: str | None = None
    reason: str | None = None


class JobStep(BaseModel):
    """One checkpoint of a job (never its value)."""

    model_config = ConfigDict(frozen=True)

    key: str
    kind: Literal["step", "model", "wait", "sleep", "tool", "call", "approval", "patch", "map"]
    status: Literal["done", "waiting", "failed"]
    finished_at: datetime | None = None
    usage: JobUsage | None = None
    # A model checkpoint's: the model that answered (a fallback, when one did).
    model: str | None = None
    # An agent's tool, approval and call-tool checkpoints: the tool.
    tool: str | None = None
    # A model turn a replay asked differently, and answered as stored.
    diverged: bool = False
    # An approval's decision: approved or not, who decided, and why.
    decision: Decision | None = None


class PendingApproval(BaseModel):
    """A tool call waiting for a person's decision."""

    model_config = ConfigDict(frozen=True)

    call_id: str
    tool: str
    arguments: dict[str, object]


class WaitingChildren(BaseModel):
    """A map's child jobs as their parent waits on them: ``running`` counts
    those queued or running, ``queued`` those held back by its concurrency."""

    model_config = ConfigDict(frozen=True)

    workflow: str
    total: int
    done: int = 0
    dead: int = 0
    cancelled: int = 0
    running: int = 0
    queued: int = 0


class Waiting(BaseModel):
    """What a waiting job waits for until ``until``: the ``event`` (a sleep:
    none of these), a ``call``'s answer (its topic), an ``approval``, or a
    map's ``children`` (then no ``until``)."""

    model_config = ConfigDict(frozen=True)

    event: str | None = None
    call: str | None = None
    approval: PendingApproval | None = None
    children: WaitingChildren | None = None
    until: datetime | None = None


class StreamEvent(BaseModel):
    """One event of a job's live stream (docs/streaming.md): its ``id``
    (None for a ``snapshot``), ``type`` and ``data``."""

    model_config = ConfigDict(frozen=True)

    id: str | None
    type: str
    data: object


class EventReceived(BaseModel):
    """An event the server stored for a job (``replayed``: the stored answer
    to an earlier try with the same key)."""

    model_config = ConfigDict(frozen=True)

    job_id: uuid.UUID
    event: str
    status: str
    replayed: bool = False


class Cancelled(BaseModel):
    """A job cancelled (or cancelled before)."""

    model_config = ConfigDict(frozen=True)

    job_id: uuid.UUID
    status: Literal["cancelled"]


class Job(BaseModel, Generic[R]):
    """A job as ``GET <route>/{job_id}`` shows it. ``result`` is a dict, or
    the model class ``get``/``wait`` were given; fields a workflow's own view
    adds (summaries' ``summary``) are kept in ``model_extra``."""

    model_config = ConfigDict(frozen=True, extra="allow")

    job_id: uuid.UUID
    status: JobStatus
    result: R | None = None
    error: str | None = None
    # Every model checkpoint of the job, summed.
    usage: JobUsage | None = None
    waiting: Waiting | None = None
    steps: list[JobStep] = []
    # A map's child: the job that mapped it.
    parent: uuid.UUID | None = None
    created_at: datetime
    updated_at: datetime

    @property
    def finished(self) -> bool:
        """Done, dead or cancelled: nothing about it changes any more."""
        return self.status in FINISHED
