"""Which models a call may use, in order (docs/model-routing.md).

A call's *route* is the primary model (ONCELY_LLM_MODEL, or the variant a
workflow runs on) then its fallbacks (ONCELY_LLM_FALLBACKS, or the
workflow's own ``fallbacks=``), each ``name`` or ``name@base_url``, either
optionally after its dialect (``chat:``, ``responses:``, ``anthropic:``;
docs/providers.md),
so a route may mix providers. The
model (``oncely.llm.model``) moves down the route when a model's retries
ran out on a transient failure; a permanent one ends the call where it is,
and the fleet's cooldown (``oncely.llm.cooldown``) skips the models that
keep failing. Parsing a route imports no Redis client and no SDK.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from oncely import names
from oncely.llm.base import LLM

# How a model is spoken to: OpenAI chat completions (what OpenAI-compatible
# servers speak), OpenAI's Responses API, or Anthropic's Messages API.
Dialect = Literal["chat", "responses", "anthropic"]
DIALECTS: tuple[Dialect, ...] = ("chat", "responses", "anthropic")
# One item of ONCELY_LLM_FALLBACKS: a model name, optionally @ its endpoint,
# optionally after its dialect. A name may hold a colon itself (Ollama's
# ``llama3:8b``): only a dialect's name before the first one is a dialect.
_MODEL = re.compile(r"^(?P<name>[^@\s,]+)(?:@(?P<url>https?://[^\s,]+))?$")


@dataclass(frozen=True)
class ModelSpec:
    """A model a route names: ``base_url`` None is the primary's endpoint;
    ``dialect`` None when the entry names none (docs/providers.md: another
    model of the primary's endpoint speaks the primary's dialect, one of
    another endpoint ``chat``)."""

    name: str
    base_url: str | None = None
    dialect: Dialect | None = None

    def __str__(self) -> str:
        text = self.name if self.base_url is None else f"{self.name}@{self.base_url}"
        return text if self.dialect is None else f"{self.dialect}:{text}"


def split_dialect(text: str) -> tuple[Dialect | None, str]:
    """``anthropic:claude-x`` as (``anthropic``, ``claude-x``); a name without
    a dialect's prefix as (None, the name)."""
    head, colon, rest = text.partition(":")
    if colon and head in DIALECTS and rest:
        return head, rest
    return None, text


def parse_models(text: str | Sequence[str]) -> list[ModelSpec]:
    """``gpt-4.1-mini,llama3@http://vllm:8000/v1`` (or the same as a list)
    as specs; ValueError naming the item that is neither."""
    items = text.split(",") if isinstance(text, str) else list(text)
    specs = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        dialect, rest = split_dialect(item)
        match = _MODEL.match(rest)
        if match is None:
            raise ValueError(
                f"{item!r}: expected a model name, or name@http(s)://endpoint, either"
                f" optionally after a dialect ({', '.join(d + ':' for d in DIALECTS)})"
            )
        specs.append(ModelSpec(match["name"], match["url"], dialect))
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

    @property
    def dialect(self) -> str:
        """The dialect its adapter speaks (``chat`` unless it says another)."""
        return dialect_of(self.llm)

    @property
    def lanes(self) -> tuple[str, ...]:
        """The lanes its adapter takes (docs/lanes.md): its ``lanes``, else
        ``standard`` alone (a test double, an adapter without the flex tier)."""
        return lanes_of(self.llm)


def lanes_of(llm: LLM) -> tuple[str, ...]:
    """The lanes an adapter takes: its ``lanes``, else ``standard`` alone."""
    lanes = getattr(llm, "lanes", ("standard",))
    return tuple(lanes) if isinstance(lanes, tuple) else ("standard",)


def max_tokens_of(llm: LLM) -> int | None:
    """The answer's length an adapter asks for (``max_tokens``), if it says."""
    limit = getattr(llm, "max_tokens", None)
    return limit if isinstance(limit, int) and not isinstance(limit, bool) else None


def dialect_of(llm: LLM) -> str:
    """The dialect an adapter speaks: its ``dialect``, else ``chat`` (every
    ``LLM`` written before dialects, and the test doubles, are chat's)."""
    dialect = getattr(llm, "dialect", "chat")
    return dialect if isinstance(dialect, str) else "chat"


@dataclass(frozen=True)
class Caller:
    """Whose call it is: the job (its failures count once) and the tenant
    (whose cooldown it may be)."""

    job: str
    tenant: str

    @property
    def scope(self) -> str:
        return names.tenant_digest(self.tenant) or "-"
