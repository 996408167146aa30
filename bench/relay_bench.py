"""The outbox relay against a minimal relay, and end-to-end latency, in one run.

Relay throughput: N outbox rows already in Postgres, drained by

- ``oncely``: a real ``oncely relay`` process (leases with an owner fence,
  attempts counted at claim, classified retries with backoff, a timeout per
  lease, LISTEN/NOTIFY, metrics and logs; its sender the ``EffectRouter``
  rendering the summaries email topic for the HTTP email sender);
- ``minimal``: the same sends and updates with none of the guarantees,
  written here: one keyset SELECT of unsent rows per batch, the summaries
  email (``render_email``) POSTed with aiohttp and the Idempotency-Key,
  ``concurrency`` at a time without waiting for a batch to finish, one UPDATE
  of ``sent_at`` per row;
- ``minimal_batched``: the same, with the updates batched (one UPDATE for
  all rows sent since the last one).

against the fake mail provider answering at once and after 50 ms. Each relay
is its own process (the minimal ones run this file with ``--minimal-relay``)
and so is the provider, so CPU is read per process from ``/proc``.

End-to-end latency: ``oncely api``, ``worker`` and ``relay`` with the fake
model and mail provider, all real processes; requests at a modest rate (an
open loop), each timed from sending the POST to the email's ``received_at``
in the provider's mailbox (one clock: this machine's).

    .venv/bin/python bench/relay_bench.py --quick       # smoke run, < 40 s
    .venv/bin/python bench/relay_bench.py               # ~4 min
    .venv/bin/python bench/relay_bench.py --redis-url … --database-url …
    .venv/bin/python bench/relay_bench.py --profile DIR  # py-spy: where relay CPU goes

Given servers are not embedded ones: the benchmark FLUSHES the Redis database
and TRUNCATES jobs, results and outbox in the given database.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import psycopg
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool
from redis.asyncio import Redis

from oncely.builtin.summaries import SUMMARY_READY, dedupe_key, render_email
from oncely.errors import PermanentError
from oncely.fakes.mail import MESSAGES_PATH
from oncely.sql import query

# The harness the worker benchmark uses: children, noise, servers, provenance.
from worker_bench import (
    API_KEY,
    Children,
    FakeModelProcess,
    Noise,
    Probes,
    clean_env,
    cpu_s,
    free_port,
    machine_busy_s,
    machine_info,
    py_spy,
    servers,
    source_state,
    wait_for_quiet,
)

GOAL = 0.85
LATENCY_GOALS_MS = {"p50": 20.0, "p99": 100.0}
# oncely's defaults, which the minimal relay gets too: relay concurrency and
# batch (Settings.relay_*), Postgres pool (pg_pool_min/max), HTTP connections
# and timeout (HttpEmailSender, sender_timeout_s).
CONCURRENCY = 64
BATCH = 100
PG_POOL_MIN, PG_POOL_MAX = 2, 20
HTTP_CONNECTIONS = 128
SEND_TIMEOUT_S = 10.0
POLL_S = 0.02
READY_POLL_S = 0.005
IDLE_POLL_S = 0.05
MAILBOX_POLL_S = 0.01
TENANT = "bench"
KINDS = ("oncely", "minimal", "minimal_batched")


# -- what runs --------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    name: str
    delay_s: float  # the provider's answer time
    rows: int
    kinds: tuple[str, ...]


@dataclass(frozen=True)
class Load:
    """The end-to-end part: ``warmup`` requests one at a time, then ``requests``
    at ``rate_per_s`` (an open loop, at most ``in_flight`` outstanding)."""

    requests: int
    warmup: int
    rate_per_s: float
    in_flight: int = 32


def scenarios(quick: bool) -> list[Scenario]:
    if quick:  # every contender once, a few rows each
        return [
            Scenario("instant", 0.0, 400, KINDS),
            Scenario("provider_50ms", 0.05, 400, KINDS[:2]),
        ]
    return [Scenario("instant", 0.0, 3000, KINDS), Scenario("provider_50ms", 0.05, 3000, KINDS)]


def load(quick: bool) -> Load:
    return Load(40, 5, 20.0) if quick else Load(300, 20, 20.0)


# -- the minimal relay (its own process) --------------------------------------------

# The minimal relay's own SQL, not oncely's: no lease, no owner, no attempts.
MINIMAL_READ = """
SELECT id, topic, dedupe_key, payload FROM outbox
 WHERE sent_at IS NULL AND id > %s
 ORDER BY id
 LIMIT %s
"""
MINIMAL_MARK_ONE = "UPDATE outbox SET sent_at = now(), provider_message_id = %s WHERE id = %s"
MINIMAL_MARK_MANY = """
UPDATE outbox o SET sent_at = now(), provider_message_id = v.message_id
  FROM unnest(%s::bigint[], %s::text[]) AS v(id, message_id)
 WHERE o.id = v.id
"""

Row = tuple[int, str, str, dict[str, Any]]


class MinimalRelay:
    """oncely's sends and updates with none of its guarantees: no lease or
    owner fence, no attempts, retries or backoff, no NOTIFY, metrics or logs.
    Rows are read once, in id order; a failed send is printed and forgotten."""

    def __init__(
        self,
        pool: AsyncConnectionPool,
        session: aiohttp.ClientSession,
        url: str,
        *,
        batch: int,
        concurrency: int,
        batched_updates: bool,
    ) -> None:
        self.pool = pool
        self.session = session
        self.url = url
        self.batch = batch
        self.batched_updates = batched_updates
        self._slots = asyncio.Semaphore(concurrency)
        self._tasks: set[asyncio.Task[None]] = set()
        self._sent: list[tuple[int, str | None]] = []
        self._flush_wanted = asyncio.Event()

    async def run(self) -> None:
        flusher = asyncio.create_task(self._flush_forever())
        last_id = 0
        try:
            while True:
                rows = await self._read(last_id)
                if not rows:
                    await asyncio.sleep(IDLE_POLL_S)
                    continue
                for row in rows:
                    await self._slots.acquire()  # released when the row is done
                    task = asyncio.create_task(self._relay(row))
                    self._tasks.add(task)
                    task.add_done_callback(self._finished)
                last_id = rows[-1][0]
        finally:
            flusher.cancel()
            if self._tasks:
                await asyncio.wait(self._tasks, timeout=5)
            await self._flush()

    async def _read(self, after_id: int) -> list[Row]:
        async with self.pool.connection() as conn:
            cur = await conn.execute(MINIMAL_READ, (after_id, self.batch))
            return await cur.fetchall()

    async def _relay(self, row: Row) -> None:
        try:
            row_id, topic, key, payload = row
            message_id = await self._send(topic, payload, key)
            if self.batched_updates:
                self._sent.append((row_id, message_id))
                self._flush_wanted.set()
            else:
                async with self.pool.connection() as conn:
                    await conn.execute(MINIMAL_MARK_ONE, (message_id, row_id))
        finally:
            self._slots.release()

    async def _send(self, topic: str, payload: dict[str, Any], key: str) -> str | None:
        if topic != SUMMARY_READY:  # what the router's topic lookup refuses
            raise PermanentError(f"no email for topic {topic!r}")
        body = json.dumps(asdict(render_email(payload))).encode()
        headers = {"Content-Type": "application/json", "Idempotency-Key": key}
        async with self.session.post(self.url, data=body, headers=headers) as response:
            answer = await response.read()
            response.raise_for_status()
        message_id = json.loads(answer).get("id")
        return None if message_id is None else str(message_id)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            print(f"minimal relay: send failed: {task.exception()!r}", file=sys.stderr)

    async def _flush_forever(self) -> None:
        while True:
            await self._flush_wanted.wait()
            self._flush_wanted.clear()
            await self._flush()

    async def _flush(self) -> None:
        sent, self._sent = self._sent, []
        if sent:
            ids, message_ids = zip(*sent, strict=True)
            async with self.pool.connection() as conn:
                await conn.execute(MINIMAL_MARK_MANY, (list(ids), list(message_ids)))


async def minimal_main(args: argparse.Namespace) -> None:
    pool = AsyncConnectionPool(
        args.database_url,
        min_size=PG_POOL_MIN,
        max_size=PG_POOL_MAX,
        open=False,
        kwargs={"autocommit": True},
    )
    await pool.open(wait=True)
    connector = aiohttp.TCPConnector(limit=HTTP_CONNECTIONS)
    timeout = aiohttp.ClientTimeout(total=SEND_TIMEOUT_S)
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            relay = MinimalRelay(
                pool,
                session,
                args.sender_url,
                batch=args.batch,
                concurrency=args.concurrency,
                batched_updates=args.batched_updates,
            )
            task = asyncio.create_task(relay.run())
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, task.cancel)
            with contextlib.suppress(asyncio.CancelledError):
                await task
    finally:
        await pool.close()


# -- the fake mail provider (its own process) -----------------------------------------


@dataclass(frozen=True)
class FakeMail:
    """``oncely fake-mail`` in its own process, so its CPU is its own."""

    name: str
    proc: subprocess.Popen[bytes]
    root_url: str

    @classmethod
    def start(cls, children: Children, name: str, mailbox: Path | None = None) -> FakeMail:
        port = free_port()
        argv = [sys.executable, "-m", "oncely", "fake-mail", "--port", str(port)]
        argv += ["--mailbox", str(mailbox)] if mailbox else []
        proc = children.start(name, argv, clean_env(log_level="WARNING"))
        return cls(name, proc, f"http://127.0.0.1:{port}")

    @property
    def messages_url(self) -> str:
        return self.root_url + MESSAGES_PATH

    async def wait_ready(self, session: aiohttp.ClientSession, children: Children) -> None:
        for _ in range(600):
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(f"{self.root_url}/_deliveries") as r:
                    if r.status == 200:
                        return
            if self.proc.poll() is not None:
                break
            await asyncio.sleep(0.05)
        raise RuntimeError(f"fake mail did not start: {children.log_tail(self.name)}")

    async def reset(self, session: aiohttp.ClientSession, delay_s: float = 0.0) -> None:
        """Forget every delivery (and truncate the mailbox); then answer after ``delay_s``."""
        async with session.post(f"{self.root_url}/_reset") as r:
            r.raise_for_status()
        async with session.post(f"{self.root_url}/_faults", json={"delay_s": delay_s}) as r:
            r.raise_for_status()

    async def deliveries(self, session: aiohttp.ClientSession) -> dict[str, Any]:
        async with session.get(f"{self.root_url}/_deliveries") as r:
            r.raise_for_status()
            answer: dict[str, Any] = await r.json()
            return answer


# -- relay throughput: measuring ---------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    at: float
    relay: float
    provider: float
    harness: float
    servers: dict[int, float] | None
    machine_busy: float

    @classmethod
    def take(cls, probes: Probes, relay: psutil.Process, provider: psutil.Process) -> Snapshot:
        return cls(
            time.monotonic(),
            cpu_s(relay),
            cpu_s(provider),
            cpu_s(probes.harness),
            probes.servers(),
            machine_busy_s(),
        )


@dataclass
class RelayRun:
    contender: str
    rows: int
    seconds: float = 0.0  # first send at the provider -> every row sent_at
    rows_per_s: float = 0.0
    startup_s: float = 0.0  # process start -> first send
    seconds_incl_startup: float = 0.0
    rows_per_s_incl_startup: float = 0.0
    cpu_ms_per_row: float = 0.0  # the relay process, first send -> all sent
    startup_cpu_ms: float = 0.0
    provider_cpu_ms_per_row: float = 0.0
    servers_cpu_ms_per_row: float | None = None  # Postgres (+ idle Valkey), embedded only
    machine_busy_cores: float = 0.0
    foreign_cores: float | None = None  # busy CPU none of this benchmark's processes used
    busy_cores_before: float | None = None
    noise_retries: int = 0
    ok: bool = False
    checks: dict[str, int | bool] = field(default_factory=dict)
    error: str | None = None


def measure(kind: str, rows: int, spawned: float, ready: Snapshot, done: Snapshot) -> RelayRun:
    run_s = max(done.at - ready.at, 1e-9)
    total_s = done.at - spawned
    relay = done.relay - ready.relay
    provider = done.provider - ready.provider
    busy = done.machine_busy - ready.machine_busy
    servers_s = _servers_cpu(ready, done)
    harness = done.harness - ready.harness
    return RelayRun(
        contender=kind,
        rows=rows,
        seconds=round(run_s, 3),
        rows_per_s=round(rows / run_s, 1),
        startup_s=round(ready.at - spawned, 3),
        seconds_incl_startup=round(total_s, 3),
        rows_per_s_incl_startup=round(rows / total_s, 1),
        cpu_ms_per_row=round(relay * 1000 / rows, 3),
        startup_cpu_ms=round(ready.relay * 1000, 1),
        provider_cpu_ms_per_row=round(provider * 1000 / rows, 3),
        servers_cpu_ms_per_row=None if servers_s is None else round(servers_s * 1000 / rows, 3),
        machine_busy_cores=round(busy / run_s, 2),
        foreign_cores=None
        if servers_s is None
        else round((busy - relay - provider - servers_s - harness) / run_s, 2),
    )


def _servers_cpu(ready: Snapshot, done: Snapshot) -> float | None:
    if ready.servers is None or done.servers is None:
        return None
    return sum(cpu - ready.servers.get(pid, 0.0) for pid, cpu in done.servers.items())


class RelayBench:
    """The outbox and the provider per run: reset, load, drain, check."""

    def __init__(
        self,
        urls: tuple[str, str],
        mail: FakeMail,
        children: Children,
        probes: Probes,
        session: aiohttp.ClientSession,
        batch: int | None,
    ) -> None:
        self.redis_url, self.database_url = urls
        self.mail = mail
        self.provider = psutil.Process(mail.proc.pid)
        self.children = children
        self.probes = probes
        self.session = session
        self.batch = batch  # None: oncely's default
        self._db: psycopg.AsyncConnection[Any] | None = None

    @property
    def db(self) -> psycopg.AsyncConnection[Any]:
        assert self._db is not None
        return self._db

    async def open(self) -> None:
        self._db = await psycopg.AsyncConnection.connect(self.database_url, autocommit=True)
        await self.mail.wait_ready(self.session, self.children)

    async def close(self) -> None:
        if self._db is not None:
            await self._db.close()

    async def fresh_state(self, delay_s: float) -> None:
        await self.db.execute("TRUNCATE outbox RESTART IDENTITY")
        await self.mail.reset(self.session, delay_s)

    async def preload(self, rows: int) -> None:
        """Rows the way the worker leaves them (``insert_outbox``), then vacuumed state."""
        params = []
        for i in range(rows):
            job_id = str(uuid.uuid4())
            payload = {"job_id": job_id, "to": f"user{i}@example.com", "summary": _summary(i)}
            params.append((SUMMARY_READY, dedupe_key(job_id), Jsonb(payload)))
        async with self.db.cursor() as cur:
            await cur.executemany(query("insert_outbox"), params)
        await self.db.execute("ANALYZE outbox")
        with contextlib.suppress(psycopg.Error):
            await self.db.execute("CHECKPOINT")

    def spawn(self, kind: str) -> subprocess.Popen[bytes]:
        if kind == "oncely":
            argv = [sys.executable, "-m", "oncely", "relay"]
            settings = {
                "redis_url": self.redis_url,
                "database_url": self.database_url,
                "sender_url": self.mail.messages_url,
                "relay_concurrency": str(CONCURRENCY),
                "log_level": "WARNING",
            }
            if self.batch is not None:
                settings["relay_batch"] = str(self.batch)
            return self.children.start(kind, argv, clean_env(**settings))
        argv = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--minimal-relay",
            f"--database-url={self.database_url}",
            f"--sender-url={self.mail.messages_url}",
            f"--concurrency={CONCURRENCY}",
            f"--batch={self.batch or BATCH}",
            *(["--batched-updates"] if kind == "minimal_batched" else []),
        ]
        return self.children.start(kind, argv, clean_env())

    async def first_send(self, proc: subprocess.Popen[bytes], within_s: float) -> None:
        """Until the provider saw a request: the relay is up and sending."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline and proc.poll() is None:
            if (await self.mail.deliveries(self.session))["requests"] > 0:
                return
            await asyncio.sleep(READY_POLL_S)
        raise RuntimeError("the relay never sent")

    async def all_sent(self, proc: subprocess.Popen[bytes], within_s: float) -> None:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline and proc.poll() is None:
            if await self._count("sent_at IS NULL AND failed_at IS NULL") == 0:
                return
            await asyncio.sleep(POLL_S)
        left = await self._count("sent_at IS NULL")
        raise RuntimeError(f"{left} rows unsent when the wait ended")

    async def checks(self, rows: int) -> dict[str, int | bool]:
        seen = await self.mail.deliveries(self.session)
        cur = await self.db.execute("SELECT dedupe_key FROM outbox")
        keys = {str(row[0]) for row in await cur.fetchall()}
        return {
            "rows": rows,
            "sent": await self._count("sent_at IS NOT NULL"),
            "failed": await self._count("failed_at IS NOT NULL"),
            "provider_effects": int(seen["effects"]),
            "provider_requests": int(seen["requests"]),
            "keys_sent_twice": sum(1 for n in seen["by_key"].values() if n > 1),
            "effects_are_the_rows": set(seen["by_key"]) == keys,
        }

    async def _count(self, where: str) -> int:
        row = await (await self.db.execute(f"SELECT count(*) FROM outbox WHERE {where}")).fetchone()
        return int(row[0]) if row else 0


def _summary(i: int) -> str:
    return (
        f"Ticket {i}: invoice {1000 + i} was charged twice; support refunded the second "
        "charge and the customer confirmed the refund."
    )


def _timeout_s(scenario: Scenario) -> float:
    return 60 + scenario.rows * (0.01 + scenario.delay_s / CONCURRENCY) * 3


async def run_one(bench: RelayBench, kind: str, scenario: Scenario, noise: Noise) -> RelayRun:
    await bench.fresh_state(scenario.delay_s)
    await bench.preload(scenario.rows)
    busy_before = await wait_for_quiet(noise)
    spawned = time.monotonic()
    proc = bench.spawn(kind)
    ps = psutil.Process(proc.pid)
    try:
        await bench.first_send(proc, within_s=60)
        ready = Snapshot.take(bench.probes, ps, bench.provider)
        await bench.all_sent(proc, _timeout_s(scenario))
        done = Snapshot.take(bench.probes, ps, bench.provider)
    except RuntimeError as exc:
        Children.kill(proc)
        error = f"{exc}; log: {bench.children.log_tail(kind)}"
        return RelayRun(kind, scenario.rows, error=error)
    result = measure(kind, scenario.rows, spawned, ready, done)
    result.busy_cores_before = busy_before
    result.checks = c = await bench.checks(scenario.rows)
    # Every row is sent and recorded (checked): nothing is left to finish.
    Children.kill(proc)
    n = scenario.rows
    result.ok = c["sent"] == c["provider_effects"] == n and not c["failed"]
    result.ok = result.ok and bool(c["effects_are_the_rows"])
    return result


async def run_quiet(bench: RelayBench, kind: str, scenario: Scenario, noise: Noise) -> RelayRun:
    for attempt in range(noise.retries + 1):
        result = await run_one(bench, kind, scenario, noise)
        result.noise_retries = attempt
        if result.foreign_cores is None or result.foreign_cores <= noise.max_cores:
            break
    return result


async def run_scenario(
    bench: RelayBench, scenario: Scenario, repeat: int, noise: Noise
) -> dict[str, Any]:
    runs: dict[str, list[RelayRun]] = {kind: [] for kind in scenario.kinds}
    # Round-robin, so drift over time hits each contender alike.
    for round_no in range(repeat):
        for kind in scenario.kinds:
            result = await run_quiet(bench, kind, scenario, noise)
            _progress(scenario, round_no, result)
            runs[kind].append(result)
    return {
        "scenario": scenario.name,
        "provider_delay_s": scenario.delay_s,
        "results": {kind: median_run(rs) for kind, rs in runs.items()},
        "ratios": ratios(runs),
    }


def median_run(runs: list[RelayRun]) -> dict[str, Any]:
    """The run with the median throughput, and every run's throughput and CPU."""
    ordered = sorted(runs, key=lambda r: r.rows_per_s)
    chosen = asdict(ordered[(len(ordered) - 1) // 2])
    if len(runs) > 1:
        chosen["runs_rows_per_s"] = [r.rows_per_s for r in runs]
        chosen["runs_cpu_ms_per_row"] = [r.cpu_ms_per_row for r in runs]
    return chosen


def ratios(runs: dict[str, list[RelayRun]]) -> dict[str, Any]:
    """oncely over each minimal relay: the median of per-round ratios (the two
    ran back to back, so a shared machine's drift cancels out)."""
    out: dict[str, Any] = {"goal": GOAL}
    for kind in KINDS[1:]:
        if "oncely" not in runs or kind not in runs:
            continue
        pairs = [(o, m) for o, m in zip(runs["oncely"], runs[kind], strict=True) if o.ok and m.ok]
        if not pairs:
            continue
        throughput = round(statistics.median(o.rows_per_s / m.rows_per_s for o, m in pairs), 3)
        out[f"oncely_vs_{kind}"] = {
            "throughput": throughput,
            "throughput_per_round": [round(o.rows_per_s / m.rows_per_s, 3) for o, m in pairs],
            "throughput_incl_startup": round(
                statistics.median(
                    o.rows_per_s_incl_startup / m.rows_per_s_incl_startup for o, m in pairs
                ),
                3,
            ),
            "cpu_per_row": round(
                statistics.median(o.cpu_ms_per_row / m.cpu_ms_per_row for o, m in pairs), 3
            ),
            "meets_goal": throughput >= GOAL,
        }
    return out


def _progress(scenario: Scenario, round_no: int, r: RelayRun) -> None:
    status = "ok" if r.ok else f"FAILED {r.error or r.checks}"
    status += f"  other work {r.busy_cores_before}/{r.foreign_cores} cores before/during"
    status += f" (retry {r.noise_retries})" if r.noise_retries else ""
    print(
        f"[{scenario.name} #{round_no + 1}] {r.contender:<16} {r.rows:>5} rows "
        f"{r.seconds:>6.2f} s {r.rows_per_s:>7.1f} rows/s {r.cpu_ms_per_row:>6.3f} CPU ms/row "
        f"provider {r.provider_cpu_ms_per_row:.3f} busy {r.machine_busy_cores:.2f} cores  {status}",
        file=sys.stderr,
        flush=True,
    )


# -- end to end: POST -> email at the provider -----------------------------------------------


@dataclass(frozen=True)
class Posted:
    idempotency_key: str
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


@dataclass
class Stack:
    """Every oncely process of the end-to-end path, and how to reach them."""

    procs: dict[str, subprocess.Popen[bytes]]
    api_url: str
    mail: FakeMail
    mailbox: Path
    env: dict[str, str]
    key: str = ""


async def start_stack(
    urls: tuple[str, str], fake: FakeModelProcess, children: Children, tmp: Path
) -> Stack:
    mailbox = tmp / "mailbox.jsonl"
    mail = FakeMail.start(children, "e2e-fake-mail", mailbox)
    port = free_port()
    env = clean_env(
        redis_url=urls[0],
        database_url=urls[1],
        llm_base_url=fake.url,
        llm_api_key=API_KEY,
        sender_url=mail.messages_url,
        relay_concurrency=str(CONCURRENCY),
        log_level="WARNING",
    )
    oncely = [sys.executable, "-m", "oncely"]
    procs = {
        "api": children.start("e2e-api", [*oncely, "api", "--port", str(port)], env),
        "worker": children.start("e2e-worker", [*oncely, "worker"], env),
        "relay": children.start("e2e-relay", [*oncely, "relay"], env),
        "fake_mail": mail.proc,
        "fake_llm": fake.proc,
    }
    return Stack(procs, f"http://127.0.0.1:{port}", mail, mailbox, env)


async def wait_api_ready(session: aiohttp.ClientSession, stack: Stack, children: Children) -> None:
    for _ in range(600):
        with contextlib.suppress(aiohttp.ClientError):
            async with session.get(f"{stack.api_url}/readyz") as r:
                if r.status == 200:
                    return
        if stack.procs["api"].poll() is not None:
            break
        await asyncio.sleep(0.05)
    raise RuntimeError(f"the API did not start: {children.log_tail('e2e-api')}")


def create_key(env: dict[str, str]) -> str:
    """``oncely keys create``: the key alone on stdout."""
    argv = [sys.executable, "-m", "oncely", "keys", "create", "--tenant", TENANT]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True, timeout=60)
    return done.stdout.strip()


async def post_summary(
    session: aiohttp.ClientSession, stack: Stack, i: int, late_s: float = 0.0
) -> Posted:
    key = f"relay-bench-{uuid.uuid4()}"
    headers = {"Authorization": f"Bearer {stack.key}", "Idempotency-Key": key}
    body = {"text": _ticket(i), "notify": f"user{i}@example.com"}
    sent_at = time.time()
    async with session.post(f"{stack.api_url}/v1/summaries", json=body, headers=headers) as r:
        answer = await r.json(content_type=None)
        status = r.status
    job_id = answer.get("job_id") if isinstance(answer, dict) else None
    return Posted(key, job_id, status, sent_at, time.time(), late_s)


def _ticket(i: int) -> str:
    return (
        f"Ticket {i}: the customer reports that invoice {1000 + i} was charged twice. "
        "Support refunded the second charge and apologised. The customer confirmed "
        "the refund arrived and closed the ticket."
    )


async def open_loop(session: aiohttp.ClientSession, stack: Stack, spec: Load) -> list[Posted]:
    """``spec.requests`` POSTs on a fixed schedule, whatever the answers take
    (up to ``in_flight`` outstanding): a late answer cannot slow the load."""
    slots = asyncio.Semaphore(spec.in_flight)
    start = time.monotonic() + 0.05

    async def one(i: int, due: float) -> Posted:
        try:
            return await post_summary(session, stack, spec.warmup + i, time.monotonic() - due)
        finally:
            slots.release()

    tasks = []
    for i in range(spec.requests):
        due = start + i / spec.rate_per_s
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        await slots.acquire()
        tasks.append(asyncio.create_task(one(i, due)))
    return list(await asyncio.gather(*tasks))


def percentiles(values: list[float]) -> dict[str, float]:
    """Nearest-rank percentiles, in ms."""
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


async def stage_times(database_url: str) -> dict[str, tuple[float, float, float | None]]:
    """Per job, by the database's clock (this machine's): the job row's insert
    (API), the outbox row's insert (worker) and ``sent_at`` (relay, after the
    provider answered)."""
    sql = """
    SELECT j.job_id::text, extract(epoch FROM j.created_at)::float8,
           extract(epoch FROM o.created_at)::float8, extract(epoch FROM o.sent_at)::float8
      FROM jobs j JOIN outbox o ON o.dedupe_key = 'summary_ready:' || j.job_id::text
    """
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        rows = await (await conn.execute(sql)).fetchall()
    return {str(r[0]): (float(r[1]), float(r[2]), r[3]) for r in rows}


def latency_report(
    posted: list[Posted], tail: MailboxTail, stages: dict[str, tuple[float, float, float | None]]
) -> dict[str, Any]:
    delivered = [p for p in posted if p.job_id and dedupe_key(p.job_id) in tail.received]
    ms: dict[str, list[float]] = collections.defaultdict(list)
    for p in delivered:
        assert p.job_id is not None
        received = tail.received[dedupe_key(p.job_id)]
        ms["post_to_delivered"].append((received - p.sent_at) * 1000)
        ms["post_to_202"].append((p.answered_at - p.sent_at) * 1000)
        if p.job_id in stages:
            job_row, outbox_row, _ = stages[p.job_id]
            ms["post_to_job_row"].append((job_row - p.sent_at) * 1000)
            ms["job_row_to_outbox_row"].append((outbox_row - job_row) * 1000)
            ms["outbox_row_to_delivered"].append((received - outbox_row) * 1000)
    latency = percentiles(ms.pop("post_to_delivered", []))
    return {
        "delivered": len(delivered),
        "latency_ms": latency,
        "stages_ms": {name: percentiles(values) for name, values in ms.items()},
        "late_start_ms": percentiles([p.late_s * 1000 for p in posted]),
        "meets_goals": bool(latency)
        and all(latency[k] <= goal for k, goal in LATENCY_GOALS_MS.items()),
    }


def cpu_of(procs: dict[str, subprocess.Popen[bytes]], probes: Probes) -> dict[str, float]:
    out = {name: cpu_s(psutil.Process(p.pid)) for name, p in procs.items() if p.poll() is None}
    servers_cpu = probes.servers()
    if servers_cpu is not None:
        out["servers"] = sum(servers_cpu.values())
    return out


async def end_to_end(
    urls: tuple[str, str],
    fake: FakeModelProcess,
    children: Children,
    probes: Probes,
    args: argparse.Namespace,
    spy_dir: Path | None = None,
) -> dict[str, Any]:
    """POST -> email, measured; with ``spy_dir``, py-spy on api, worker and
    relay during the load (which slows them: read the shares, not the times)."""
    spec = load(args.quick)
    await fresh_servers(urls)
    stack = await start_stack(urls, fake, children, Path(args.log_dir))
    stack.key = await asyncio.to_thread(create_key, stack.env)
    tail = MailboxTail(stack.mailbox)
    connector = aiohttp.TCPConnector(limit=spec.in_flight)
    async with aiohttp.ClientSession(connector=connector) as session:
        await stack.mail.wait_ready(session, children)
        await wait_api_ready(session, stack, children)
        warm = await warm_up(session, stack, tail, spec, children)
        busy_before = await wait_for_quiet(Noise(args.noise_max_cores, args.quiet_wait_s, 0))
        spies = start_spies(stack, children, spy_dir)
        cpu_before, started = cpu_of(stack.procs, probes), time.monotonic()
        posted = await open_loop(session, stack, spec)
        keys = [dedupe_key(p.job_id) for p in posted if p.job_id]
        await tail.wait_for(keys, within_s=30)
        elapsed, cpu_after = time.monotonic() - started, cpu_of(stack.procs, probes)
        deliveries = await stack.mail.deliveries(session)
    stages = await stage_times(urls[1])
    report = latency_report(posted, tail, stages)
    n = len(posted)
    cpu_ms = {k: round((v - cpu_before.get(k, 0.0)) * 1000 / n, 3) for k, v in cpu_after.items()}
    if spies:
        report["profiles"] = await stop_spies(spies, cpu_ms)
    return {
        "requests": n,
        "warmup": spec.warmup,
        "warmup_latency_ms": warm,
        "rate_per_s": spec.rate_per_s,
        "max_in_flight": spec.in_flight,
        "seconds": round(elapsed, 2),
        "accepted_202": sum(1 for p in posted if p.status == 202),
        **report,
        "goals_ms": LATENCY_GOALS_MS,
        "busy_cores_before": busy_before,
        "cpu_ms_per_request": cpu_ms,
        "checks": {
            "provider_effects": int(deliveries["effects"]),
            "provider_requests": int(deliveries["requests"]),
            "mailbox_lines": tail.lines,
            "expected_effects": n + spec.warmup,
        },
    }


async def fresh_servers(urls: tuple[str, str]) -> None:
    redis = Redis.from_url(urls[0], decode_responses=True)
    try:
        await redis.flushdb()
    finally:
        await redis.aclose()
    async with await psycopg.AsyncConnection.connect(urls[1], autocommit=True) as conn:
        await conn.execute("TRUNCATE jobs, results, outbox, job_deliveries RESTART IDENTITY")


async def warm_up(
    session: aiohttp.ClientSession, stack: Stack, tail: MailboxTail, spec: Load, children: Children
) -> list[float]:
    """One request at a time, each waited for: every process is up and has its
    connections; their latencies are reported apart."""
    latencies = []
    for i in range(spec.warmup):
        p = await post_summary(session, stack, i)
        if p.status != 202 or not p.job_id:
            raise RuntimeError(f"warm-up POST answered {p.status}")
        key = dedupe_key(p.job_id)
        await tail.wait_for([key], within_s=60)
        if key not in tail.received:
            raise RuntimeError("warm-up email never arrived: " + _stack_logs(children))
        latencies.append(round((tail.received[key] - p.sent_at) * 1000, 1))
    return latencies


def _stack_logs(children: Children) -> str:
    names = ("e2e-api", "e2e-worker", "e2e-relay")
    return " | ".join(f"{name}: {children.log_tail(name, 800)}" for name in names)


# -- profiling (--profile): where a relay's CPU goes ---------------------------------------

# Each sample goes to the first bucket one of whose frames contains the needle
# (a bucket may have several needles; py-spy names a frame "qualname (file:line)").
BUCKETS: dict[str, tuple[tuple[str, str], ...]] = {
    "oncely": (
        ("claim: OutboxStore.claim", "OutboxStore.claim"),
        ("mark sent: OutboxStore.mark_sent_many (batched)", "OutboxStore.mark_sent_many"),
        ("send: render_email + body", "render_email"),
        ("send: message_id_from", "message_id_from"),
        ("send: JsonPoster.post (aiohttp)", "JsonPoster.post"),
        ("send: HttpEmailSender.send rest", "HttpEmailSender.send"),
        ("route: EffectRouter.send / _EmailRoute.deliver", "_EmailRoute.deliver"),
        ("route: EffectRouter.send / _EmailRoute.deliver", "EffectRouter.send"),
        ("after send: Relay._sent (metrics, log)", "Relay._sent"),
        ("per row: Relay._deliver (lease, timeout)", "Relay._deliver"),
        ("per row: Relay._relay (slot)", "Relay._relay ("),
        ("wait: Relay._wait_for_work", "Relay._wait_for_work"),
        ("batch: Relay._relay_continuously (starting sends)", "Relay._relay_continuously"),
        ("batch: Relay.run_once (claim + TaskGroup)", "Relay.run_once"),
        ("retention: Relay._clean_up_forever", "Relay._clean_up"),
        ("listener", "Relay._listen"),
        ("loop: Relay.run", "Relay.run"),
    ),
    "minimal": (
        ("read: SELECT batch", "MinimalRelay._read"),
        ("send: render_email + body", "render_email"),
        ("send: render_email + body", "asdict ("),
        ("update: psycopg", "psycopg"),
        ("send: aiohttp POST", "MinimalRelay._send"),
        ("per row: MinimalRelay._relay", "MinimalRelay._relay"),
        ("loop: MinimalRelay.run", "MinimalRelay.run"),
    ),
}


def buckets(folded: Path, kind: str, cpu_ms_per_row: float) -> dict[str, dict[str, float]]:
    rules = BUCKETS["oncely" if kind == "oncely" else "minimal"]
    counts: collections.Counter[str] = collections.Counter()
    for line in folded.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and not stack.startswith("Thread._bootstrap"):  # idle executor threads
            name = next((b for b, needle in rules if needle in stack), "event loop and the rest")
            counts[name] += int(n)
    total = sum(counts.values()) or 1
    return {
        name: {"share": round(n / total, 3), "cpu_ms_per_row": round(n / total * cpu_ms_per_row, 3)}
        for name, n in counts.most_common()
    }


async def profile_one(bench: RelayBench, kind: str, scenario: Scenario, out: Path) -> Any:
    """One run with py-spy on the relay (which slows it: the shares count, not the speed)."""
    await bench.fresh_state(scenario.delay_s)
    await bench.preload(scenario.rows)
    proc = bench.spawn(kind)
    folded = out / f"{kind}-{scenario.name}.folded"
    await bench.first_send(proc, within_s=60)
    ps = psutil.Process(proc.pid)
    cpu_before = cpu_s(ps)
    argv = [py_spy(), "record", "--pid", str(proc.pid), "--rate", "100", "--format", "raw"]
    spy = bench.children.start(f"py-spy-{kind}", [*argv, "-o", str(folded)], clean_env())
    await bench.all_sent(proc, _timeout_s(scenario) * 3)
    cpu_ms_per_row = (cpu_s(ps) - cpu_before) * 1000 / scenario.rows
    spy.send_signal(signal.SIGINT)
    await asyncio.to_thread(spy.wait, 30)
    Children.kill(proc)
    return {
        "contender": kind,
        "scenario": scenario.name,
        "rows": scenario.rows,
        "cpu_ms_per_row_under_py_spy": round(cpu_ms_per_row, 3),
        "folded": str(folded),
        "buckets": buckets(folded, kind, cpu_ms_per_row),
    }


# The end-to-end processes are idle between requests: sample them faster.
E2E_SPY_RATE = 250
TOP_FRAMES = 30


def start_spies(
    stack: Stack, children: Children, out: Path | None
) -> dict[str, tuple[subprocess.Popen[bytes], Path]]:
    spies: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
    for name in ("api", "worker", "relay") if out else ():
        assert out is not None
        folded = out / f"e2e-{name}.folded"
        pid = str(stack.procs[name].pid)
        argv = [py_spy(), "record", "--pid", pid, "--rate", str(E2E_SPY_RATE), "--format", "raw"]
        spy = children.start(f"py-spy-e2e-{name}", [*argv, "-o", str(folded)], clean_env())
        spies[name] = (spy, folded)
    return spies


async def stop_spies(
    spies: dict[str, tuple[subprocess.Popen[bytes], Path]], cpu_ms: dict[str, float]
) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for name, (spy, folded) in spies.items():
        spy.send_signal(signal.SIGINT)
        await asyncio.to_thread(spy.wait, 30)
        report[name] = {"folded": str(folded), **top_frames(folded, cpu_ms[name])}
    return report


def top_frames(folded: Path, cpu_ms_per_request: float) -> dict[str, Any]:
    """Inclusive share of samples per function (file, not line), and that share
    of the CPU per request. Samples whose innermost frame is the event loop
    itself are left out: between requests py-spy cannot tell uvloop waiting in
    epoll from uvloop working, so they are reported apart. Frames under nearly
    every sample (the process's entry points) are left out too."""
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


# -- the run --------------------------------------------------------------------------------


async def bench_main(
    args: argparse.Namespace,
    urls: tuple[str, str],
    pgdata: Path | None,
    fake: FakeModelProcess,
    children: Children,
) -> dict[str, Any]:
    await asyncio.to_thread(oncely_migrate, urls)
    mail = FakeMail.start(children, "fake-mail")
    probes = Probes(pgdata)
    async with aiohttp.ClientSession() as session:
        bench = RelayBench(urls, mail, children, probes, session, args.relay_batch)
        try:
            await bench.open()
            await fake.wait_ready(children)
            if args.profile:
                return await profile_main(args, bench, urls, fake, probes)
            return await compare(args, bench, urls, fake, probes)
        finally:
            await bench.close()


async def compare(
    args: argparse.Namespace,
    bench: RelayBench,
    urls: tuple[str, str],
    fake: FakeModelProcess,
    probes: Probes,
) -> dict[str, Any]:
    source = source_state()
    started = time.monotonic()
    noise = Noise(args.noise_max_cores, args.quiet_wait_s, args.noise_retries)
    relay = [await run_scenario(bench, s, args.repeat, noise) for s in scenarios(args.quick)]
    e2e = None if args.no_e2e else await end_to_end(urls, fake, bench.children, probes, args)
    return {
        "benchmark": "oncely relay vs minimal relay; end-to-end latency POST -> email",
        "quick": args.quick,
        "repeat": args.repeat,
        "noise": asdict(noise),
        "machine": machine_info() | await server_info(bench) | {"servers": args.servers},
        "oncely_source": source,
        "src_changed_during_run": _changed(source),
        "relay": {
            "concurrency": CONCURRENCY,
            "batch": args.relay_batch or BATCH,
            "scenarios": relay,
        },
        "end_to_end": e2e,
        "total_s": round(time.monotonic() - started, 1),
    }


async def profile_main(
    args: argparse.Namespace,
    bench: RelayBench,
    urls: tuple[str, str],
    fake: FakeModelProcess,
    probes: Probes,
) -> dict[str, Any]:
    out = Path(args.profile)
    profiles = []
    rows = args.profile_rows
    lineup = (Scenario("instant", 0.0, rows, KINDS), Scenario("provider_50ms", 0.05, rows, KINDS))
    for scenario in lineup:
        for kind in ("oncely", "minimal"):
            profiles.append(await profile_one(bench, kind, scenario, out))
    e2e = await end_to_end(urls, fake, bench.children, probes, args, spy_dir=out)
    return {"profiles": profiles, "end_to_end": e2e}


def oncely_migrate(urls: tuple[str, str]) -> None:
    """``oncely migrate``, as an operator runs it."""
    env = clean_env(redis_url=urls[0], database_url=urls[1], log_level="WARNING")
    argv = [sys.executable, "-m", "oncely", "migrate"]
    subprocess.run(argv, env=env, capture_output=True, check=True, timeout=120)


async def server_info(bench: RelayBench) -> dict[str, Any]:
    info: dict[str, Any] = {}
    for setting in ("server_version", "synchronous_commit", "fsync", "shared_buffers"):
        row = await (await bench.db.execute(f"SHOW {setting}")).fetchone()
        info[f"postgres_{setting}"] = row[0] if row else None
    return info


def _changed(before: dict[str, str]) -> bool:
    """Whether src/ (which each relay and process imports at start) changed;
    a new commit that leaves src/ alone is no change."""
    after = source_state()
    changed = (after["src_sha256"], after["uncommitted"]) != (
        before["src_sha256"],
        before["uncommitted"],
    )
    if changed:
        print("WARNING: src/ changed during the run; results mix versions", file=sys.stderr)
    return changed


# -- entry point ------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smoke run, < 40 s")
    p.add_argument("--repeat", type=int, default=None, help="runs per contender (median kept)")
    p.add_argument(
        "--redis-url",
        default=os.environ.get("ONCELY_BENCH_REDIS_URL"),
        help="use this Redis, FLUSHED before the end-to-end part (env ONCELY_BENCH_REDIS_URL)",
    )
    p.add_argument(
        "--database-url",
        default=os.environ.get("ONCELY_BENCH_DATABASE_URL"),
        help="use this database; jobs, results and outbox are TRUNCATED "
        "(env ONCELY_BENCH_DATABASE_URL)",
    )
    p.add_argument("--out", help="also write the JSON document to this file")
    p.add_argument("--no-e2e", action="store_true", help="relay throughput only")
    p.add_argument("--relay-batch", type=int, help="ONCELY_RELAY_BATCH (default: oncely's, 100)")
    p.add_argument(
        "--noise-max-cores",
        type=float,
        default=0.3,
        help="other work on the machine tolerated before and during a run (cores)",
    )
    p.add_argument("--quiet-wait-s", type=float, help="longest wait for a quiet machine")
    p.add_argument("--noise-retries", type=int, help="runs again after a noisy run")
    p.add_argument("--log-dir", help="children's logs and the mailbox (default: a temp dir)")
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="instead of the comparison: py-spy the oncely and minimal relays, write "
        "folded stacks to DIR and print CPU per bucket",
    )
    p.add_argument("--profile-rows", type=int, default=6000, help=argparse.SUPPRESS)
    # The minimal relay, run by the benchmark itself:
    p.add_argument("--minimal-relay", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--sender-url", help=argparse.SUPPRESS)
    p.add_argument("--concurrency", type=int, default=CONCURRENCY, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=BATCH, help=argparse.SUPPRESS)
    p.add_argument("--batched-updates", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    # Five rounds: a shared VM drifts by ±20 % between runs seconds apart.
    defaults = (1, 0.0, 0) if args.quick else (5, 15.0, 1)
    for name, default in zip(("repeat", "quiet_wait_s", "noise_retries"), defaults, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, default)
    return args


def main() -> None:
    from oncely.logs import configure_logging

    configure_logging("console", "WARNING")  # stdout carries the JSON document only
    args = parse_args()
    if args.minimal_relay:
        import uvloop  # what `oncely relay` runs on too

        uvloop.run(minimal_main(args))
        return
    # SIGTERM unwinds like Ctrl-C, so every finally (children, servers) runs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="oncely-relay-bench-") as tmp:
        args.log_dir = args.log_dir or tmp
        for folder in (args.log_dir, args.profile):
            if folder:
                Path(folder).mkdir(parents=True, exist_ok=True)
        children = Children(Path(args.log_dir))
        try:
            fake = FakeModelProcess.start(children)  # imports while the servers start
            with servers(args, Path(tmp)) as (redis_url, database_url, pgdata):
                urls = (redis_url, database_url)
                report = asyncio.run(bench_main(args, urls, pgdata, fake, children))
        finally:
            children.close()
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
