"""What a job is, as the stores read and write it: the records of the
``jobs``, ``results`` and ``job_deliveries`` tables and what a delivery
reports. Plain data, no driver: the API's views, the CLI and the worker
share these without loading PostgreSQL's or Redis's client."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any


@dataclass(frozen=True)
class JobSpec:
    """A job as it is dispatched: which workflow, for whom, with what request."""

    job_id: str
    tenant: str
    kind: str
    payload: dict[str, Any]


@dataclass(frozen=True)
class Acceptance:
    """What ``accept`` found: ``fresh`` when this call recorded the job (and
    enqueued it), else the job was recorded before, with ``fingerprint``
    (None for rows accepted before fingerprints were kept)."""

    fresh: bool
    fingerprint: str | None


@dataclass(frozen=True)
class JobRecord:
    """A job row with its result, as ``GET <route>/{job_id}`` shows it."""

    job_id: uuid.UUID
    tenant: str
    kind: str
    status: str
    result: dict[str, Any] | None
    usage: dict[str, int] | None
    error: str | None
    created_at: datetime
    updated_at: datetime
    # While waiting: the name its wake-up is matched on (an event's; None:
    # a sleep), until when, and what it waits on as GET shows it (a call,
    # an approval; None: an event or a sleep).
    waiting_for: str | None
    wait_until: datetime | None
    waiting_detail: dict[str, Any] | None
    # Its checkpoints in the order the run reached them, without their
    # values: {"key", "kind", "status", "finished_at", "usage"}.
    steps: list[dict[str, Any]]
    # A map's child: its parent job (docs/fanout.md).
    parent_id: uuid.UUID | None = None
    # While it waits on a map: what the map's children count.
    children: dict[str, int] | None = None


@dataclass(frozen=True)
class JobDetail(JobRecord):
    """A job row with its result and its request, as operators see it."""

    payload: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DeadJob:
    """A dead job as operators list it: its dead letter."""

    job_id: uuid.UUID
    tenant: str
    kind: str
    # "<reason>: <last error>" (the reason one of workflow.DEAD_REASONS).
    error: str | None
    dead_at: datetime
    # Deliveries that reported back.
    deliveries: int


@dataclass(frozen=True)
class DeliveryRecord:
    """One delivery of a job that reported back (``job_deliveries``)."""

    # The job's delivery number since it was last enqueued (1 = the first).
    delivery: int
    consumer: str
    started_at: datetime
    finished_at: datetime
    # done, duplicate, retry, dead or cancelled.
    outcome: str
    error: str | None
    model_calls: int


@dataclass(frozen=True)
class DeliveryReport:
    """What one delivery of a job came to, for the job's history (docs/console.md,
    Deliveries)."""

    job_id: str
    # The job's delivery number since it was last enqueued (``Delivery.number``).
    number: int
    consumer: str
    # Unix seconds.
    started_at: float
    # done, retry (redelivered after a backoff), dead, cancelled (stopped by
    # the worker: a handler past its bound, or a shutdown; redelivered).
    outcome: str
    error: str | None
    model_calls: int
