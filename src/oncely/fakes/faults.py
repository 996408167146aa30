"""Random faults for the fakes: a rate per kind of fault, reproducible with a seed.

Whether a call meets a fault, and which, depends only on the seed, on what
the call is about (a prompt, an idempotency key) and on how many calls about
it came before: ``draw(subject, n)`` hashes the three. So the n-th call with
one prompt meets the same fault in every run with the same seed, whatever
order concurrent calls arrive in, and a job's fate is the same on a rerun.

Rates are written ``kind=rate`` separated by commas
(``429=0.05,503=0.05,hang=0.01``); each is a share of calls, and together
they may not exceed 1.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

_UNIT = float(1 << 64)


@dataclass(frozen=True)
class RandomFaults:
    """Rates per fault kind, drawn in the order of ``kinds`` (so the order a
    person wrote them in changes nothing)."""

    kinds: Sequence[str]
    rates: Mapping[str, float] = field(default_factory=dict)
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = sorted(set(self.rates) - set(self.kinds))
        if unknown:
            raise ValueError(f"unknown fault {unknown[0]!r} (known: {', '.join(self.kinds)})")
        for kind, rate in self.rates.items():
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"the rate of {kind} must be between 0 and 1, not {rate}")
        if sum(self.rates.values()) > 1.0 + 1e-9:
            raise ValueError("fault rates add up to more than 1")

    def __bool__(self) -> bool:
        return any(self.rates.values())

    def draw(self, subject: str, call: int) -> str | None:
        """The fault of the ``call``-th call (1-based) about ``subject``, or None."""
        if not self:
            return None
        point = _uniform(self.seed, subject, call)
        for kind in self.kinds:
            rate = self.rates.get(kind, 0.0)
            if point < rate:
                return kind
            point -= rate
        return None

    def describe(self) -> str:
        """The rates as they are written on a command line."""
        return ",".join(f"{k}={self.rates[k]:g}" for k in self.kinds if self.rates.get(k))


def parse_rates(text: str, kinds: Sequence[str]) -> dict[str, float]:
    """``"429=0.05, 503=0.05"`` → ``{"429": 0.05, "503": 0.05}``; ValueError
    (a readable one) on an unknown kind, a bad rate, or rates over 1."""
    rates: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        kind, sep, value = part.partition("=")
        kind = kind.strip()
        if not sep:
            raise ValueError(f"expected kind=rate, got {part!r}")
        try:
            rate = float(value)
        except ValueError:
            raise ValueError(
                f"the rate of {kind} must be a number, not {value.strip()!r}"
            ) from None
        if kind in rates:
            raise ValueError(f"{kind} is given twice")
        rates[kind] = rate
    RandomFaults(kinds, rates)  # validates
    return rates


def _uniform(seed: int, subject: str, call: int) -> float:
    """A number in [0, 1) fixed by the three arguments."""
    digest = hashlib.blake2b(f"{seed}\x00{subject}\x00{call}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / _UNIT
