"""Every benchmark, one after another, then BENCHMARKS.md from their reports.

    python -m bench                  # what `make bench` runs: bench/results/*.json, BENCHMARKS.md
    python -m bench --smoke --results /tmp/smoke --markdown /tmp/smoke/BENCHMARKS.md
    python -m bench --only intake,memory
    python -m bench --markdown-only  # BENCHMARKS.md again from bench/results/

Each benchmark is its own process (``python -m bench.<name> --out …``); one
whose invariants failed exits 1, and so does this, after the others ran.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness.processes import ROOT
from bench.harness.report import RESULTS

BENCHMARKS = (
    "intake",
    "worker",
    "steps",
    "agents",
    "maps",
    "streams",
    "relay",
    "end_to_end",
    "memory",
)
MARKDOWN = ROOT / "BENCHMARKS.md"


def run_all(names: list[str], results: Path, smoke: bool) -> tuple[list[str], float]:
    failed = []
    started = time.monotonic()
    for name in names:
        out = results / f"{name}.json"
        shown = out.resolve().relative_to(ROOT) if out.resolve().is_relative_to(ROOT) else out
        argv = [sys.executable, "-m", f"bench.{name}", "--out", str(shown)]
        argv += ["--smoke"] if smoke else []
        print(f"== bench.{name}", file=sys.stderr, flush=True)
        done = subprocess.run(argv, cwd=ROOT, stdout=subprocess.DEVNULL, check=False)
        if done.returncode != 0:
            failed.append(name)
    return failed, time.monotonic() - started


def load_reports(results: Path, names: list[str]) -> list[dict[str, Any]]:
    found = [results / f"{name}.json" for name in names]
    return [json.loads(p.read_text()) for p in found if p.exists()]


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="every benchmark's smoke run")
    p.add_argument("--only", help="comma-separated, of " + ", ".join(BENCHMARKS))
    p.add_argument("--results", type=Path, default=RESULTS, help="where the JSON reports go")
    p.add_argument("--markdown", type=Path, default=MARKDOWN, help="where the summary goes")
    p.add_argument("--markdown-only", action="store_true", help="only write the summary")
    args = p.parse_args()
    names = args.only.split(",") if args.only else list(BENCHMARKS)
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        p.error(f"unknown benchmark {unknown[0]!r}")
    failed: list[str] = []
    total_s = None
    if not args.markdown_only:
        failed, total_s = run_all(names, args.results, args.smoke)
    from bench.summary import render

    reports = load_reports(args.results, list(BENCHMARKS))
    args.markdown.write_text(render(reports, args.markdown, args.results, total_s))
    print(f"wrote {args.markdown}", file=sys.stderr)
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
