"""The worker's memory with 500 jobs in flight.

A real ``oncely worker --workflow summaries`` with
``ONCELY_WORKER_CONCURRENCY=500`` against the fake model made slow with
``[[fake:sleep=S]]`` in every job's text, so that 500 model calls are
outstanding at once. Its resident set (RSS, and USS: the pages that are
its alone) is read idle (after one warm-up job), then every 100 ms while
the jobs run; the number that counts is the highest RSS while the worker
held 500 deliveries (the group's pending count). Goal: at most 150 MB.

The run ends with its invariants checked: every job done once with one
result and one outbox row, nothing pending, one model call per job, and
the fake model saw at least 90 % of the 500 calls outstanding at once (a
few slots may be between reads): otherwise the run measured nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import asdict, dataclass
from typing import Any

import psutil
from redis.asyncio import Redis

from bench.harness import jobs
from bench.harness.fakes import API_KEY, FakeModel
from bench.harness.measure import Headline, Noise
from bench.harness.processes import Children, clean_env
from bench.harness.report import Context, main, parser
from bench.harness.servers import count, fresh_state, migrated
from oncely.builtin.summaries import summaries

GOAL_MB = 150.0
SAMPLE_S = 0.1
MB = 2**20


@dataclass(frozen=True)
class Load:
    concurrency: int
    jobs: int
    model_sleep_s: float


def load(smoke: bool) -> Load:
    return Load(100, 100, 1.5) if smoke else Load(500, 1000, 5.0)


@dataclass
class Memory:
    idle_rss: int = 0
    idle_uss: int = 0
    full_rss: int | None = None  # the highest while every slot held a delivery
    full_uss: int | None = None
    model_in_flight_at_full: int = 0
    peak_rss: int = 0
    samples_at_full: int = 0
    samples: int = 0

    def record(self, proc: psutil.Process, held: int, model_in_flight: int, slots: int) -> None:
        info = proc.memory_full_info()
        self.samples += 1
        self.peak_rss = max(self.peak_rss, info.rss)
        if held >= slots:
            self.samples_at_full += 1
            if info.rss > (self.full_rss or 0):
                self.full_rss, self.model_in_flight_at_full = info.rss, model_in_flight
            self.full_uss = max(self.full_uss or 0, info.uss)


async def bench_main(ctx: Context) -> tuple[list[Headline], dict[str, Any], bool]:
    spec = load(ctx.smoke)
    s = ctx.servers
    model = FakeModel.start(ctx.children)
    redis = Redis.from_url(s.redis_url, decode_responses=True)
    db = await migrated(s.database_url)
    try:
        await model.ready()
        await fresh_state(redis, db)
        env = clean_env(
            redis_url=s.redis_url,
            database_url=s.database_url,
            llm_base_url=model.url,
            llm_api_key=API_KEY,
            worker_concurrency=str(spec.concurrency),
            log_level="WARNING",
        )
        argv = ["-m", "oncely", "worker", "--workflow", summaries.name]
        proc = ctx.children.python("worker", argv, env)
        worker = psutil.Process(proc.pid)
        # One job first: the worker is up, its pools and model client connected.
        warm = await jobs.preload(redis, db, 1)
        await jobs.all_done(db, proc, 1, within_s=60)
        await asyncio.sleep(0.5)
        memory = Memory()
        idle = worker.memory_full_info()
        memory.idle_rss, memory.idle_uss = idle.rss, idle.uss
        busy_before = await ctx.noise.quiet()
        started = time.monotonic()
        job_ids = await jobs.preload(redis, db, spec.jobs, spec.model_sleep_s, first=1)
        deadline = started + 120 + spec.jobs * spec.model_sleep_s / spec.concurrency * 3
        while await count(db, jobs.DONE) < spec.jobs + 1:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the worker did not finish: {ctx.children.log_tail('worker')}")
            held, calls = await jobs.pending(redis), await model.calls()
            memory.record(worker, held, int(calls["in_flight"]), spec.concurrency)
            await asyncio.sleep(SAMPLE_S)
        seconds = time.monotonic() - started
        checks = await jobs.checks(redis, db, model, warm + job_ids)
        calls = await model.calls()
        checks["max_in_flight"] = int(calls["max_in_flight"])
        checks["samples_at_full"] = memory.samples_at_full
        enough = checks["max_in_flight"] >= 0.9 * spec.concurrency
        checks["ok"] = bool(checks["ok"]) and enough
        checks["ok"] = checks["ok"] and memory.samples_at_full > 0
        Children.stop(proc)
    finally:
        await db.close()
        await redis.aclose()
    full_mb = _mb(memory.full_rss)
    per_job_kb = ((memory.full_rss or 0) - memory.idle_rss) / 1024 / spec.concurrency
    detail = {
        "load": asdict(spec),
        "goal_mb": GOAL_MB,
        "rss_mb": {
            "idle": _mb(memory.idle_rss),
            "at_full_concurrency": full_mb,
            "peak": _mb(memory.peak_rss),
        },
        "uss_mb": {
            "idle": _mb(memory.idle_uss),
            "at_full_concurrency": _mb(memory.full_uss),
        },
        "kb_per_job_in_flight": round(per_job_kb, 1) if memory.full_rss else None,
        "model_calls_in_flight_at_that_sample": memory.model_in_flight_at_full,
        "samples": memory.samples,
        "seconds": round(seconds, 2),
        "busy_cores_before": busy_before,
        "checks": checks,
    }
    what = f"worker memory: RSS with {spec.concurrency} jobs in flight"
    headline = [Headline(what, full_mb, "MB", at_most=GOAL_MB)]
    return headline, detail, bool(checks["ok"])


def _mb(n: int | None) -> float | None:
    return None if n is None else round(n / MB, 1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("memory", __doc__ or "", rounds=1, noise=Noise(0.3, 10.0, 0, 10.0))
    return p.parse_args(argv)


if __name__ == "__main__":
    main("memory", "oncely worker RSS with 500 jobs in flight", parse_args(), bench_main)
