"""Adding up what model calls spent: a checkpoint's calls, then a job's
checkpoints (``usage`` on ``GET <route>/{job_id}``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

# The counts that add up.
COUNTS = ("prompt_tokens", "completion_tokens", "model_calls", "model_ms")
# Counts a provider reports only sometimes: in the sum only once one has them.
DETAILS = ("cached_tokens", "reasoning_tokens")


def summed(usages: Iterable[Mapping[str, Any] | None]) -> dict[str, Any]:
    """The counts added up; ``cost_usd`` added up too, None as soon as one
    part's cost is unknown (a model without a price, or usage recorded
    before prices were); ``model``: the last part's that names one;
    ``children``: what the parts' child jobs spent (``ctx.map``), summed
    apart, never in the part's own counts."""
    total: dict[str, Any] = dict.fromkeys(COUNTS, 0)
    cost: float | None = 0.0
    model = None
    children: list[Mapping[str, Any]] = []
    for usage in usages:
        if not usage:
            continue
        if usage.get("children"):
            children.append(usage["children"])
        for name in COUNTS:
            total[name] += int(usage.get(name, 0))
        for name in DETAILS:
            if usage.get(name):
                total[name] = total.get(name, 0) + int(usage[name])
        part = usage.get("cost_usd")
        cost = None if cost is None or part is None else cost + float(part)
        model = usage.get("model") or model
    total["cost_usd"] = None if cost is None else round(cost, 10)
    total["model"] = model
    if children:
        total["children"] = summed(children)
    return total
