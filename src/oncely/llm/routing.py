"""Which models a call may use, in order (docs/model-routing.md).

A call's *route* is the primary model (ONCELY_LLM_MODEL, or the variant a
workflow runs on) then its fallbacks (ONCELY_LLM_FALLBACKS, or the
workflow's own ``fallbacks=``), each ``name`` or ``name@base_url``. The
model (``oncely.llm.model``) moves down the route when a model's retries
ran out on a transient failure; a permanent one ends the call where it is,
and the fleet's cooldown (``oncely.llm.cooldown``) skips the models that
keep failing. Parsing a route imports no Redis client and no SDK.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from oncely.llm.base import LLM

# One item of ONCELY_LLM_FALLBACKS: a model name, optionally @ its endpoint.
_MODEL = re.compile(r"^(?P<name>[^@\s,]+)(?:@(?P<url>https?://[^\s,]+))?$")


@dataclass(frozen=True)
class ModelSpec:
    """A model a route names: ``base_url`` None is the primary's endpoint."""

    name: str
    base_url: str | None = None

    def __str__(self) -> str:
        return self.name if self.base_url is None else f"{self.name}@{self.base_url}"


def parse_models(text: str | Sequence[str]) -> list[ModelSpec]:
    """``gpt-4.1-mini,llama3@http://vllm:8000/v1`` (or the same as a list)
    as specs; ValueError naming the item that is neither."""
    items = text.split(",") if isinstance(text, str) else list(text)
    specs = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        match = _MODEL.match(item)
        if match is None:
            raise ValueError(f"{item!r}: expected a model name, or name@http(s)://endpoint")
        specs.append(ModelSpec(match["name"], match["url"]))
    names_ = [s.name for s in specs]
    if len(set(names_)) != len(names_):
        raise ValueError(f"a model is named twice in {', '.join(names_)}")
    return specs


@dataclass(frozen=True)
class Target:
    """One model of a route: its name (what the provider is asked for, and
    every metric's and ledger row's label) and the adapter that asks it."""

    name: str
    llm: LLM
