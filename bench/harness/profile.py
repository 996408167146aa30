"""py-spy profiles, filed in buckets that name live functions.

A bucket names its functions as ``module:qualname`` targets. Every target is
imported and looked up when the buckets are built (each benchmark builds its
own at start, smoke runs included), so a renamed or deleted function is an
error instead of samples silently falling into "the rest". Each sample goes
to the first bucket one of whose functions is on its stack (py-spy names a
frame ``<qualname> (<file>:<line>)``): list inner work before what encloses it.
"""

from __future__ import annotations

import asyncio
import collections
import importlib
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness.processes import Children, clean_env

REST = "event loop and the rest (uvloop callbacks, task/future bookkeeping, pools)"


class MissingFunction(LookupError):
    """A profile bucket names a function the code no longer has."""


@dataclass(frozen=True)
class Bucket:
    name: str
    needles: tuple[str, ...]  # py-spy frame prefixes


def buckets(spec: Sequence[tuple[str, Sequence[str]]]) -> list[Bucket]:
    """``(bucket name, module:qualname targets)`` → buckets, every target
    looked up in the live code (MissingFunction if one is not there). A
    class stands for any of its methods."""
    out = []
    for name, targets in spec:
        needles = []
        for target in targets:
            module, _, qualname = target.partition(":")
            try:
                obj: Any = importlib.import_module(module)
            except ImportError as exc:
                raise MissingFunction(f"profile bucket {name!r}: no module {module}") from exc
            for part in qualname.split("."):
                obj = getattr(obj, part, None)
                if obj is None:
                    raise MissingFunction(f"profile bucket {name!r} names a missing {target}")
            needles.append(f"{qualname}." if isinstance(obj, type) else f"{qualname} (")
        out.append(Bucket(name, tuple(needles)))
    return out


def shares(folded: Path, rules: list[Bucket], cpu_ms: float | None = None) -> dict[str, Any]:
    """Share of the main thread's samples per bucket (and of ``cpu_ms``)."""
    counts: collections.Counter[str] = collections.Counter()
    threads = 0
    for line in folded.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack:
            continue
        if "Thread._bootstrap" in stack:  # executor threads, idle or not
            threads += int(n)
            continue
        # Frames are ";"-separated: a needle matches at a frame's start, so
        # "OpenAICompatible." is not found in "LeanOpenAICompatible.complete".
        framed = ";" + stack
        name = next((b.name for b in rules if any(";" + x in framed for x in b.needles)), REST)
        counts[name] += int(n)
    total = sum(counts.values()) or 1
    table: dict[str, Any] = {}
    for name, samples in counts.most_common():
        share = round(samples / total, 3)
        table[name] = share if cpu_ms is None else [share, round(share * cpu_ms, 3)]
    return {"main_thread_samples": total, "other_thread_samples": threads, "buckets": table}


def py_spy() -> str | None:
    for candidate in (shutil.which("py-spy"), str(Path(sys.executable).with_name("py-spy"))):
        if candidate and Path(candidate).exists():
            return candidate
    return None


def need_py_spy() -> str:
    found = py_spy()
    if found is None:
        raise SystemExit("profiling needs py-spy: .venv/bin/pip install -e '.[bench]'")
    return found


class Spy:
    """``py-spy record`` attached to one process until ``stop``."""

    def __init__(self, children: Children, name: str, pid: int, out: Path, rate: int = 100):
        self.folded = out / f"{name}.folded"
        argv = [need_py_spy(), "record", "--pid", str(pid), "--rate", str(rate)]
        argv += ["--format", "raw", "-o", str(self.folded)]
        self.name = f"py-spy-{name}"
        self.children = children
        self.proc: subprocess.Popen[bytes] = children.start(self.name, argv, clean_env())

    async def attached(self, within_s: float = 30.0) -> None:
        """Until py-spy samples: an interrupt before it attached (a busy
        machine makes that slow) would leave no profile at all."""
        deadline = time.monotonic() + within_s
        while _SAMPLING not in self.children.log_tail(self.name):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"py-spy did not start: {self.children.log_tail(self.name)}")
            await asyncio.sleep(0.05)

    async def stop(self) -> Path:
        self.proc.send_signal(signal.SIGINT)
        await asyncio.to_thread(self.proc.wait, 30)
        if not self.folded.exists():
            if _SAMPLING not in self.children.log_tail(self.name):
                raise RuntimeError(f"py-spy wrote nothing: {self.children.log_tail(self.name)}")
            self.folded.write_text("")  # it sampled a process that stayed idle throughout
        return self.folded


# What py-spy prints once it samples.
_SAMPLING = "py-spy> Sampling process"
