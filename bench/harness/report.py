"""A benchmark's command line, its run (children, servers, SIGTERM) and its
JSON report: the machine, what was measured (the source's revision and
digest), the settings, the headline numbers, the detail, and whether every
invariant held. A run whose invariants failed still writes its report, says
so on stderr and exits 1: a fast wrong run cannot look good."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from redis.asyncio import Redis

from bench.harness.measure import Headline, Noise, NoiseControl, say
from bench.harness.processes import ROOT, Children, sigterm_unwinds
from bench.harness.servers import Servers, server_info, servers

RESULTS = ROOT / "bench" / "results"


def parser(
    name: str, doc: str, *, rounds: int, noise: Noise, profile: str | None = None
) -> argparse.ArgumentParser:
    """The options every benchmark takes; full-run defaults given here.
    ``profile``: the help of ``--profile``, for a benchmark that can py-spy
    its processes."""
    p = argparse.ArgumentParser(prog=f"python -m bench.{name}", description=doc.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one round: a CI check")
    p.add_argument("--rounds", type=int, help=f"rounds, each contender once per round ({rounds})")
    p.add_argument(
        "--out",
        type=Path,
        default=RESULTS / f"{name}.json",
        help="the JSON report (also on stdout; default %(default)s)",
    )
    p.add_argument(
        "--redis-url",
        default=os.environ.get("ONCELY_BENCH_REDIS_URL"),
        help="use this Redis, FLUSHED before every run (env ONCELY_BENCH_REDIS_URL)",
    )
    p.add_argument(
        "--database-url",
        default=os.environ.get("ONCELY_BENCH_DATABASE_URL"),
        help="use this database, its jobs, results and outbox TRUNCATED (env "
        "ONCELY_BENCH_DATABASE_URL); default: embedded servers",
    )
    p.add_argument("--log-dir", type=Path, help="children's logs (default: a temporary dir)")
    p.add_argument("--noise-max-cores", type=float, default=noise.max_cores)
    p.add_argument("--quiet-wait-s", type=float, help=f"per run ({noise.wait_s:g})")
    p.add_argument("--noise-retries", type=int, help=f"runs again when noisy ({noise.retries})")
    p.add_argument("--noise-budget-s", type=float, help=f"in all ({noise.budget_s:g})")
    if profile is not None:
        p.add_argument("--profile", action="store_true", help=profile)
    p.set_defaults(full_rounds=rounds, full_noise=noise)
    return p


@dataclass
class Context:
    """What a benchmark's run gets: its options, servers, children and folders."""

    args: argparse.Namespace
    servers: Servers
    children: Children
    log_dir: Path
    noise: NoiseControl

    @property
    def smoke(self) -> bool:
        return bool(self.args.smoke)

    @property
    def rounds(self) -> int:
        return int(self.args.rounds)


def _defaults(args: argparse.Namespace) -> None:
    noise: Noise = args.full_noise
    if args.rounds is None:
        args.rounds = 1 if args.smoke else args.full_rounds
    fallback = (0.0, 0, 0.0) if args.smoke else (noise.wait_s, noise.retries, noise.budget_s)
    for name, value in zip(
        ("quiet_wait_s", "noise_retries", "noise_budget_s"), fallback, strict=True
    ):
        if getattr(args, name) is None:
            setattr(args, name, value)


Body = Callable[[Context], Coroutine[Any, Any, tuple[list[Headline], dict[str, Any], bool]]]


def main(name: str, title: str, args: argparse.Namespace, body: Body) -> None:
    """Run ``body`` (→ headline, detail, invariants held) with servers and
    children that are stopped however it ends; write and print the report."""
    from oncely.logs import configure_logging

    configure_logging("console", "WARNING")  # stdout carries the JSON report only
    sigterm_unwinds()
    _defaults(args)
    noise = NoiseControl(
        Noise(args.noise_max_cores, args.quiet_wait_s, args.noise_retries, args.noise_budget_s)
    )
    started = time.monotonic()
    source = source_state()
    with tempfile.TemporaryDirectory(prefix=f"oncely-bench-{name}-") as tmp:
        log_dir = args.log_dir or Path(tmp) / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        children = Children(log_dir)
        try:
            with servers(args.redis_url, args.database_url, Path(tmp)) as s:
                ctx = Context(args, s, children, log_dir, noise)
                headline, detail, ok = asyncio.run(body(ctx))
                info = asyncio.run(_server_info(s))
        finally:
            children.close()
    report = {
        "benchmark": name,
        "title": title,
        "ok": ok,
        "smoke": bool(args.smoke),
        "command": "python -m bench." + name + "".join(f" {a}" for a in sys.argv[1:]),
        "rounds": args.rounds,
        "noise": noise.to_json(),
        "machine": machine_info() | info | {"servers": s.kind},
        "oncely_source": source,
        "src_changed_during_run": _changed(source),
        "headline": [h.to_json() for h in headline],
        **detail,
        "total_s": round(time.monotonic() - started, 1),
    }
    write(report, args.out)
    if not ok:
        say(f"INVARIANTS FAILED in bench.{name}: see 'ok' and the checks in {args.out}")
        sys.exit(1)


async def _server_info(s: Servers) -> dict[str, Any]:
    redis = Redis.from_url(s.redis_url, decode_responses=True)
    try:
        async with await psycopg.AsyncConnection.connect(s.database_url, autocommit=True) as db:
            return await server_info(redis, db)
    finally:
        await redis.aclose()


def write(report: dict[str, Any], out: Path | None) -> None:
    text = json.dumps(report, indent=2)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    print(text)


def machine_info() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_gb": _memory_gb(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "wrk": _wrk_version(),
    }


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _memory_gb() -> float | None:
    import psutil

    return round(psutil.virtual_memory().total / 2**30, 1)


def _wrk_version() -> str | None:
    if shutil.which("wrk") is None:
        return None
    done = subprocess.run(["wrk", "-v"], capture_output=True, text=True, check=False)
    first = (done.stdout or done.stderr).strip().splitlines()
    return first[0] if first else None


def source_state() -> dict[str, str]:
    """What was measured: HEAD, src files changed in the working tree, and a
    digest of src/ (each process imports it when it starts; others may edit it)."""
    digest = hashlib.sha256()
    for path in sorted((ROOT / "src").rglob("*")):
        if path.suffix in (".py", ".sql", ".lua") and path.is_file():
            digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return {
        "revision": _git("rev-parse", "--short", "HEAD"),
        "uncommitted": _git("status", "--porcelain", "--", "src"),
        "src_sha256": digest.hexdigest()[:16],
    }


def _changed(before: dict[str, str]) -> bool:
    """Whether src/ changed during the run (a new commit that leaves src/
    alone is no change)."""
    after = source_state()
    changed = (after["src_sha256"], after["uncommitted"]) != (
        before["src_sha256"],
        before["uncommitted"],
    )
    if changed:
        say("WARNING: src/ changed during the run; results mix versions")
    return changed


def _git(*args: str) -> str:
    try:
        done = subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return " ".join(done.stdout.split())
