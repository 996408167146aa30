"""Scoring a shadow result against the primary's.

A workflow's ``evaluator`` takes the two results (as the workflow's result
model) and answers an ``Evaluation`` (a score in [0, 1] and, optionally, a
score per field) or just the score. The default is ``field_agreement()``:
each top-level field of the result is 1 when both results have the same
value, else 0, and the score is their mean.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel


@dataclass(frozen=True)
class Evaluation:
    """How far a shadow result agrees with the primary's: ``score`` in [0, 1],
    and per field (what ``oncely eval report`` shows per field)."""

    score: float
    fields: Mapping[str, float] = field(default_factory=dict)


Evaluator = Callable[[Any, Any], "Evaluation | float"]


def field_agreement(*fields: str) -> Evaluator:
    """Field-by-field agreement over ``fields`` (default: every field of the
    result): 1 for a field with equal values, else 0; the score is the mean."""

    def agreement(primary: BaseModel, shadow: BaseModel) -> Evaluation:
        a, b = primary.model_dump(mode="json"), shadow.model_dump(mode="json")
        names = fields or tuple(a)
        agree = {name: 1.0 if a.get(name) == b.get(name) else 0.0 for name in names}
        return Evaluation(sum(agree.values()) / len(agree) if agree else 1.0, agree)

    return agreement


def evaluate(evaluator: Evaluator | None, primary: BaseModel, shadow: BaseModel) -> Evaluation:
    """The evaluator's verdict, checked: ValueError if it is not a score in [0, 1]."""
    verdict = (evaluator or field_agreement())(primary, shadow)
    evaluation = verdict if isinstance(verdict, Evaluation) else Evaluation(float(verdict))
    scores = [evaluation.score, *evaluation.fields.values()]
    if not all(isinstance(s, int | float) and math.isfinite(s) and 0 <= s <= 1 for s in scores):
        raise ValueError(f"an evaluator must score in [0, 1], got {evaluation}")
    return Evaluation(float(evaluation.score), {k: float(v) for k, v in evaluation.fields.items()})
