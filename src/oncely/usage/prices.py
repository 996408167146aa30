"""ONCELY_LLM_PRICES: USD per million tokens, in and out, per model name
(``gpt-4.1-mini=0.40/1.60,llama3=0/0``), optionally with the price of a
cached input token third (``gpt-4.1=2/8/0.5``; without it, cached input
costs as any input). A model with no price costs ``None``: unknown, never a
made-up zero."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

_NUMBER = r"\d+(?:\.\d+)?"
_PRICE = re.compile(
    rf"^(?P<model>[^=\s,]+)=(?P<input>{_NUMBER})/(?P<output>{_NUMBER})(?:/(?P<cached>{_NUMBER}))?$"
)
_PER = 1_000_000


@dataclass(frozen=True)
class Price:
    """USD per million prompt (``input``) and completion (``output``) tokens."""

    input: float
    output: float
    # A cached prompt token's price; None: as any prompt token.
    cached: float | None = None


@dataclass(frozen=True)
class Prices:
    by_model: Mapping[str, Price] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Prices:
        """ValueError naming the item that does not read ``model=in/out``."""
        prices: dict[str, Price] = {}
        for item in (i.strip() for i in text.split(",")):
            if not item:
                continue
            match = _PRICE.match(item)
            if match is None:
                raise ValueError(
                    f"{item!r}: expected model=input/output[/cached input] (USD per million tokens)"
                )
            cached = None if match["cached"] is None else float(match["cached"])
            prices[match["model"]] = Price(float(match["input"]), float(match["output"]), cached)
        return cls(prices)

    def cost(
        self, model: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
    ) -> float | None:
        """What a call to ``model`` that used these tokens cost (``cached_tokens``
        of the prompt's at the cached price); None if unpriced."""
        price = self.by_model.get(model)
        if price is None:
            return None
        cached = min(cached_tokens, prompt_tokens) if price.cached is not None else 0
        prompt = (prompt_tokens - cached) * price.input + cached * (price.cached or 0.0)
        return (prompt + completion_tokens * price.output) / _PER
