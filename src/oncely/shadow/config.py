"""``ONCELY_SHADOW`` and ``ONCELY_PRIMARY``, parsed strictly; and sampling.

``ONCELY_SHADOW=triage=fake-v2:0.2,summaries=fake-v2:0.05``: per workflow,
shadow variants and the share of jobs each one runs on. ``ONCELY_PRIMARY=
triage=fake-v2``: the variant a workflow's jobs run on (promotion). A
variant is one the workflow declares, else a model of that name. Model names
may contain ``:`` (``llama3:8b``): the rate is what follows the last one.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass

from oncely.context import PRIMARY

_WORKFLOW = re.compile(r"^[a-z][a-z0-9_]{0,39}$")
_VARIANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,99}$")
_RATE = re.compile(r"^\d*\.?\d+$")
_SCALE = float(2**64)


@dataclass(frozen=True)
class ShadowSpec:
    """One shadow variant of one workflow, run on ``rate`` of its jobs."""

    workflow: str
    variant: str
    rate: float


def parse_shadow(text: str) -> list[ShadowSpec]:
    """``workflow=variant:rate`` items separated by commas (empty: none).
    ValueError naming the first bad item."""
    specs: list[ShadowSpec] = []
    for workflow, value in _items(text):
        variant, colon, rate_text = value.rpartition(":")
        if not colon or not variant:
            raise ValueError(f"{workflow}={value!r}: want workflow=variant:rate")
        _check_variant(workflow, variant)
        rate = _rate(workflow, variant, rate_text)
        if any(s.workflow == workflow and s.variant == variant for s in specs):
            raise ValueError(f"{workflow}={variant} is named twice")
        specs.append(ShadowSpec(workflow, variant, rate))
    return specs


def parse_primary(text: str) -> dict[str, str]:
    """``workflow=variant`` items separated by commas (empty: none)."""
    primary: dict[str, str] = {}
    for workflow, variant in _items(text):
        _check_variant(workflow, variant)
        if workflow in primary:
            raise ValueError(f"workflow {workflow!r} is named twice")
        primary[workflow] = variant
    return primary


def check_workflows(
    specs: list[ShadowSpec], primary: dict[str, str], known: list[str], app: str
) -> None:
    """ValueError naming the workflows the settings name that ``app`` lacks."""
    unknown = sorted(({s.workflow for s in specs} | set(primary)) - set(known))
    if unknown:
        raise ValueError(f"no workflow {unknown} in {app} (has {known})")


def sampled(job_id: str, rate: float) -> bool:
    """Whether ``job_id`` is in the sample: a hash of the id, so every
    delivery of a job, on any worker, decides the same; and a job sampled at
    a rate is sampled at every higher rate too (variants trialled side by
    side run on the same jobs)."""
    if rate >= 1:
        return True
    digest = hashlib.sha256(job_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") / _SCALE < rate


def _items(text: str) -> list[tuple[str, str]]:
    items = []
    for raw in text.split(","):
        item = raw.strip()
        if not item and not text.strip():
            continue
        workflow, equals, value = item.partition("=")
        workflow, value = workflow.strip(), value.strip()
        if not equals or not value:
            raise ValueError(f"{item!r}: want workflow=variant")
        if not _WORKFLOW.match(workflow):
            raise ValueError(f"{item!r}: {workflow!r} is not a workflow name")
        items.append((workflow, value))
    return items


def _check_variant(workflow: str, variant: str) -> None:
    if not _VARIANT.match(variant) or variant == PRIMARY:
        raise ValueError(
            f"{workflow}={variant!r}: a variant is 1-100 of letters, digits and ._:/@+-"
            f" (and not {PRIMARY!r})"
        )


def _rate(workflow: str, variant: str, text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        rate = math.nan
    if not _RATE.match(text) or not 0 < rate <= 1:
        raise ValueError(f"{workflow}={variant}:{text}: the rate must be in (0, 1], like 0.2")
    return rate
