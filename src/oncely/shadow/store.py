"""The ``shadow_results`` table: one row per job and shadow variant.

Only this module runs SQL on it (``sql/shadow_results.sql``). Rows are
written once (``ON CONFLICT DO NOTHING``) and deleted with their job (the
foreign key cascades), so retention and tenant erasure need nothing here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from oncely.journal import Emitted
from oncely.sql import query
from oncely.sql.bounded import StatementResult, run_statement

_ERROR_CHARS = 2000


@dataclass(frozen=True)
class ShadowRun:
    """What one shadow run of a job produced: a result (with its score) or an error."""

    workflow: str
    variant: str
    job_id: str
    usage: Mapping[str, int]
    result: Mapping[str, Any] | None = None
    emitted: Sequence[Emitted] = ()
    score: float | None = None
    fields: Mapping[str, float] = field(default_factory=dict)
    error: str | None = None


@dataclass(frozen=True)
class VariantTotals:
    """One variant's totals over a report's window (means are per paired job)."""

    variant: str
    runs: int
    errors: int
    pairs: int
    agreement: float | None
    primary_tokens: float | None
    shadow_tokens: float | None
    primary_calls: float | None
    shadow_calls: float | None
    primary_ms: float | None
    shadow_ms: float | None


@dataclass(frozen=True)
class VariantDetail:
    """Per field mean scores, pairs by score, and the most frequent errors."""

    fields: dict[str, float] = field(default_factory=dict)
    scores: dict[float, int] = field(default_factory=dict)
    errors: list[tuple[str, int]] = field(default_factory=list)


class ShadowResults:
    def __init__(self, pool: AsyncConnectionPool, *, statement_timeout_s: float = 10.0) -> None:
        self.pool = pool
        self.statement_timeout_s = statement_timeout_s

    async def _run(self, name: str, params: Any) -> StatementResult:
        return await run_statement(
            self.pool, query(name), params, timeout_s=self.statement_timeout_s
        )

    async def stored(self, job_id: str, variant: str) -> bool:
        result = await self._run("shadow_result_stored", {"job_id": job_id, "variant": variant})
        return bool(result.rows)

    async def record(self, run: ShadowRun) -> bool:
        """Store the run; False when a row for this job and variant was there."""
        params = {
            "job_id": run.job_id,
            "variant": run.variant,
            "workflow": run.workflow,
            "result": None if run.result is None else Jsonb(run.result),
            "emitted": Jsonb(
                [
                    {"topic": e.topic, "payload": e.payload, "dedupe_key": e.dedupe_key}
                    for e in run.emitted
                ]
            ),
            "usage": Jsonb(run.usage),
            "error": None if run.error is None else run.error[:_ERROR_CHARS],
            "score": run.score,
            "fields": Jsonb(dict(run.fields)),
        }
        return bool((await self._run("record_shadow_result", params)).rows)

    async def totals(
        self, workflow: str, variant: str | None, since: datetime
    ) -> list[VariantTotals]:
        params = {"workflow": workflow, "variant": variant, "since": since}
        rows = (await self._run("shadow_report_totals", params)).rows
        return [VariantTotals(*row) for row in rows]

    async def details(
        self, workflow: str, variant: str | None, since: datetime, *, errors: int = 5
    ) -> dict[str, VariantDetail]:
        params = {"workflow": workflow, "variant": variant, "since": since, "limit": errors}
        found: dict[str, VariantDetail] = {}
        for name, key, mean, _ in (await self._run("shadow_report_fields", params)).rows:
            found.setdefault(name, VariantDetail()).fields[key] = float(mean)
        for name, score, n in (await self._run("shadow_report_scores", params)).rows:
            found.setdefault(name, VariantDetail()).scores[float(score)] = int(n)
        for name, error, n in (await self._run("shadow_report_errors", params)).rows:
            found.setdefault(name, VariantDetail()).errors.append((str(error), int(n)))
        return found
