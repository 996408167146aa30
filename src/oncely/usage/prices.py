"""ONCELY_LLM_PRICES: USD per million tokens per model name, input and
output (``gpt-4.1-mini=0.40/1.60,llama3=0/0``), optionally with the price of
a prompt token read from the provider's cache third and of one written to
it fourth (``claude-sonnet=3/15/0.30/3.75``; ``model=in/out//write`` prices
writes alone). Without them, a cached or cache-written token costs as any
input token. A model with no price costs ``None``: unknown, never a made-up
zero (docs/model-routing.md).

A call's ``prompt_tokens`` count every input token, those read from and
written to the cache included (every dialect counts them so: docs/providers.md),
so the cache's tokens are priced in place of as many input tokens. What the
cache *saved* is the prompt at the full input price less what it cost: the
reads' discount, net of the writes' premium (negative when writes cost more
than reads saved).

A call on a cheaper lane (docs/lanes.md) is priced at its lane's price when
one is given (``gpt-4.1-mini@batch=0.20/0.80``, ``…@flex=…``), else at half
the standard one (the providers' batch and flex discount), cache prices
included. What the lane saved is the call at the standard price less what
it cost."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from oncely.usage.calls import LANES

_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_MODEL = re.compile(r"[^=\s,]+")
_PER = 1_000_000
_FORMAT = (
    "model=input/output[/cache read[/cache write]] (USD per million tokens),"
    " or model@flex= / model@batch= for a lane's own"
)
# What a cheaper lane costs of the standard price when no price of its own is given.
_LANE_SHARE = 0.5


@dataclass(frozen=True)
class Price:
    """USD per million prompt (``input``) and completion (``output``) tokens."""

    input: float
    output: float
    # A prompt token read from the provider's cache; None: as any prompt token.
    cached: float | None = None
    # A prompt token written to the provider's cache; None: as any prompt token.
    cache_write: float | None = None

    def share(self, share: float) -> Price:
        """This price times ``share`` (a lane's discount)."""
        return Price(
            self.input * share,
            self.output * share,
            None if self.cached is None else self.cached * share,
            None if self.cache_write is None else self.cache_write * share,
        )


@dataclass(frozen=True)
class Prices:
    by_model: Mapping[str, Price] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Prices:
        """ValueError naming the item that does not read ``model=in/out[/read[/write]]``."""
        prices: dict[str, Price] = {}
        for item in (i.strip() for i in text.split(",")):
            if item:
                model, price = _item(item)
                prices[model] = price
        return cls(prices)

    def price(self, model: str, lane: str = "standard") -> Price | None:
        """``model``'s price on ``lane``: its own (``model@lane=…``), else
        half the standard one; None if unpriced."""
        if lane != "standard":
            own = self.by_model.get(f"{model}@{lane}")
            if own is not None:
                return own
        price = self.by_model.get(model)
        if price is None or lane == "standard":
            return price
        return price.share(_LANE_SHARE)

    def cost(
        self,
        model: str,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int = 0,
        cache_write_tokens: int = 0,
        lane: str = "standard",
    ) -> float | None:
        """What a call to ``model`` on ``lane`` that used these tokens cost
        (of the prompt's, ``cached_tokens`` at the cache-read price and
        ``cache_write_tokens`` at the cache-write one); None if unpriced."""
        price = self.price(model, lane)
        if price is None:
            return None
        read, written = _cache_share(prompt_tokens, cached_tokens, cache_write_tokens)
        prompt = (
            (prompt_tokens - read - written) * price.input
            + read * _or(price.cached, price.input)
            + written * _or(price.cache_write, price.input)
        )
        return (prompt + completion_tokens * price.output) / _PER

    def lane_saved(
        self,
        model: str,
        lane: str,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int = 0,
        cache_write_tokens: int = 0,
    ) -> float | None:
        """What ``lane`` saved a call to ``model``: its cost at the standard
        price less its cost on the lane (0 on the standard lane); None if
        unpriced."""
        tokens = (prompt_tokens, completion_tokens, cached_tokens, cache_write_tokens)
        standard = self.cost(model, *tokens)
        cost = self.cost(model, *tokens, lane=lane)
        if standard is None or cost is None:
            return None
        return standard - cost

    def cache_saved(
        self,
        model: str,
        prompt_tokens: int,
        cached_tokens: int,
        cache_write_tokens: int,
        lane: str = "standard",
    ) -> float | None:
        """What the cache saved a call to ``model``: its prompt at the full
        input price (of its lane) less what it cost (the reads' discount
        net of the writes' premium); None if unpriced, 0 when nothing was
        cached."""
        price = self.price(model, lane)
        if price is None:
            return None
        read, written = _cache_share(prompt_tokens, cached_tokens, cache_write_tokens)
        discount = read * (price.input - _or(price.cached, price.input))
        premium = written * (_or(price.cache_write, price.input) - price.input)
        return (discount - premium) / _PER


def _item(item: str) -> tuple[str, Price]:
    """One ``model[@lane]=in/out[/read[/write]]``, or a ValueError naming it."""
    model, _, numbers = item.partition("=")
    name, at, lane = model.rpartition("@")
    if at and (lane not in LANES or lane == "standard" or not name):
        raise ValueError(f"{item!r}: expected {_FORMAT}")
    parts = numbers.split("/")
    # A cache-read price may be left empty only to give a cache-write one.
    empty_read = len(parts) == 4 and parts[2] == ""
    valid = (
        _MODEL.fullmatch(model) is not None
        and 2 <= len(parts) <= 4
        and all(_NUMBER.fullmatch(p) for i, p in enumerate(parts) if not (i == 2 and empty_read))
    )
    if not valid:
        raise ValueError(f"{item!r}: expected {_FORMAT}")
    values = [float(p) if p else None for p in parts] + [None, None]
    return model, Price(float(parts[0]), float(parts[1]), values[2], values[3])


def _cache_share(
    prompt_tokens: int, cached_tokens: int, cache_write_tokens: int
) -> tuple[int, int]:
    """The cache's reads and writes, within the prompt (a provider's counts
    never price more tokens than the prompt had)."""
    read = max(0, min(cached_tokens, prompt_tokens))
    written = max(0, min(cache_write_tokens, prompt_tokens - read))
    return read, written


def _or(price: float | None, default: float) -> float:
    return default if price is None else price
