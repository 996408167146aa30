"""BENCHMARKS.md from the benchmarks' JSON reports: the machine, the command,
one table of every headline number, and links to the reports."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def render(
    reports: list[dict[str, Any]], markdown: Path, results: Path, total_s: float | None
) -> str:
    if not reports:
        return "# Benchmarks\n\nNo reports yet: run `make bench`.\n"
    lines = [
        "# Benchmarks",
        "",
        "Written by `make bench` (`python -m bench`) from the JSON reports it links;",
        "run it again rather than editing this file. How each benchmark measures,",
        "and the intake's profile: [bench/README.md](bench/README.md).",
        "",
        *_machine(reports),
        "",
        "## The command",
        "",
        "```sh",
        "make bench   # .venv/bin/python -m bench",
        "```",
        "",
        _took(reports, total_s),
        "",
        "| benchmark | command | took | noise |",
        "|---|---|---|---|",
        *(_command_row(r, os.path.relpath(results, markdown.parent)) for r in reports),
        "",
        "## Results",
        "",
        "Ratios are oncely over the contender named, each the median of the per-round",
        "ratios (the two ran back to back); every round's ratio is listed beside it.",
        "",
        "| measure | value | per round | goal | met |",
        "|---|---|---|---|---|",
        *(_row(h) for r in reports for h in r["headline"]),
        "",
        *_invariants(reports),
    ]
    return "\n".join(lines) + "\n"


def _machine(reports: list[dict[str, Any]]) -> list[str]:
    m = reports[0]["machine"]
    src = reports[0]["oncely_source"]
    dirty = " (with uncommitted changes in src/)" if src["uncommitted"] else ""
    pg = (
        f"{m.get('postgres_server_version')} ({m.get('servers')}, fsync {m.get('postgres_fsync')}, "
    )
    pg += f"synchronous_commit {m.get('postgres_synchronous_commit')})"
    redis = f"{m.get('redis_server', 'redis')} {m.get('redis_version')} ({m.get('servers')})"
    return [
        "## The machine",
        "",
        "| | |",
        "|---|---|",
        f"| cores | {m.get('cpus')} |",
        f"| CPU | {m.get('cpu_model')} |",
        f"| memory | {m.get('memory_gb')} GB |",
        f"| Python | {m.get('python')} |",
        f"| PostgreSQL | {pg} |",
        f"| Redis | {redis} |",
        f"| load generator | {m.get('wrk') or 'wrk not installed'} |",
        f"| platform | {m.get('platform')} |",
        f"| oncely | `{src['revision']}`{dirty}, src digest `{src['src_sha256']}` |",
    ]


def _took(reports: list[dict[str, Any]], total_s: float | None) -> str:
    total = total_s if total_s is not None else sum(r["total_s"] for r in reports)
    smoke = any(r["smoke"] for r in reports)
    kind = "smoke runs (tiny sizes, one round: not numbers to quote)" if smoke else "full runs"
    return f"{kind}, {total / 60:.1f} min in all."


def _command_row(r: dict[str, Any], results: str) -> str:
    name = r["benchmark"]
    link = f"{results}/{name}.json"
    noise = r["noise"]
    kept = noise.get("noisy_runs_kept", 0)
    noisy = f"{kept} noisy run(s) kept" if kept else "no noisy run kept"
    waited = f", {noise.get('spent_s', 0):g} s waiting for quiet"
    if noise.get("foreign_cores_median") is not None:
        waited += f", other work {noise['foreign_cores_median']:g} cores (median of runs)"
    before = r.get("busy_cores_before", r.get("latency", {}).get("busy_cores_before"))
    if before is not None:
        waited += f", {before:g} cores busy before the load"
    return (
        f"| [{name}]({link}) | `{r['command']}` | {r['total_s'] / 60:.1f} min | {noisy}{waited} |"
    )


def _row(h: dict[str, Any]) -> str:
    value = "—" if h["value"] is None else f"{h['value']:g} {h['unit']}"
    rounds = h.get("per_round") or []
    spread = ", ".join(f"{v:g}" for v in rounds) if len(rounds) > 1 else "—"
    goal = "—"
    if h.get("at_least") is not None:
        goal = f"≥ {h['at_least']:g}"
    if h.get("at_most") is not None:
        goal = f"≤ {h['at_most']:g}"
    met = {True: "✓", False: "✗", None: ""}[h.get("meets_goal")]
    return f"| {h['what']} | **{value}** | {spread} | {goal} | {met} |"


def _invariants(reports: list[dict[str, Any]]) -> list[str]:
    bad = [r["benchmark"] for r in reports if not r["ok"]]
    changed = [r["benchmark"] for r in reports if r.get("src_changed_during_run")]
    out = []
    if bad:
        out.append(f"**Invariants FAILED in: {', '.join(bad)}** — those numbers mean nothing.")
    else:
        out.append("Every run of every benchmark ended with its invariants checked and holding")
        out.append("(every job once, every effect once; see `checks` in each report).")
    if changed:
        out.append(f"src/ changed during: {', '.join(changed)} (results mix versions).")
    return out
