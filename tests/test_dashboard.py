"""The Grafana dashboard under deploy/ reads only metrics oncely exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import REGISTRY

import oncely.metrics  # noqa: F401 (registers every metric)

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "oncely.json"
_METRIC = re.compile(r"\boncely_[a-z_]+\b")


_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
}


def exported_series() -> set[str]:
    """Every series name the registry can produce (with _total, _bucket, …)."""
    return {
        family.name + suffix
        for family in REGISTRY.collect()
        for suffix in _SUFFIXES.get(family.type, ("",))
    }


def test_every_dashboard_query_names_an_exported_metric() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {name for q in queries for name in _METRIC.findall(q)}
    assert len(queries) >= 10 and len(used) >= 15
    missing = sorted(used - exported_series())
    assert missing == [], f"the dashboard reads metrics nobody exports: {missing}"
