"""CPU probes, noise control, rounds and ratios.

A run's CPU is read per process from ``/proc`` (psutil); ``foreign_cores``
is the machine's busy CPU that none of the benchmark's processes used
(known with embedded servers only). The machine is shared: before a run the
benchmark waits for it to be quiet, and runs again when other work took
more than ``max_cores`` during one. Contenders run round-robin, so drift
hits each alike, and a ratio is the median of the per-round ratios (the two
ran back to back)."""

from __future__ import annotations

import asyncio
import functools
import math
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil


def cpu_s(proc: psutil.Process) -> float:
    """User + system CPU seconds of one process."""
    t = proc.cpu_times()
    return float(t.user + t.system)


def machine_busy_s() -> float:
    t = psutil.cpu_times()
    return float(sum(t) - t.idle - getattr(t, "iowait", 0.0))


# -- probes ---------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    at: float
    cpu: dict[str, float]
    harness: float
    servers: dict[int, float] | None
    busy: float


@dataclass(frozen=True)
class Usage:
    """What happened between two samples."""

    wall_s: float
    cpu_s: dict[str, float]
    servers_s: float | None
    busy_s: float
    foreign_cores: float | None

    def ms_per(self, name: str, n: int) -> float:
        return round(self.cpu_s[name] * 1000 / max(n, 1), 3)

    def cores(self, name: str) -> float:
        return round(self.cpu_s[name] / self.wall_s, 2)

    def servers_ms_per(self, n: int) -> float | None:
        return None if self.servers_s is None else round(self.servers_s * 1000 / max(n, 1), 3)

    @property
    def busy_cores(self) -> float:
        return round(self.busy_s / self.wall_s, 2)


class Meter:
    """Samples the named processes, the harness, the servers and the machine."""

    def __init__(
        self, procs: dict[str, psutil.Process], servers: Callable[[], dict[int, float] | None]
    ) -> None:
        self.procs = procs
        self.servers = servers
        self.harness = psutil.Process()

    def sample(self) -> Sample:
        return Sample(
            time.monotonic(),
            {name: cpu_s(p) for name, p in self.procs.items()},
            cpu_s(self.harness),
            self.servers(),
            machine_busy_s(),
        )

    @staticmethod
    def usage(before: Sample, after: Sample, other_s: float = 0.0) -> Usage:
        """``other_s``: CPU of ours not in a sample (e.g. a load generator's)."""
        wall = max(after.at - before.at, 1e-9)
        cpu = {name: after.cpu[name] - before.cpu.get(name, 0.0) for name in after.cpu}
        servers = None
        if before.servers is not None and after.servers is not None:
            # Backends born during the run count from zero; ones that exited are lost.
            servers = sum(c - before.servers.get(pid, 0.0) for pid, c in after.servers.items())
        busy = after.busy - before.busy
        foreign = None
        if servers is not None:
            ours = sum(cpu.values()) + servers + (after.harness - before.harness) + other_s
            foreign = round((busy - ours) / wall, 2)
        return Usage(wall, cpu, servers, busy, foreign)


# -- runs and noise ---------------------------------------------------------------


@dataclass
class Run:
    """One contender's run: its numbers, its invariants, and the noise around it."""

    contender: str
    round: int
    metrics: dict[str, float] = field(default_factory=dict)
    checks: dict[str, Any] = field(default_factory=dict)
    ok: bool = False
    error: str | None = None
    busy_cores_before: float | None = None
    foreign_cores: float | None = None
    noise_retries: int = 0


@dataclass(frozen=True)
class Noise:
    """Wait up to ``wait_s`` for fewer than ``max_cores`` busy before a run;
    run again (up to ``retries`` times) when other work took more than
    ``max_cores`` during one; spend at most ``budget_s`` on both in all."""

    max_cores: float
    wait_s: float
    retries: int
    budget_s: float


class NoiseControl:
    def __init__(self, noise: Noise) -> None:
        self.noise = noise
        self.spent_s = 0.0
        self.noisy_runs = 0
        self.foreign: list[float] = []  # per kept run, where known

    @property
    def _left_s(self) -> float:
        return self.noise.budget_s - self.spent_s

    async def quiet(self) -> float | None:
        """Busy cores in the last half-second (when the wait ended); None
        when there is no waiting (a smoke run, or the budget is spent)."""
        wait_s = min(self.noise.wait_s, self._left_s)
        if wait_s <= 0:
            return None
        started = time.monotonic()
        deadline = started + wait_s
        while True:
            before = machine_busy_s()
            await asyncio.sleep(0.5)
            busy = (machine_busy_s() - before) / 0.5
            if busy <= self.noise.max_cores or time.monotonic() >= deadline:
                self.spent_s += time.monotonic() - started
                return round(busy, 2)

    async def run(self, once: Callable[[], Awaitable[Run]]) -> Run:
        """``once`` (which calls ``quiet`` when it is ready to start), again while noisy."""
        attempt = 0
        while True:
            started = time.monotonic()
            run = await once()
            run.noise_retries = attempt
            noisy = run.foreign_cores is not None and run.foreign_cores > self.noise.max_cores
            if not noisy or attempt >= self.noise.retries or self._left_s <= 0:
                self.noisy_runs += noisy
                if run.foreign_cores is not None:
                    self.foreign.append(run.foreign_cores)
                return run
            self.spent_s += time.monotonic() - started
            attempt += 1
            say(f"  noisy run ({run.foreign_cores} foreign cores): again")

    def to_json(self) -> dict[str, Any]:
        foreign = round(statistics.median(self.foreign), 2) if self.foreign else None
        return asdict(self.noise) | {
            "spent_s": round(self.spent_s, 1),
            "noisy_runs_kept": self.noisy_runs,
            "foreign_cores_median": foreign,
        }


def say(message: str) -> None:
    """Progress, on stderr (stdout carries the JSON report only)."""
    print(message, file=sys.stderr, flush=True)


async def round_robin(
    names: Sequence[str],
    rounds: int,
    run_one: Callable[[str, int], Awaitable[Run]],
    noise: NoiseControl,
    shown: Sequence[str],
    label: str = "",
) -> dict[str, list[Run]]:
    """Every contender once per round, in order: drift over time (page cache,
    WAL, a neighbour's load) hits each alike."""
    runs: dict[str, list[Run]] = {name: [] for name in names}
    for round_no in range(1, rounds + 1):
        for name in names:
            run = await noise.run(functools.partial(run_one, name, round_no))
            runs[name].append(run)
            say(progress(label, run, shown))
    return runs


def progress(label: str, run: Run, shown: Sequence[str]) -> str:
    numbers = "  ".join(f"{k} {run.metrics[k]:g}" for k in shown if k in run.metrics)
    status = "ok" if run.ok else f"FAILED {run.error or run.checks}"
    noise = f"other work {run.busy_cores_before}/{run.foreign_cores} cores before/during"
    retry = f" (retry {run.noise_retries})" if run.noise_retries else ""
    return f"[{label}#{run.round}] {run.contender:<18} {numbers}  {noise}{retry}  {status}"


# -- the numbers ---------------------------------------------------------------------


def summary(runs: list[Run]) -> dict[str, Any]:
    """Per metric the median over the rounds and every round's value."""
    keys = [k for k in runs[0].metrics] if runs else []
    return {
        "median": {
            k: round(statistics.median(r.metrics[k] for r in runs if k in r.metrics), 3)
            for k in keys
        },
        "per_round": {k: [r.metrics.get(k) for r in runs] for k in keys},
        "runs": [asdict(r) for r in runs],
    }


@dataclass(frozen=True)
class Ratio:
    value: float
    per_round: list[float]
    spread: tuple[float, float]

    def to_json(self) -> dict[str, Any]:
        return {"value": self.value, "per_round": self.per_round, "spread": list(self.spread)}


def ratio(ours: list[Run], theirs: list[Run], metric: str) -> Ratio | None:
    """The median of per-round ratios, over the rounds where both runs passed
    (None when either did not run)."""
    if not ours or not theirs:
        return None
    per_round = [
        round(o.metrics[metric] / t.metrics[metric], 3)
        for o, t in zip(ours, theirs, strict=True)
        if o.ok and t.ok and t.metrics.get(metric)
    ]
    if not per_round:
        return None
    return Ratio(
        round(statistics.median(per_round), 3), per_round, (min(per_round), max(per_round))
    )


def ratio_json(ours: list[Run], theirs: list[Run], metric: str) -> dict[str, Any] | None:
    """``ratio`` as a report writes it."""
    r = ratio(ours, theirs, metric)
    return None if r is None else r.to_json()


@dataclass(frozen=True)
class Headline:
    """One line of BENCHMARKS.md: what is compared, the value, its spread,
    and the goal (``at_least`` or ``at_most``)."""

    what: str
    value: float | None
    unit: str = "×"
    per_round: list[float] = field(default_factory=list)
    at_least: float | None = None
    at_most: float | None = None

    @classmethod
    def of(cls, what: str, r: Ratio | None, **goal: float) -> Headline:
        return cls(what, r.value if r else None, "×", r.per_round if r else [], **goal)

    @property
    def meets_goal(self) -> bool | None:
        if self.at_least is None and self.at_most is None:
            return None
        if self.value is None:
            return False
        low_ok = self.at_least is None or self.value >= self.at_least
        return low_ok and (self.at_most is None or self.value <= self.at_most)

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"meets_goal": self.meets_goal}


def percentiles(values: list[float]) -> dict[str, float]:
    """Nearest-rank percentiles."""
    if not values:
        return {}
    ordered = sorted(values)

    def rank(p: float) -> float:
        return ordered[max(math.ceil(p / 100 * len(ordered)) - 1, 0)]

    return {
        "p50": round(rank(50), 1),
        "p90": round(rank(90), 1),
        "p99": round(rank(99), 1),
        "max": round(ordered[-1], 1),
        "mean": round(statistics.fmean(ordered), 1),
    }
