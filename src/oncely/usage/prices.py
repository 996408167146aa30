"""ONCELY_LLM_PRICES: USD per million tokens, in and out, per model name
(``gpt-4.1-mini=0.40/1.60,llama3=0/0``). A model with no price costs
``None``: unknown, never a made-up zero."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

_PRICE = re.compile(r"^(?P<model>[^=\s,]+)=(?P<input>\d+(?:\.\d+)?)/(?P<output>\d+(?:\.\d+)?)$")
_PER = 1_000_000


@dataclass(frozen=True)
class Price:
    """USD per million prompt (``input``) and completion (``output``) tokens."""

    input: float
    output: float


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
                raise ValueError(f"{item!r}: expected model=input/output (USD per million tokens)")
            prices[match["model"]] = Price(float(match["input"]), float(match["output"]))
        return cls(prices)

    def cost(self, model: str, prompt_tokens: int, completion_tokens: int) -> float | None:
        """What a call to ``model`` that used these tokens cost; None if unpriced."""
        price = self.by_model.get(model)
        if price is None:
            return None
        return (prompt_tokens * price.input + completion_tokens * price.output) / _PER
