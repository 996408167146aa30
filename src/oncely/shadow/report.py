"""``oncely eval report`` and ``oncely eval gate``: what the stored shadow
runs say about a variant, and whether it may be promoted.

Agreement is the mean score over *pairs*: jobs with both a primary result
and a shadow result. Errors are shadow runs that failed (they are not
pairs). Cost and latency are compared per paired job: mean tokens (prompt +
completion), model calls and model time on each side, and their ratios.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from oncely.shadow.store import ShadowResults, VariantDetail, VariantTotals

# Score distribution buckets: (label, low, high); the last holds exactly 1.
BUCKETS = (
    ("0-0.25", 0.0, 0.25),
    ("0.25-0.5", 0.25, 0.5),
    ("0.5-0.75", 0.5, 0.75),
    ("0.75-1", 0.75, 1.0),
    ("1", 1.0, 1.0),
)


@dataclass(frozen=True)
class VariantReport:
    workflow: str
    variant: str
    runs: int
    errors: int
    pairs: int
    agreement: float | None
    fields: dict[str, float]
    scores: dict[str, int]
    top_errors: list[tuple[str, int]]
    primary: dict[str, float | None]
    shadow: dict[str, float | None]

    @property
    def error_rate(self) -> float:
        return self.errors / self.runs if self.runs else 0.0

    @property
    def cost_ratio(self) -> float | None:
        """Shadow tokens per job over the primary's (None: nothing to compare)."""
        return _ratio(self.shadow["tokens"], self.primary["tokens"])

    @property
    def latency_ratio(self) -> float | None:
        return _ratio(self.shadow["model_ms"], self.primary["model_ms"])

    def to_json(self) -> dict[str, Any]:
        return {
            "workflow": self.workflow,
            "variant": self.variant,
            "runs": self.runs,
            "pairs": self.pairs,
            "errors": self.errors,
            "error_rate": self.error_rate,
            "agreement": self.agreement,
            "fields": self.fields,
            "scores": self.scores,
            "top_errors": [{"error": e, "count": n} for e, n in self.top_errors],
            "per_job": {"primary": self.primary, "shadow": self.shadow},
            "deltas": {
                "tokens": _delta(self.shadow["tokens"], self.primary["tokens"]),
                "model_calls": _delta(self.shadow["model_calls"], self.primary["model_calls"]),
                "model_ms": _delta(self.shadow["model_ms"], self.primary["model_ms"]),
                "cost_ratio": self.cost_ratio,
                "latency_ratio": self.latency_ratio,
            },
        }


async def build_report(
    store: ShadowResults, workflow: str, variant: str | None, since: datetime
) -> list[VariantReport]:
    """One report per variant with stored runs (of ``variant`` only, if given)."""
    totals = await store.totals(workflow, variant, since)
    details = await store.details(workflow, variant, since)
    return [_report(workflow, t, details.get(t.variant, VariantDetail())) for t in totals]


def _report(workflow: str, t: VariantTotals, d: VariantDetail) -> VariantReport:
    return VariantReport(
        workflow=workflow,
        variant=t.variant,
        runs=int(t.runs),
        errors=int(t.errors),
        pairs=int(t.pairs),
        agreement=_float(t.agreement),
        fields=d.fields,
        scores=distribution(d.scores),
        top_errors=d.errors,
        primary={
            "tokens": _float(t.primary_tokens),
            "model_calls": _float(t.primary_calls),
            "model_ms": _float(t.primary_ms),
        },
        shadow={
            "tokens": _float(t.shadow_tokens),
            "model_calls": _float(t.shadow_calls),
            "model_ms": _float(t.shadow_ms),
        },
    )


def distribution(scores: dict[float, int]) -> dict[str, int]:
    """Pairs per score bucket."""
    counts = {label: 0 for label, _, _ in BUCKETS}
    for score, n in scores.items():
        label = "1" if score >= 1 else next(lab for lab, low, high in BUCKETS if score < high)
        counts[label] += n
    return counts


@dataclass(frozen=True)
class Thresholds:
    """What ``oncely eval gate`` requires of a variant."""

    min_agreement: float
    min_pairs: int = 1
    # Shadow runs that failed, over all shadow runs.
    max_error_rate: float = 0.05
    # Shadow tokens per job over the primary's; None: not checked.
    max_cost_ratio: float | None = None


@dataclass(frozen=True)
class Verdict:
    passed: bool
    checks: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


def gate(report: VariantReport | None, t: Thresholds) -> Verdict:
    """Pass only if every threshold holds; each check described either way."""
    if report is None:
        return Verdict(False, [], ["no shadow runs stored for this variant"])
    checks: list[tuple[bool, str]] = [
        (report.pairs >= t.min_pairs, f"pairs {report.pairs} (need >= {t.min_pairs})"),
    ]
    agreement = report.agreement
    checks.append(
        (
            agreement is not None and agreement >= t.min_agreement,
            f"agreement {_fmt(agreement)} (need >= {t.min_agreement:g})",
        )
    )
    checks.append(
        (
            report.error_rate <= t.max_error_rate,
            f"error rate {report.error_rate:.3f} (need <= {t.max_error_rate:g})",
        )
    )
    if t.max_cost_ratio is not None:
        ratio = report.cost_ratio
        checks.append(
            (
                ratio is not None and ratio <= t.max_cost_ratio,
                f"cost ratio {_fmt(ratio)} (need <= {t.max_cost_ratio:g})",
            )
        )
    passed = all(ok for ok, _ in checks)
    return Verdict(passed, [text for ok, text in checks if ok], [t for ok, t in checks if not ok])


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _delta(shadow: float | None, primary: float | None) -> float | None:
    return None if shadow is None or primary is None else shadow - primary
