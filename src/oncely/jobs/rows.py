"""Row helpers the job and checkpoint stores share (``jobs/store.py``,
``jobs/checkpoints.py``): how checkpoints, effects and a delivery become a
statement's parameters, and what a unique violation on a checkpoint means."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from oncely.jobs.records import DeliveryReport
from oncely.journal import NewCheckpoint, Replay, Writes

# The constraints whose violation means another delivery stored a checkpoint first.
CHECKPOINT_KEYS = frozenset({"checkpoints_pkey", "checkpoints_ordinal_key"})


def raced(exc: psycopg.errors.UniqueViolation) -> BaseException:
    """A unique violation on a checkpoint: another delivery stored it first,
    so the run replays over it (``Replay``). Any other, as it is."""
    if exc.diag.constraint_name in CHECKPOINT_KEYS:
        return Replay(exc.diag.constraint_name)
    return exc


def writes_params(writes: Writes) -> dict[str, Any]:
    """The parameters of a statement that stores ``writes`` as checkpoint
    rows (the wait's statement): one JSON document each for the
    checkpoints (their values as JSON text, NUL and all) and the effects.
    One document converts far faster than a parameter array per column."""
    return {
        "checkpoints": Jsonb(checkpoint_rows(writes)),
        "effects": Jsonb(effect_rows(writes)),
    }


def checkpoint_rows(writes: Writes) -> list[dict[str, Any]]:
    """``writes``' checkpoints as the rows a statement inserts."""
    return [
        {**step_summary(c), "value": json_text(c.value), "request": c.request}
        for c in writes.checkpoints
    ]


def step_summary(checkpoint: NewCheckpoint) -> dict[str, Any]:
    """A checkpoint's summary: what ``steps`` shows of it."""
    return {
        "key": checkpoint.key,
        "ordinal": checkpoint.ordinal,
        "kind": checkpoint.kind,
        "status": checkpoint.status,
        "usage": checkpoint.usage,
    }


def effect_rows(writes: Writes) -> list[dict[str, Any]]:
    """``writes``' effects as the outbox rows a statement inserts."""
    return [
        {"topic": e.topic, "dedupe_key": e.dedupe_key, "payload": e.payload} for e in writes.effects
    ]


def json_text(value: Any) -> str:
    """``value`` as JSON text PostgreSQL can store: non-ASCII as it is, NUL
    (which jsonb refuses) escaped, lone surrogates escaped too."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    try:
        text.encode()
    except UnicodeEncodeError:
        return json.dumps(value, separators=(",", ":"))
    return text


def delivery_params(report: DeliveryReport | None) -> dict[str, Any]:
    """A statement's delivery parameters, for the job's history (all NULL:
    no history row)."""
    if report is None:
        return dict.fromkeys(("delivery", "consumer", "started_at", "model_calls"))
    return {
        "delivery": report.number,
        "consumer": report.consumer,
        "started_at": utc_moment(report.started_at),
        "model_calls": report.model_calls,
    }


def delivery_fields(report: DeliveryReport | None) -> dict[str, Any]:
    """``delivery_params`` as JSON fields (the moment as ISO 8601 text),
    for a statement that takes its rows as one JSON document."""
    fields = delivery_params(report)
    if fields["started_at"] is not None:
        fields["started_at"] = fields["started_at"].isoformat()
    return fields


def utc_moment(unix_s: float) -> datetime:
    return datetime.fromtimestamp(unix_s, UTC)
