"""py-spy profiles, filed in buckets that name live functions.

A bucket names its functions as ``module:qualname`` targets. Every target is
imported and looked up when the buckets are built (each benchmark builds its
own at start, smoke runs included), so a renamed or deleted function is an
error instead of samples silently falling into "the rest". Each sample goes
to the first bucket one of whose functions is on its stack (py-spy names a
frame ``<qualname> (<file>:<line>)``): list inner work before what encloses it.
A target ending in ``/`` (``pydantic_ai/``) names a whole package: any frame
of a file in it, wherever on the stack (a framework's own code, which runs
in tasks of its own whose stacks hold none of the functions that started them).
py-spy names a file from the outermost directory with an ``__init__.py``:
for a namespace package (``langgraph/``) that is each of its regular
subpackages (``pregel/``, ``graph/``); its top-level modules go unnamed.
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
    files: tuple[str, ...] = ()  # ``(package/``: any frame of a file in it

    def holds(self, framed: str) -> bool:
        """Whether a stack (frames each led by ``;``) is this bucket's."""
        return any(";" + x in framed for x in self.needles) or any(f in framed for f in self.files)


def buckets(spec: Sequence[tuple[str, Sequence[str]]]) -> list[Bucket]:
    """``(bucket name, module:qualname targets)`` → buckets, every target
    looked up in the live code (MissingFunction if one is not there). A
    class stands for any of its methods; ``package/`` for its every file."""
    out = []
    for name, targets in spec:
        needles, files = [], []
        for target in targets:
            if target.endswith("/"):
                files.extend(_package(name, target))
                continue
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
        out.append(Bucket(name, tuple(needles), tuple(files)))
    return out


def _package(bucket: str, target: str) -> list[str]:
    """A package target as py-spy shows its files: ``(package/…``, or for a
    namespace package the regular packages found below it (module docstring)."""
    package = target.rstrip("/")
    try:
        found = importlib.import_module(package)
    except ImportError as exc:
        raise MissingFunction(f"profile bucket {bucket!r}: no package {package}") from exc
    if not hasattr(found, "__path__"):
        raise MissingFunction(f"profile bucket {bucket!r}: {package} is a module, not a package")
    if getattr(found, "__file__", None):
        return [f"({package.rsplit('.', 1)[-1]}/"]
    return [f"({name}/" for root in found.__path__ for name in _regular_below(Path(root))]


def _regular_below(root: Path) -> list[str]:
    """The outermost regular packages under a namespace package's directory,
    as paths from it."""
    found = []
    for sub in sorted(p for p in root.iterdir() if p.is_dir() and p.name != "__pycache__"):
        if (sub / "__init__.py").exists():
            found.append(sub.name)
        else:
            found.extend(f"{sub.name}/{name}" for name in _regular_below(sub))
    return found


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
        name = next((b.name for b in rules if b.holds(framed)), REST)
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
