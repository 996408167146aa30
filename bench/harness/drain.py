"""Benchmarks in which one process under test drains work loaded before it
starts: ``bench.worker`` (jobs) and ``bench.relay`` (outbox rows).

Every run has the same course (bench/README.md, "How each benchmark
measures"): a fresh state with the work loaded, the quiet wait, the process
started, timed from the first item it takes (startup is reported apart) to
the last one done, its CPU and the fake's metered, the invariants checked,
the process killed. A benchmark says what is specific to it: how to load
its work, start a contender, see it start and finish, and check the result.
"""

from __future__ import annotations

import subprocess
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import psutil
import psycopg

from bench.harness import profile
from bench.harness.fakes import Fake
from bench.harness.measure import Meter, Run, Sample, Usage, cpu_s, round_robin
from bench.harness.processes import Children
from bench.harness.report import Context
from bench.harness.servers import migrated

STARTUP_S = 60.0  # how long a contender may take to take its first item
UNDER_TEST, FAKE = "under_test", "fake"  # the meter's names for the two processes


class Trial(Protocol):
    """One contender on one lot of work."""

    @property
    def name(self) -> str:
        """The contender, as the report names it; also its process's log."""

    @property
    def items(self) -> int:
        """How many items it drains."""

    @property
    def timeout_s(self) -> float:
        """How long the drain may take before the run is an error."""


@dataclass(frozen=True)
class JobsTrial:
    """The plainest trial: the contender ``kind`` draining ``jobs`` jobs."""

    kind: str
    jobs: int

    @property
    def name(self) -> str:
        return self.kind

    @property
    def items(self) -> int:
        return self.jobs

    @property
    def timeout_s(self) -> float:
        return 180 + self.jobs * 0.05


T = TypeVar("T", bound=Trial)
F = TypeVar("F", bound=Fake)


class Drain(ABC, Generic[T, F]):
    """The servers, the fake the contenders talk to, and a run's course.

    Metrics are named by ``item`` (``job``: ``jobs``, ``jobs_per_s``,
    ``jobs_per_s_incl_startup``, ``cpu_ms_per_job``, ``servers_cpu_ms_per_job``)
    and ``fake_name`` (``fake_model``: ``fake_model_cpu_ms_per_job``)."""

    item: ClassVar[str]
    fake_name: ClassVar[str]
    shown: ClassVar[tuple[str, ...]]  # the metrics a run's progress line shows

    def __init__(self, ctx: Context, fake: F) -> None:
        self.ctx = ctx
        self.fake = fake
        self.db: psycopg.AsyncConnection[Any]

    async def open(self) -> None:
        self.db = await migrated(self.ctx.servers.database_url)
        await self.fake.ready()

    async def close(self) -> None:
        await self.db.close()

    # -- what each benchmark says -------------------------------------------------

    @abstractmethod
    async def load(self, trial: T) -> None:
        """A fresh state (servers and fake) with the trial's work in it."""

    @abstractmethod
    def spawn(self, trial: T) -> subprocess.Popen[bytes]:
        """The contender's process."""

    @abstractmethod
    async def started(self, proc: subprocess.Popen[bytes], within_s: float) -> None:
        """Until the process took its first item; RuntimeError if it does not."""

    @abstractmethod
    async def drained(self, proc: subprocess.Popen[bytes], trial: T, within_s: float) -> None:
        """Until every item is done; RuntimeError if they are not."""

    @abstractmethod
    async def checks(self, trial: T) -> dict[str, Any]:
        """The invariants after the drain, ``ok`` if all hold."""

    # -- the course -----------------------------------------------------------------

    async def run_rounds(self, trials: Sequence[T], label: str) -> dict[str, list[Run]]:
        """Every trial once per round (``measure.round_robin``), runs by name."""
        by_name = {t.name: t for t in trials}

        async def one(name: str, round_no: int) -> Run:
            return await self.run(by_name[name], round_no)

        return await round_robin(
            list(by_name), self.ctx.rounds, one, self.ctx.noise, self.shown, f"{label} "
        )

    async def run(self, trial: T, round_no: int) -> Run:
        """One metered run; a contender that fails to start or finish is the
        run's error (with its log's tail), not the benchmark's."""
        await self.load(trial)
        run = Run(trial.name, round_no, busy_cores_before=await self.ctx.noise.quiet())
        spawned = time.monotonic()
        proc = self.spawn(trial)
        procs = {UNDER_TEST: psutil.Process(proc.pid), FAKE: self.fake.process}
        meter = Meter(procs, self.ctx.servers.cpu)
        try:
            await self.started(proc, STARTUP_S)
            ready = meter.sample()
            await self.drained(proc, trial, trial.timeout_s)
            done = meter.sample()
        except RuntimeError as exc:
            Children.kill(proc)
            run.error = f"{exc}; log: {self.ctx.children.log_tail(trial.name)}"
            return run
        use = Meter.usage(ready, done)
        run.metrics = self._metrics(trial.items, spawned, ready, done, use)
        run.foreign_cores = use.foreign_cores
        run.checks = await self.checks(trial)
        run.ok = bool(run.checks["ok"])
        # Every item is done and recorded (checked): a graceful stop would
        # only cost wall time, and a kill is a stop oncely is built for.
        Children.kill(proc)
        return run

    def _metrics(
        self, n: int, spawned: float, ready: Sample, done: Sample, use: Usage
    ) -> dict[str, float]:
        """Throughput and CPU per item between the first item taken and the
        last done, startup apart."""
        one, many = self.item, f"{self.item}s"
        metrics: dict[str, float] = {
            many: n,
            "seconds": round(use.wall_s, 3),
            f"{many}_per_s": round(n / use.wall_s, 1),
            "startup_s": round(ready.at - spawned, 3),
            f"{many}_per_s_incl_startup": round(n / (done.at - spawned), 1),
            f"cpu_ms_per_{one}": use.ms_per(UNDER_TEST, n),
            "startup_cpu_ms": round(ready.cpu[UNDER_TEST] * 1000, 1),
            f"{self.fake_name}_cpu_ms_per_{one}": use.ms_per(FAKE, n),
            "machine_busy_cores": use.busy_cores,
        }
        if (servers_ms := use.servers_ms_per(n)) is not None:
            metrics[f"servers_cpu_ms_per_{one}"] = servers_ms
        return metrics

    async def profile(
        self, trial: T, rules: list[profile.Bucket], spy_name: str | None = None, **about: Any
    ) -> dict[str, Any]:
        """One run with py-spy on the process (which slows it: the shares
        count, not the speed); ``about`` goes into the report after the name."""
        await self.load(trial)
        proc = self.spawn(trial)
        await self.started(proc, STARTUP_S)
        under_test = psutil.Process(proc.pid)
        cpu_before = cpu_s(under_test)
        spy = profile.Spy(self.ctx.children, spy_name or trial.name, proc.pid, self.ctx.log_dir)
        await spy.attached()
        await self.drained(proc, trial, trial.timeout_s * 3)
        cpu_ms = (cpu_s(under_test) - cpu_before) * 1000 / trial.items
        folded = await spy.stop()
        checks = await self.checks(trial)
        Children.kill(proc)
        return {
            "contender": trial.name,
            **about,
            f"{self.item}s": trial.items,
            f"cpu_ms_per_{self.item}_under_py_spy": round(cpu_ms, 3),
            "folded": str(folded),
            "checks_ok": checks["ok"],
            **profile.shares(folded, rules, cpu_ms),
        }
