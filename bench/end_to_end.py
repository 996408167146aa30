"""End to end: POST → email through real ``api``, ``worker`` and ``relay`` processes.

``oncely api``, ``worker`` and ``relay`` with the fake model (instant) and the
fake mail provider, each its own process. After warm-up requests one at a
time:

- **latency**: requests at a modest rate, an open loop (sent on schedule
  whatever the answers take), each timed from sending the POST to the
  email's ``received_at`` in the provider's mailbox (one clock: this
  machine's), with the stages in between from PostgreSQL's timestamps;
- **throughput**: a burst of requests from many concurrent clients, timed
  from the first POST to the last email at the provider.

Both end with their invariants checked: every POST answered 202, every job
once in ``jobs`` and ``done``, exactly one email per job at the provider
(effects = requests = mailbox lines, the keys those of the accepted jobs).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import subprocess
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import psycopg
from redis.asyncio import Redis

from bench.harness import jobs
from bench.harness.fakes import API_KEY, FakeMail, FakeModel
from bench.harness.measure import Headline, Noise, percentiles
from bench.harness.processes import Children, clean_env, free_port, wait_http
from bench.harness.report import Context, main, parser
from bench.harness.servers import count, fresh_state, migrate_and_key
from oncely.builtin.summaries import dedupe_key

LATENCY_GOALS_MS = {"p50": 20.0, "p99": 100.0}
CONCURRENCY = 64  # the relay's, oncely's default
MAILBOX_POLL_S = 0.01
# The processes are idle between requests: sample them faster.
SPY_RATE = 250
TOP_FRAMES = 30


@dataclass(frozen=True)
class Load:
    """``warmup`` requests one at a time; ``requests`` at ``rate_per_s`` (an
    open loop, at most ``in_flight`` outstanding); then ``burst`` requests
    from ``clients`` concurrent clients."""

    warmup: int
    requests: int
    rate_per_s: float
    in_flight: int
    burst: int
    clients: int


def load(smoke: bool) -> Load:
    return Load(2, 10, 20.0, 32, 30, 16) if smoke else Load(20, 300, 20.0, 32, 2000, 64)


@dataclass(frozen=True)
class Posted:
    job_id: str | None
    status: int
    sent_at: float  # wall clock (time.time), like the provider's received_at
    answered_at: float
    late_s: float  # how far behind the open loop's schedule the POST went out


class MailboxTail:
    """Reads the provider's JSONL mailbox as it grows: key -> received_at."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.received: dict[str, float] = {}
        self.lines = 0
        self._offset = 0
        self._partial = b""

    def poll(self) -> None:
        if not self.path.exists():
            return
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        for raw in lines:
            if raw.strip():
                line = json.loads(raw)
                self.lines += 1
                at = datetime.fromisoformat(line["received_at"]).timestamp()
                self.received.setdefault(line["idempotency_key"], at)

    async def wait_for(self, keys: list[str], within_s: float) -> None:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            self.poll()
            if all(k in self.received for k in keys):
                return
            await asyncio.sleep(MAILBOX_POLL_S)


class Stack:
    """Every process of the path POST → email, and how to reach them."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.mailbox = ctx.log_dir / "mailbox.jsonl"
        self.model = FakeModel.start(ctx.children)
        self.mail = FakeMail.start(ctx.children, "fake-mail", self.mailbox)
        self.port = free_port()
        s = ctx.servers
        self.env = clean_env(
            redis_url=s.redis_url,
            database_url=s.database_url,
            llm_base_url=self.model.url,
            llm_api_key=API_KEY,
            sender_url=self.mail.messages_url,
            relay_concurrency=str(CONCURRENCY),
            log_level="WARNING",
        )
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.key = ""
        self.api_url = f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        s = self.ctx.servers
        self.key = await migrate_and_key(s.database_url, jobs.TENANT)
        redis = Redis.from_url(s.redis_url)
        async with await psycopg.AsyncConnection.connect(s.database_url, autocommit=True) as db:
            await fresh_state(redis, db)
        await redis.aclose()
        children = self.ctx.children
        for role, extra in (("api", ["--port", str(self.port)]), ("worker", []), ("relay", [])):
            self.procs[role] = children.python(
                f"e2e-{role}", ["-m", "oncely", role, *extra], self.env
            )
        await wait_http(f"{self.api_url}/readyz", self.procs["api"], "e2e-api", children)
        await self.model.ready()
        await self.mail.ready()

    def cpu(self) -> dict[str, float]:
        procs = {**self.procs, "fake_llm": self.model.proc, "fake_mail": self.mail.proc}
        out = {}
        for name, p in procs.items():
            t = psutil.Process(p.pid).cpu_times()
            out[name] = t.user + t.system
        if (servers := self.ctx.servers.cpu()) is not None:
            out["servers"] = sum(servers.values())
        return out

    def logs(self) -> str:
        return " | ".join(f"{r}: {self.ctx.children.log_tail(f'e2e-{r}', 800)}" for r in self.procs)


async def post(session: aiohttp.ClientSession, stack: Stack, i: int, late_s: float = 0.0) -> Posted:
    headers = {"Authorization": f"Bearer {stack.key}", "Idempotency-Key": f"e2e-{uuid.uuid4()}"}
    body = {"text": jobs.ticket(i), "notify": f"user{i}@example.com"}
    sent_at = time.time()
    async with session.post(f"{stack.api_url}/v1/summaries", json=body, headers=headers) as r:
        answer = await r.json(content_type=None)
        status = r.status
    job_id = answer.get("job_id") if isinstance(answer, dict) else None
    return Posted(job_id, status, sent_at, time.time(), late_s)


async def warm_up(
    session: aiohttp.ClientSession, stack: Stack, tail: MailboxTail, n: int
) -> list[Posted]:
    """One request at a time, each waited for: every process is up and has its connections."""
    posted = []
    for i in range(n):
        p = await post(session, stack, i)
        if p.status != 202 or not p.job_id:
            raise RuntimeError(f"warm-up POST answered {p.status}: {stack.logs()}")
        await tail.wait_for([dedupe_key(p.job_id)], within_s=60)
        if dedupe_key(p.job_id) not in tail.received:
            raise RuntimeError("warm-up email never arrived: " + stack.logs())
        posted.append(p)
    return posted


async def open_loop(
    session: aiohttp.ClientSession, stack: Stack, spec: Load, first: int
) -> list[Posted]:
    """``spec.requests`` POSTs on a fixed schedule, whatever the answers take
    (up to ``in_flight`` outstanding): a late answer cannot slow the load."""
    slots = asyncio.Semaphore(spec.in_flight)
    start = time.monotonic() + 0.05

    async def one(i: int, due: float) -> Posted:
        try:
            return await post(session, stack, first + i, time.monotonic() - due)
        finally:
            slots.release()

    tasks = []
    for i in range(spec.requests):
        due = start + i / spec.rate_per_s
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        await slots.acquire()
        tasks.append(asyncio.create_task(one(i, due)))
    return list(await asyncio.gather(*tasks))


async def burst(
    session: aiohttp.ClientSession, stack: Stack, spec: Load, first: int
) -> list[Posted]:
    """``spec.burst`` POSTs from ``spec.clients`` clients, each sending its next
    as soon as the last is answered (a closed loop)."""
    numbers = iter(range(first, first + spec.burst))
    posted: list[Posted] = []

    async def client() -> None:
        for i in numbers:
            posted.append(await post(session, stack, i))

    await asyncio.gather(*(client() for _ in range(spec.clients)))
    return posted


async def stage_times(database_url: str) -> dict[str, tuple[float, float]]:
    """Per job, by the database's clock (this machine's): the job row's insert
    (API) and the outbox row's insert (worker)."""
    sql = """
    SELECT j.job_id::text, extract(epoch FROM j.created_at)::float8,
           extract(epoch FROM o.created_at)::float8
      FROM jobs j JOIN outbox o ON o.dedupe_key = 'summary_ready:' || j.job_id::text
    """
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        rows = await (await conn.execute(sql)).fetchall()
    return {str(r[0]): (float(r[1]), float(r[2])) for r in rows}


def latency_report(
    posted: list[Posted], tail: MailboxTail, stages: dict[str, tuple[float, float]]
) -> dict[str, Any]:
    ms: dict[str, list[float]] = collections.defaultdict(list)
    for p in posted:
        if not p.job_id or dedupe_key(p.job_id) not in tail.received:
            continue
        received = tail.received[dedupe_key(p.job_id)]
        ms["post_to_delivered"].append((received - p.sent_at) * 1000)
        ms["post_to_202"].append((p.answered_at - p.sent_at) * 1000)
        if p.job_id in stages:
            job_row, outbox_row = stages[p.job_id]
            ms["post_to_job_row"].append((job_row - p.sent_at) * 1000)
            ms["job_row_to_outbox_row"].append((outbox_row - job_row) * 1000)
            ms["outbox_row_to_delivered"].append((received - outbox_row) * 1000)
    return {
        "latency_ms": percentiles(ms.pop("post_to_delivered", [])),
        "stages_ms": {name: percentiles(values) for name, values in ms.items()},
        "late_start_ms": percentiles([p.late_s * 1000 for p in posted]),
    }


async def checks(stack: Stack, tail: MailboxTail, posted: list[Posted]) -> dict[str, Any]:
    """Every POST 202, every job once and done, one email per job and no other."""
    deliveries = await stack.mail.deliveries()
    accepted = [p.job_id for p in posted if p.status == 202 and p.job_id]
    async with await psycopg.AsyncConnection.connect(stack.ctx.servers.database_url) as db:
        rows = await count(db, "SELECT count(*) FROM jobs")
        done = await count(db, "SELECT count(*) FROM jobs WHERE status = 'done'")
    c: dict[str, Any] = {
        "posted": len(posted),
        "accepted_202": len(accepted),
        "distinct_jobs": len(set(accepted)),
        "job_rows": rows,
        "done": done,
        "provider_effects": int(deliveries["effects"]),
        "provider_requests": int(deliveries["requests"]),
        "mailbox_lines": tail.lines,
    }
    n = len(posted)
    c["ok"] = (
        c["accepted_202"] == c["distinct_jobs"] == rows == done == n
        and c["provider_effects"] == c["provider_requests"] == tail.lines == n
        and set(tail.received) == {dedupe_key(j) for j in accepted}
    )
    return c


async def run_load(stack: Stack, spec: Load, spy_dir: Path | None) -> dict[str, Any]:
    tail = MailboxTail(stack.mailbox)
    connector = aiohttp.TCPConnector(limit=max(spec.in_flight, spec.clients))
    async with aiohttp.ClientSession(connector=connector) as session:
        warm = await warm_up(session, stack, tail, spec.warmup)
        busy_before = await stack.ctx.noise.quiet()
        spies = start_spies(stack, spy_dir)
        for spy in spies.values():
            await spy.attached()
        cpu_before, started = stack.cpu(), time.monotonic()
        timed = await open_loop(session, stack, spec, spec.warmup)
        await tail.wait_for([dedupe_key(p.job_id) for p in timed if p.job_id], within_s=60)
        latency_s, cpu_after = time.monotonic() - started, stack.cpu()
        profiles = await stop_spies(spies, cpu_before, cpu_after, len(timed))
        burst_started = time.monotonic()
        burst_posted = await burst(session, stack, spec, spec.warmup + spec.requests)
        answered_s = time.monotonic() - burst_started
        keys = [dedupe_key(p.job_id) for p in burst_posted if p.job_id]
        await tail.wait_for(keys, within_s=120 + spec.burst * 0.05)
        last = max((tail.received.get(k, 0.0) for k in keys), default=0.0)
        first = min(p.sent_at for p in burst_posted)
    stages = await stage_times(stack.ctx.servers.database_url)
    n = len(timed)
    cpu_ms = {k: round((v - cpu_before.get(k, 0.0)) * 1000 / n, 3) for k, v in cpu_after.items()}
    everything = warm + timed + burst_posted
    return {
        "load": asdict(spec),
        "latency": {
            "requests": n,
            "seconds": round(latency_s, 2),
            "warmup_latency_ms": [
                round((tail.received[dedupe_key(p.job_id)] - p.sent_at) * 1000, 1)
                for p in warm
                if p.job_id
            ],
            **latency_report(timed, tail, stages),
            "goals_ms": LATENCY_GOALS_MS,
            "busy_cores_before": busy_before,
            "cpu_ms_per_request": cpu_ms,
            "profiles": profiles or None,
        },
        "throughput": {
            "requests": len(burst_posted),
            "clients": spec.clients,
            "posts_answered_per_s": round(len(burst_posted) / answered_s, 1),
            "emails_per_s": round(len(burst_posted) / max(last - first, 1e-9), 1),
            "seconds_first_post_to_last_email": round(last - first, 2),
            "latency_ms": latency_report(burst_posted, tail, {})["latency_ms"],
        },
        "checks": await checks(stack, tail, everything),
    }


# -- the profile (--profile): py-spy on api, worker and relay during the latency load


def start_spies(stack: Stack, out: Path | None) -> dict[str, Any]:
    if out is None:
        return {}
    from bench.harness.profile import Spy

    return {
        r: Spy(stack.ctx.children, f"e2e-{r}", stack.procs[r].pid, out, SPY_RATE)
        for r in ("api", "worker", "relay")
    }


async def stop_spies(
    spies: dict[str, Any], before: dict[str, float], after: dict[str, float], n: int
) -> dict[str, Any]:
    report = {}
    for name, spy in spies.items():
        folded = await spy.stop()
        cpu_ms = (after[name] - before[name]) * 1000 / n
        report[name] = {"folded": str(folded), **top_frames(folded, round(cpu_ms, 3))}
    return report


def top_frames(folded: Path, cpu_ms_per_request: float) -> dict[str, Any]:
    """Inclusive share of samples per function, and that share of the CPU per
    request. Samples whose innermost frame is the event loop itself are left
    out (between requests py-spy cannot tell uvloop waiting from working), and
    so are frames under nearly every sample (the entry points)."""
    counts: collections.Counter[str] = collections.Counter()
    total = in_loop = 0
    for line in folded.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or stack.startswith("Thread._bootstrap"):
            continue
        frames = stack.split(";")
        if frames[-1].startswith("Runner.run ("):
            in_loop += int(n)
            continue
        total += int(n)
        for frame in {f.rsplit(":", 1)[0] + ")" for f in frames}:
            counts[frame] += int(n)
    top = [(f, n / (total or 1)) for f, n in counts.most_common()]
    return {
        "loop_leaf_share": round(in_loop / ((total + in_loop) or 1), 3),
        "cpu_ms_per_request": cpu_ms_per_request,
        "top_frames": {
            f: [round(share, 3), round(share * cpu_ms_per_request, 3)]
            for f, share in [t for t in top if t[1] < 0.9][:TOP_FRAMES]
        },
    }


# -- the benchmark -------------------------------------------------------------------


async def bench_main(ctx: Context) -> tuple[list[Headline], dict[str, Any], bool]:
    stack = Stack(ctx)
    await stack.start()
    spy_dir = ctx.log_dir if ctx.args.profile else None
    detail = await run_load(stack, load(ctx.smoke), spy_dir)
    for proc in stack.procs.values():
        Children.stop(proc)
    latency = detail["latency"]["latency_ms"]
    headline = [
        Headline(
            "end to end: POST → email p50",
            latency.get("p50"),
            "ms",
            at_most=LATENCY_GOALS_MS["p50"],
        ),
        Headline(
            "end to end: POST → email p99",
            latency.get("p99"),
            "ms",
            at_most=LATENCY_GOALS_MS["p99"],
        ),
        Headline("end to end: throughput, emails/s", detail["throughput"]["emails_per_s"], "/s"),
    ]
    return headline, detail, bool(detail["checks"]["ok"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(
        "end_to_end",
        __doc__ or "",
        rounds=1,
        noise=Noise(0.3, 10.0, 0, 10.0),
        profile="py-spy api, worker and relay during the latency load",
    )
    return p.parse_args(argv)


if __name__ == "__main__":
    main(
        "end_to_end",
        "POST → email through real api, worker and relay processes",
        parse_args(),
        bench_main,
    )
