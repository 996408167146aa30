"""A model call as the usage ledger records it (``oncely.usage.ledger``):
whom it is for, what it came to, and the ``sent`` row of a call on its
way. Plain data, no driver: the model seam and the step kit build them
without loading the ledger's store.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

Outcome = Literal["ok", "retryable", "permanent", "invalid_output", "timeout", "refused", "sent"]

# How a call goes, as its row's ``lane`` says (docs/lanes.md): ``standard``;
# ``flex``, OpenAI's ``service_tier: "flex"`` (cheaper, slower, may answer
# 429 for lack of capacity); ``batch``, through the provider's batch API
# (hours, not seconds). Here, with the row, so that the prices and the
# model seam both import it from a leaf.
Lane = Literal["standard", "flex", "batch"]
LANES: tuple[Lane, ...] = ("standard", "flex", "batch")


@dataclass(frozen=True)
class CallSite:
    """Whom a delivery's calls are for: the labels of its ledger rows."""

    workflow: str
    job_id: str | None = None
    tenant: str = ""
    shadow: bool = False


@dataclass(frozen=True)
class Call:
    """One model call, as its row records it."""

    site: CallSite
    step: str | None
    model: str
    attempt: int
    outcome: Outcome
    prompt_tokens: int
    completion_tokens: int
    latency_ms: int
    cost_usd: float | None
    at: float = field(default_factory=time.time)
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    cache_write_tokens: int = 0
    dialect: str = "chat"
    # What the provider's cache saved the call against its prompt at the
    # full input price (oncely.usage.prices); None: unpriced.
    cache_saved_usd: float | None = None
    # How it went (docs/lanes.md), and what that saved against the standard
    # price (oncely.usage.prices); None: unpriced.
    lane: str = "standard"
    lane_saved_usd: float | None = None
    # Names a row that must be written once however often it is recorded
    # (a batch line's answer, ``oncely.llm.batches.Line.call_id``); None
    # for a call sent over HTTP, which is recorded once by its sender.
    call_id: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "job_id": self.site.job_id,
            "workflow": self.site.workflow,
            "tenant": self.site.tenant,
            "step": self.step,
            "model": self.model,
            "attempt": self.attempt,
            "outcome": self.outcome,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "latency_ms": self.latency_ms,
            "cost_usd": self.cost_usd,
            "shadow": self.site.shadow,
            "at": self.at,
            "cached_tokens": self.cached_tokens,
            "reasoning_tokens": self.reasoning_tokens,
            "cache_write_tokens": self.cache_write_tokens,
            "dialect": self.dialect,
            "cache_saved_usd": self.cache_saved_usd,
            "lane": self.lane,
            "lane_saved_usd": self.lane_saved_usd,
            "call_id": self.call_id,
        }


@dataclass(eq=False)
class Sending:
    """A call on its way to the provider (``Ledger.sending``): its ``sent``
    row, written if a batch is written before the call ends. ``call_id``
    names that row once a batch carried it (so the call's end deletes it);
    ``written``: a batch was taken with it."""

    call: Call
    call_id: str | None = None
    written: bool = False

    def to_json(self) -> dict[str, Any]:
        return {**self.call.to_json(), "call_id": self.call_id}
