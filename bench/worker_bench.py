"""The worker against a floor: how much of the machine do oncely's guarantees cost?

One run, the same jobs, side by side:

- ``oncely``: a real ``oncely worker --workflow summaries`` process (the
  summaries workflow's ``WorkflowHandler`` under a ``Worker``: pre-check,
  fleet limiter, classified retries, owner-checked Lua acks, leases, index,
  NOTIFY, reconciler);
- ``floor_openai``: the same work with none of the guarantees, written here:
  batched XREADGROUP, one model call per message through the same openai SDK
  on its aiohttp transport, one transaction (result + outbox row + job done,
  a single statement on an autocommit connection), batched XACK;
- ``floor_aiohttp``: the same floor with raw aiohttp instead of the SDK.

Each contender is its own process (the floors run this file with
``--floor-consumer``), so its CPU is read the same way, from ``/proc``; the
fake model is a third process. Every run starts from flushed Redis and
truncated tables, with the jobs already in Postgres and in the stream.

    .venv/bin/python bench/worker_bench.py --quick       # smoke run, < 30 s
    .venv/bin/python bench/worker_bench.py               # a few minutes
    .venv/bin/python bench/worker_bench.py --redis-url … --database-url …
    .venv/bin/python bench/worker_bench.py --profile DIR  # py-spy: where CPU goes

Given servers are not embedded ones: the benchmark FLUSHES the Redis database
and TRUNCATES jobs, results and outbox in the given database.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import ctypes
import hashlib
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import psycopg
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool
from redis.asyncio import Redis

from oncely.builtin.summaries import INSTRUCTION, SUMMARY_READY, dedupe_key, summaries
from oncely.sql import query

GOAL = 0.85
MODEL = "oncely-fake"
API_KEY = "oncely-bench"
TENANT = "bench"
# oncely's defaults (Settings.pg_pool_min/max): the floors get the same pool.
PG_POOL_MIN, PG_POOL_MAX = 2, 20
# The SDK's aiohttp transport opens at most this many connections (openai's
# DEFAULT_CONNECTION_LIMITS); raw aiohttp gets the same.
HTTP_CONNECTIONS = 1000
POLL_S = 0.02
READY_POLL_S = 0.005

# The model call with the summaries step's messages: (system, user).
Complete = Callable[[str, str], Awaitable[str]]

# The floor's whole transaction: one statement on an autocommit connection, so
# one round trip (the cheapest way to write the three rows; no ON CONFLICT, no
# NOTIFY). The floor's own SQL, not oncely's: the same rows as ``finish_job``.
FLOOR_STORE = """
WITH result AS (
    INSERT INTO results (job_id, result) VALUES (%(job_id)s, %(result)s)
), outbox_row AS (
    INSERT INTO outbox (topic, dedupe_key, payload, workflow, job_id)
    VALUES (%(topic)s, %(dedupe_key)s, %(payload)s, %(workflow)s, %(job_id)s)
)
UPDATE jobs SET status = 'done', updated_at = now() WHERE job_id = %(job_id)s
"""


# -- what runs --------------------------------------------------------------


@dataclass(frozen=True)
class Contender:
    kind: str  # "oncely" | "floor_openai" | "floor_aiohttp"
    concurrency: int
    jobs: int

    @property
    def key(self) -> str:
        return f"{self.kind}@{self.concurrency}"


@dataclass(frozen=True)
class Scenario:
    name: str
    model_sleep_s: float
    contenders: tuple[Contender, ...]


def scenarios(quick: bool) -> list[Scenario]:
    """Job counts sized so each run takes seconds, not minutes. The smoke run
    touches every kind of contender once, with a few jobs each."""
    if quick:
        fast = [Contender(k, 256, 100) for k in ("oncely", "floor_openai", "floor_aiohttp")]
        slow = (Contender("oncely", 256, 150), Contender("floor_openai", 256, 150))
        return [
            Scenario("instant", 0.0, (*fast, Contender("oncely", 1, 10))),
            Scenario("model_200ms", 0.2, slow),
        ]
    floors = ("floor_openai", "floor_aiohttp")
    return [
        Scenario("instant", 0.0, _lineup(2000, 200, floors)),
        Scenario("model_200ms", 0.2, _lineup(2000, 30, floors)),
    ]


def _lineup(many: int, one: int, floors: tuple[str, ...]) -> tuple[Contender, ...]:
    """oncely and each floor at 256; oncely and the SDK floor at 1."""
    at_256 = [Contender(kind, 256, many) for kind in ("oncely", *floors)]
    return (*at_256, Contender("oncely", 1, one), Contender("floor_openai", 1, one))


# -- the floor consumer (its own process) -------------------------------------


class FloorConsumer:
    """oncely's work with none of its guarantees: no pre-check, no retries, no
    owner checks, leases, index or NOTIFY; a failed job is simply left pending."""

    def __init__(
        self, redis: Redis, pool: AsyncConnectionPool, complete: Complete, concurrency: int
    ) -> None:
        self.redis = redis
        self.pool = pool
        self.complete = complete
        self.concurrency = concurrency
        self.consumer = f"floor-{os.getpid()}"
        self._tasks: set[asyncio.Task[None]] = set()
        self._slot_free = asyncio.Event()
        self._acks: list[str] = []
        self._ack_wanted = asyncio.Event()

    async def run(self) -> None:
        acker = asyncio.create_task(self._ack_forever())
        try:
            while True:
                while len(self._tasks) >= self.concurrency:
                    self._slot_free.clear()
                    await self._slot_free.wait()
                await self.run_once()
        finally:
            acker.cancel()
            if self._tasks:
                await asyncio.wait(self._tasks, timeout=5)
            await self._ack_batch()

    async def run_once(self) -> int:
        free = self.concurrency - len(self._tasks)
        keys = summaries.keys
        reply: Any = await self.redis.xreadgroup(
            keys.group, self.consumer, {keys.stream: ">"}, free, 1000
        )
        entries = reply[0][1] if reply else []
        for entry_id, fields in entries:
            task = asyncio.create_task(self._handle(entry_id, fields))
            self._tasks.add(task)
            task.add_done_callback(self._finished)
        return len(entries)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._slot_free.set()
        if not task.cancelled() and task.exception() is not None:
            print(f"floor: job failed: {task.exception()!r}", file=sys.stderr)

    async def _handle(self, entry_id: str, fields: dict[str, str]) -> None:
        job_id = fields["job_id"]
        payload = json.loads(fields["payload"])
        # The summaries step's prompt (oncely.builtin.summaries.summarise).
        summary = await self.complete(INSTRUCTION, f"<text>\n{payload['text']}\n</text>")
        outbox = {"job_id": job_id, "to": payload["notify"], "summary": summary}
        row = {
            "job_id": job_id,
            "result": Jsonb({"summary": summary}),
            "topic": SUMMARY_READY,
            "dedupe_key": dedupe_key(job_id),
            "payload": Jsonb(outbox),
            "workflow": summaries.name,
        }
        async with self.pool.connection() as conn:
            await conn.execute(FLOOR_STORE, row)
        self._acks.append(entry_id)
        self._ack_wanted.set()

    async def _ack_forever(self) -> None:
        while True:
            await self._ack_wanted.wait()
            self._ack_wanted.clear()
            await self._ack_batch()

    async def _ack_batch(self) -> None:
        ids, self._acks = self._acks, []
        if ids:
            await self.redis.xack(summaries.keys.stream, summaries.keys.group, *ids)


@contextlib.asynccontextmanager
async def openai_model(base_url: str) -> AsyncIterator[Complete]:
    import openai

    client = openai.AsyncOpenAI(
        base_url=base_url,
        api_key=API_KEY,
        max_retries=0,
        http_client=openai.DefaultAioHttpClient(),
    )

    async def complete(system: str, user: str) -> str:
        completion = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
        )
        return completion.choices[0].message.content or ""

    try:
        yield complete
    finally:
        await client.close()


@contextlib.asynccontextmanager
async def aiohttp_model(base_url: str) -> AsyncIterator[Complete]:
    connector = aiohttp.TCPConnector(limit=HTTP_CONNECTIONS, keepalive_timeout=5)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    url = f"{base_url}/chat/completions"
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:

        async def complete(system: str, user: str) -> str:
            messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
            body = {"model": MODEL, "messages": messages}
            async with session.post(url, json=body) as response:
                response.raise_for_status()
                answer = await response.json()
            return str(answer["choices"][0]["message"]["content"])

        yield complete


async def floor_main(args: argparse.Namespace) -> None:
    model = openai_model if args.transport == "openai" else aiohttp_model
    redis = Redis.from_url(args.redis_url, decode_responses=True)
    pool = AsyncConnectionPool(
        args.database_url,
        min_size=PG_POOL_MIN,
        max_size=PG_POOL_MAX,
        open=False,
        kwargs={"autocommit": True},
    )
    await pool.open(wait=True)
    try:
        async with model(args.llm_url) as complete:
            consumer = FloorConsumer(redis, pool, complete, args.concurrency)
            task = asyncio.create_task(consumer.run())
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, task.cancel)
            with contextlib.suppress(asyncio.CancelledError):
                await task
    finally:
        await pool.close()
        await redis.aclose()


# -- child processes ---------------------------------------------------------


def _die_with_parent() -> None:
    """PR_SET_PDEATHSIG: a child is SIGKILLed if the benchmark dies first."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


class Children:
    """Every process the benchmark starts; ``close`` stops all that still run."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = (self.log_dir / f"{name}.log").open("ab")
        proc = subprocess.Popen(
            argv, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
        )
        log.close()
        self._procs.append(proc)
        return proc

    def log_tail(self, name: str, chars: int = 2000) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    @staticmethod
    def stop(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    @staticmethod
    def kill(proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        for proc in self._procs:
            self.stop(proc, grace_s=3.0)
        self._procs.clear()


def clean_env(**onc: str) -> dict[str, str]:
    """The parent's environment without its ONCELY_* settings, plus ``onc``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONCELY_")}
    return env | {f"ONCELY_{k.upper()}": v for k, v in onc.items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass(frozen=True)
class FakeModelProcess:
    """``oncely fake-llm`` in its own process, so its CPU is its own."""

    proc: subprocess.Popen[bytes]
    url: str

    @classmethod
    def start(cls, children: Children) -> FakeModelProcess:
        port = free_port()
        argv = [sys.executable, "-m", "oncely", "fake-llm", "--port", str(port)]
        proc = children.start("fake-llm", argv, clean_env(log_level="WARNING"))
        return cls(proc, f"http://127.0.0.1:{port}/v1")

    @property
    def root_url(self) -> str:
        return self.url.removesuffix("/v1")

    async def wait_ready(self, children: Children) -> None:
        async with aiohttp.ClientSession() as session:
            for _ in range(600):
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(f"{self.root_url}/_calls") as r:
                        if r.status == 200:
                            return
                if self.proc.poll() is not None:
                    break
                await asyncio.sleep(0.05)
        raise RuntimeError(f"fake model did not start: {children.log_tail('fake-llm')}")


# -- measuring -----------------------------------------------------------------


def cpu_s(proc: psutil.Process) -> float:
    """User + system CPU seconds of one process (from /proc/<pid>/stat)."""
    t = proc.cpu_times()
    return float(t.user + t.system)


def machine_busy_s() -> float:
    t = psutil.cpu_times()
    return float(sum(t) - t.idle - getattr(t, "iowait", 0.0))


class Probes:
    """The processes whose CPU a run accounts for. Server processes are found
    only for embedded servers: the postmaster with its backends, and Valkey."""

    def __init__(self, pgdata: Path | None) -> None:
        self.pgdata = pgdata
        self.harness = psutil.Process()

    def servers(self) -> dict[int, float] | None:
        if self.pgdata is None:
            return None
        procs = [p for p in self.harness.children() if "valkey" in p.name()]
        with contextlib.suppress(OSError, ValueError, psutil.Error):
            pid = int((self.pgdata / "postmaster.pid").read_text().split()[0])
            postmaster = psutil.Process(pid)
            procs += [postmaster, *postmaster.children(recursive=True)]
        cpu: dict[int, float] = {}
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                cpu[proc.pid] = cpu_s(proc)
        return cpu


@dataclass(frozen=True)
class Snapshot:
    at: float
    consumer: float
    model: float
    harness: float
    servers: dict[int, float] | None
    machine_busy: float

    @classmethod
    def take(cls, probes: Probes, consumer: psutil.Process, model: psutil.Process) -> Snapshot:
        return cls(
            time.monotonic(),
            cpu_s(consumer),
            cpu_s(model),
            cpu_s(probes.harness),
            probes.servers(),
            machine_busy_s(),
        )


@dataclass
class RunResult:
    contender: str
    concurrency: int
    jobs: int
    seconds: float = 0.0  # first delivery -> all jobs done
    jobs_per_s: float = 0.0
    startup_s: float = 0.0  # process start -> first delivery
    seconds_incl_startup: float = 0.0
    jobs_per_s_incl_startup: float = 0.0
    cpu_ms_per_job: float = 0.0  # the consumer process, first delivery -> all done
    startup_cpu_ms: float = 0.0
    fake_model_cpu_ms_per_job: float = 0.0
    servers_cpu_ms_per_job: float | None = None  # Postgres + Valkey, embedded only
    machine_busy_cores: float = 0.0
    # Busy CPU not accounted to this benchmark's processes: other work on the box.
    foreign_cores: float | None = None
    busy_cores_before: float | None = None  # the machine just before the consumer started
    noise_retries: int = 0
    ok: bool = False
    checks: dict[str, int] = field(default_factory=dict)
    error: str | None = None


def measure(contender: Contender, spawned: float, ready: Snapshot, done: Snapshot) -> RunResult:
    """``ready`` is taken at the first delivery; a new process starts at zero CPU."""
    n = contender.jobs
    run_s = max(done.at - ready.at, 1e-9)
    total_s = done.at - spawned
    consumer = done.consumer - ready.consumer
    model = done.model - ready.model
    busy = done.machine_busy - ready.machine_busy
    servers = _servers_cpu(ready, done)
    return RunResult(
        contender=contender.kind,
        concurrency=contender.concurrency,
        jobs=n,
        seconds=round(run_s, 3),
        jobs_per_s=round(n / run_s, 1),
        startup_s=round(ready.at - spawned, 3),
        seconds_incl_startup=round(total_s, 3),
        jobs_per_s_incl_startup=round(n / total_s, 1),
        cpu_ms_per_job=round(consumer * 1000 / n, 3),
        startup_cpu_ms=round(ready.consumer * 1000, 1),
        fake_model_cpu_ms_per_job=round(model * 1000 / n, 3),
        servers_cpu_ms_per_job=None if servers is None else round(servers * 1000 / n, 3),
        machine_busy_cores=round(busy / run_s, 2),
        foreign_cores=None
        if servers is None
        else round((busy - consumer - model - servers - (done.harness - ready.harness)) / run_s, 2),
    )


def _servers_cpu(ready: Snapshot, done: Snapshot) -> float | None:
    """Backends born during the run count from zero; ones that exited are lost."""
    if ready.servers is None or done.servers is None:
        return None
    return sum(cpu - ready.servers.get(pid, 0.0) for pid, cpu in done.servers.items())


def failed(contender: Contender, error: str) -> RunResult:
    return RunResult(contender.kind, contender.concurrency, contender.jobs, error=error)


# -- the harness ---------------------------------------------------------------


class Bench:
    """Servers, the fake model and the per-run state: reset, load, run, check."""

    def __init__(
        self,
        urls: tuple[str, str],
        fake: FakeModelProcess,
        children: Children,
        probes: Probes,
    ) -> None:
        self.redis_url, self.database_url = urls
        self.fake = fake
        self.llm_url = fake.url
        self.model = psutil.Process(fake.proc.pid)
        self.children = children
        self.probes = probes
        self.redis = Redis.from_url(self.redis_url, decode_responses=True)
        self._db: psycopg.AsyncConnection[Any] | None = None

    @property
    def db(self) -> psycopg.AsyncConnection[Any]:
        assert self._db is not None
        return self._db

    async def open(self) -> None:
        from oncely.sql.migrate import migrate

        await migrate(self.database_url)
        self._db = await psycopg.AsyncConnection.connect(self.database_url, autocommit=True)
        await self.fake.wait_ready(self.children)

    async def close(self) -> None:
        if self._db is not None:
            await self._db.close()
        await self.redis.aclose()

    async def server_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {}
        for setting in ("server_version", "synchronous_commit", "fsync", "shared_buffers"):
            row = await (await self.db.execute(f"SHOW {setting}")).fetchone()
            info[f"postgres_{setting}"] = row[0] if row else None
        server = await self.redis.info("server")
        info["redis_version"] = server.get("valkey_version") or server.get("redis_version")
        return info

    # -- one run's state --

    async def fresh_state(self) -> None:
        await self.redis.flushdb()
        await self.db.execute("TRUNCATE jobs, results, outbox, job_deliveries RESTART IDENTITY")
        url = f"{self.fake.root_url}/_reset"
        async with aiohttp.ClientSession() as session, session.post(url) as r:
            r.raise_for_status()

    async def preload(self, jobs: int, sleep_s: float) -> None:
        """Rows in ``jobs`` and messages in the stream, the way the API leaves them."""
        from oncely.queue.stream import JobMessage, Stream

        directive = f" [[fake:sleep={sleep_s}]]" if sleep_s else ""
        messages = [
            JobMessage.new(
                str(uuid.uuid4()),
                TENANT,
                {"text": f"{_text(i)}{directive}", "notify": f"user{i}@example.com"},
            )
            for i in range(jobs)
        ]
        async with self.db.cursor() as cur:
            rows = [(m.job_id, m.tenant, summaries.name, Jsonb(m.payload)) for m in messages]
            await cur.executemany(query("insert_job"), rows)
        await self.db.execute("ANALYZE jobs")
        stream = Stream(self.redis, summaries.keys)
        await stream.ensure_group()
        for i in range(0, jobs, 50):
            await asyncio.gather(*(stream.enqueue(m) for m in messages[i : i + 50]))
        with contextlib.suppress(psycopg.Error):
            await self.db.execute("CHECKPOINT")

    def spawn(self, contender: Contender) -> subprocess.Popen[bytes]:
        if contender.kind == "oncely":
            # One workflow's WorkerGroup: its Worker and Reconciler, as before.
            argv = [sys.executable, "-m", "oncely", "worker", "--workflow", summaries.name]
            env = clean_env(
                redis_url=self.redis_url,
                database_url=self.database_url,
                llm_base_url=self.llm_url,
                llm_api_key=API_KEY,
                worker_concurrency=str(contender.concurrency),
                log_level="WARNING",
            )
        else:
            argv = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--floor-consumer",
                f"--transport={contender.kind.removeprefix('floor_')}",
                f"--concurrency={contender.concurrency}",
                f"--redis-url={self.redis_url}",
                f"--database-url={self.database_url}",
                f"--llm-url={self.llm_url}",
            ]
            env = clean_env()
        return self.children.start(contender.key, argv, env)

    # -- waiting --

    async def first_delivery(self, proc: subprocess.Popen[bytes], within_s: float) -> None:
        """Until the group's last-delivered id moves: the consumer is up and reading."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline and proc.poll() is None:
            groups: Any = await self.redis.xinfo_groups(summaries.keys.stream)
            if groups and str(groups[0]["last-delivered-id"]) != "0-0":
                return
            await asyncio.sleep(READY_POLL_S)
        raise RuntimeError("consumer never read the stream")

    async def all_done(self, proc: subprocess.Popen[bytes], jobs: int, within_s: float) -> None:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline and proc.poll() is None:
            if await self.count("SELECT count(*) FROM jobs WHERE status = 'done'") >= jobs:
                return
            await asyncio.sleep(POLL_S)
        done = await self.count("SELECT count(*) FROM jobs WHERE status = 'done'")
        raise RuntimeError(f"{done}/{jobs} jobs done when the wait ended")

    async def pending(self) -> int:
        summary: Any = await self.redis.xpending(summaries.keys.stream, summaries.keys.group)
        return int(summary["pending"])

    async def settled(self, within_s: float = 5.0) -> int:
        """Pending entries once acknowledgements caught up (or the wait ended)."""
        deadline = time.monotonic() + within_s
        while (left := await self.pending()) and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        return left

    async def count(self, sql: str) -> int:
        row = await (await self.db.execute(sql)).fetchone()
        return int(row[0]) if row else 0

    async def checks(self) -> dict[str, int]:
        return {
            "done": await self.count("SELECT count(*) FROM jobs WHERE status = 'done'"),
            "summaries": await self.count("SELECT count(*) FROM summaries"),
            "outbox": await self.count("SELECT count(*) FROM outbox"),
            "pending_after_done": await self.settled(),
            "model_calls": await self._model_calls(),
        }

    async def _model_calls(self) -> int:
        url = f"{self.fake.root_url}/_calls"
        async with aiohttp.ClientSession() as session, session.get(url) as r:
            body = await r.json()
        return int(body["total"])


def _text(i: int) -> str:
    return (
        f"Ticket {i}: the customer reports that invoice {1000 + i} was charged twice. "
        "Support refunded the second charge and apologised. The customer confirmed "
        "the refund arrived and closed the ticket."
    )


def _timeout_s(contender: Contender, sleep_s: float) -> float:
    return 120 + contender.jobs * (sleep_s + 0.05) * 3 / contender.concurrency


@dataclass(frozen=True)
class Noise:
    """The box is shared: wait for it to quiet down before a run, and run
    again when other work took more than ``max_cores`` during one."""

    max_cores: float
    wait_s: float
    retries: int


async def wait_for_quiet(noise: Noise) -> float | None:
    """Busy cores in the last half-second sample (nothing of ours is working);
    None when the run does not wait (``--quick``)."""
    if noise.wait_s <= 0:
        return None
    deadline = time.monotonic() + noise.wait_s
    while True:
        before = machine_busy_s()
        await asyncio.sleep(0.5)
        busy = (machine_busy_s() - before) / 0.5
        if busy <= noise.max_cores or time.monotonic() >= deadline:
            return round(busy, 2)


async def run_quiet(bench: Bench, contender: Contender, sleep_s: float, noise: Noise) -> RunResult:
    for attempt in range(noise.retries + 1):
        result = await run_one(bench, contender, sleep_s, noise)
        result.noise_retries = attempt
        if result.foreign_cores is None or result.foreign_cores <= noise.max_cores:
            break
    return result


async def run_one(bench: Bench, contender: Contender, sleep_s: float, noise: Noise) -> RunResult:
    await bench.fresh_state()
    await bench.preload(contender.jobs, sleep_s)
    busy_before = await wait_for_quiet(noise)
    spawned = time.monotonic()
    proc = bench.spawn(contender)
    ps = psutil.Process(proc.pid)
    try:
        await bench.first_delivery(proc, within_s=60)
        ready = Snapshot.take(bench.probes, ps, bench.model)
        await bench.all_done(proc, contender.jobs, _timeout_s(contender, sleep_s))
        done = Snapshot.take(bench.probes, ps, bench.model)
    except RuntimeError as exc:
        Children.kill(proc)
        return failed(contender, f"{exc}; log: {bench.children.log_tail(contender.key)}")
    result = measure(contender, spawned, ready, done)
    result.busy_cores_before = busy_before
    result.checks = await bench.checks()
    # Every job is done and acknowledged (checked): a graceful stop would
    # only cost wall time, and a kill is a stop oncely is built for.
    Children.kill(proc)
    c = result.checks
    result.ok = c["done"] == c["summaries"] == c["outbox"] == contender.jobs
    result.ok = result.ok and c["pending_after_done"] == 0
    return result


# -- the report ------------------------------------------------------------------


def median_run(runs: list[RunResult]) -> dict[str, Any]:
    """The run with the median throughput, and every run's throughput."""
    ordered = sorted(runs, key=lambda r: r.jobs_per_s)
    chosen = asdict(ordered[(len(ordered) - 1) // 2])
    if len(runs) > 1:
        chosen["runs_jobs_per_s"] = [r.jobs_per_s for r in runs]
        chosen["runs_cpu_ms_per_job"] = [r.cpu_ms_per_job for r in runs]
        chosen["jobs_per_s_spread_pct"] = round(
            100
            * (ordered[-1].jobs_per_s - ordered[0].jobs_per_s)
            / statistics.median(r.jobs_per_s for r in runs),
            1,
        )
    return chosen


def ratios(runs: dict[str, list[RunResult]]) -> dict[str, Any]:
    """oncely over each floor. The headline is the median of per-round ratios:
    the two ran back to back, so drift of a shared machine cancels out."""
    out: dict[str, Any] = {"goal": GOAL}
    for conc in (256, 1):
        for floor in ("floor_openai", "floor_aiohttp"):
            ours, theirs = runs.get(f"oncely@{conc}"), runs.get(f"{floor}@{conc}")
            if not ours or not theirs:
                continue
            pairs = [(o, f) for o, f in zip(ours, theirs, strict=True) if o.ok and f.ok]
            if pairs:
                out[f"oncely_vs_{floor}@{conc}"] = _ratio(pairs)
    return out


def _ratio(pairs: list[tuple[RunResult, RunResult]]) -> dict[str, Any]:
    def median_of(get: Callable[[RunResult], float]) -> float:
        return round(statistics.median(get(o) / get(f) for o, f in pairs), 3)

    per_round = [round(o.jobs_per_s / f.jobs_per_s, 3) for o, f in pairs]
    throughput = median_of(lambda r: r.jobs_per_s)
    return {
        "throughput": throughput,
        "throughput_per_round": per_round,
        "throughput_incl_startup": median_of(lambda r: r.jobs_per_s_incl_startup),
        "cpu_per_job": median_of(lambda r: r.cpu_ms_per_job),
        "meets_goal": throughput >= GOAL,
    }


async def run_scenario(
    bench: Bench, scenario: Scenario, repeat: int, noise: Noise
) -> dict[str, Any]:
    runs: dict[str, list[RunResult]] = {c.key: [] for c in scenario.contenders}
    # Round-robin, so drift over time (page cache, WAL, thermal) hits each alike.
    for round_no in range(repeat):
        for contender in scenario.contenders:
            result = await run_quiet(bench, contender, scenario.model_sleep_s, noise)
            _progress(scenario, contender, round_no, result)
            runs[contender.key].append(result)
    results = {key: median_run(rs) for key, rs in runs.items()}
    return {
        "scenario": scenario.name,
        "model_sleep_s": scenario.model_sleep_s,
        "results": results,
        "ratios": ratios(runs),
    }


def _progress(scenario: Scenario, contender: Contender, round_no: int, r: RunResult) -> None:
    status = "ok" if r.ok else f"FAILED {r.error or r.checks}"
    status += f"  other work {r.busy_cores_before}/{r.foreign_cores} cores before/during"
    status += f" (retry {r.noise_retries})" if r.noise_retries else ""
    print(
        f"[{scenario.name} #{round_no + 1}] {contender.key:<18} {r.jobs:>5} jobs "
        f"{r.seconds:>7.2f} s {r.jobs_per_s:>8.1f} jobs/s {r.cpu_ms_per_job:>7.3f} CPU ms/job "
        f"busy {r.machine_busy_cores:.2f} cores  {status}",
        file=sys.stderr,
        flush=True,
    )


# -- profiling (--profile): where a consumer's CPU goes ------------------------

# Each sample goes to the first bucket one of whose frames contains the needle
# (a bucket may have several needles); order matters: the limiter runs inside
# the adapter, the adapter inside the model-call wrappers, and those inside the
# step, which runs inside the handler.
BUCKETS: dict[str, tuple[tuple[str, str], ...]] = {
    "oncely": (
        ("limiter: FleetLimiter (acquire, settle)", "FleetLimiter."),
        ("model call: openai SDK chat.completions.create", "AsyncCompletions.create"),
        ("model call: OpenAICompatible (messages, completion)", "OpenAICompatible."),
        ("model call: oncely's wrappers (Model._ask: retries, Deadline, LimitedLLM)", "Model._ask"),
        ("step: summarise (prompt, emit)", "summarise ("),
        ("pre-check: Jobs.result_stored (batched)", "Jobs.result_stored"),
        ("pre-check: Jobs.result_stored (batched)", "Jobs._results_stored"),
        ("store: Jobs.finish", "Jobs.finish"),
        ("notify: OutboxWakeUp", "OutboxWakeUp."),
        ("ack: Worker._acknowledge / _ack_batch (Lua ACK)", "Worker._ack"),
        ("handler: WorkflowHandler.__call__ (validate, Context, Model)", "WorkflowHandler."),
        ("handler rest: parse, _run_handler, metrics, logs", "Worker._handle"),
        ("read: XAUTOCLAIM + XREADGROUP + starting tasks", "Worker.run_once"),
        ("leases", "Worker.renew_leases"),
        ("reconciler", "Reconciler."),
        ("trim", "Stream.trim"),
    ),
    "floor": (
        ("model call: openai SDK chat.completions.create", "AsyncCompletions.create"),
        ("model call: raw aiohttp", "aiohttp_model"),
        ("store: one statement", "psycopg"),
        ("ack: XACK batch", "FloorConsumer._ack_batch"),
        ("handler rest: parse", "FloorConsumer._handle"),
        ("read: XREADGROUP + starting tasks", "FloorConsumer.run_once"),
    ),
}
_PG_ACTIVITY = """
SELECT coalesce(wait_event_type, 'CPU') || ':' || coalesce(wait_event, '-'), state,
       left(regexp_replace(query, '\\s+', ' ', 'g'), 40)
  FROM pg_stat_activity
 WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()
   AND datname = current_database() AND state <> 'idle'
   AND query NOT LIKE 'SELECT count(*) FROM jobs%'
"""


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(found).exists():
        raise SystemExit("--profile needs py-spy: .venv/bin/pip install py-spy")
    return found


def buckets(folded: Path, kind: str, cpu_ms_per_job: float) -> dict[str, dict[str, float]]:
    """Share of the main thread's samples per bucket, and that share of the CPU per job."""
    rules = BUCKETS["oncely" if kind == "oncely" else "floor"]
    counts: collections.Counter[str] = collections.Counter()
    for line in folded.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and not stack.startswith("Thread._bootstrap"):  # idle executor threads
            name = next((b for b, needle in rules if needle in stack), "event loop and the rest")
            counts[name] += int(n)
    total = sum(counts.values()) or 1
    return {
        name: {"share": round(n / total, 3), "cpu_ms_per_job": round(n / total * cpu_ms_per_job, 3)}
        for name, n in counts.most_common()
    }


async def sample_pg_activity(bench: Bench, stop: asyncio.Event) -> collections.Counter[str]:
    seen: collections.Counter[str] = collections.Counter()
    async with await psycopg.AsyncConnection.connect(bench.database_url, autocommit=True) as conn:
        while not stop.is_set():
            for row in await (await conn.execute(_PG_ACTIVITY)).fetchall():
                seen[" | ".join(row)] += 1
            await asyncio.sleep(0.01)
    return seen


async def profile_one(bench: Bench, contender: Contender, out: Path) -> dict[str, Any]:
    """One run with py-spy on the consumer (which slows it: the shares count,
    not the speed) and Postgres' view of its sessions sampled meanwhile."""
    await bench.fresh_state()
    await bench.preload(contender.jobs, 0.0)
    proc = bench.spawn(contender)
    folded = out / f"{contender.kind}-{contender.concurrency}.folded"
    await bench.first_delivery(proc, within_s=60)
    ps = psutil.Process(proc.pid)
    cpu_before = cpu_s(ps)
    argv = [py_spy(), "record", "--pid", str(proc.pid), "--rate", "100", "--format", "raw"]
    spy = bench.children.start(f"py-spy-{contender.key}", [*argv, "-o", str(folded)], clean_env())
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_pg_activity(bench, stop))
    await bench.all_done(proc, contender.jobs, _timeout_s(contender, 0.0) * 3)
    cpu_ms_per_job = (cpu_s(ps) - cpu_before) * 1000 / contender.jobs
    stop.set()
    activity = await sampler
    spy.send_signal(signal.SIGINT)
    await asyncio.to_thread(spy.wait, 30)
    Children.kill(proc)
    samples = sum(activity.values()) or 1
    return {
        "contender": contender.key,
        "jobs": contender.jobs,
        "cpu_ms_per_job_under_py_spy": round(cpu_ms_per_job, 3),
        "folded": str(folded),
        "buckets": buckets(folded, contender.kind, cpu_ms_per_job),
        "postgres_sessions": {k: round(v / samples, 3) for k, v in activity.most_common(12)},
    }


async def profile_main(bench: Bench, out: Path, jobs: int) -> dict[str, Any]:
    lineup = [Contender("oncely", 256, jobs), Contender("floor_openai", 256, jobs)]
    return {"profiles": [await profile_one(bench, c, out) for c in lineup]}


# -- the run ---------------------------------------------------------------------


async def bench_main(
    args: argparse.Namespace,
    urls: tuple[str, str],
    pgdata: Path | None,
    fake: FakeModelProcess,
    children: Children,
) -> dict[str, Any]:
    bench = Bench(urls, fake, children, Probes(pgdata))
    try:
        await bench.open()
        if args.profile:
            return await profile_main(bench, Path(args.profile), args.profile_jobs)
        info = await bench.server_info()
        source = source_state()
        started = time.monotonic()
        noise = Noise(args.noise_max_cores, args.quiet_wait_s, args.noise_retries)
        results = [await run_scenario(bench, s, args.repeat, noise) for s in scenarios(args.quick)]
        return {
            "benchmark": "oncely worker vs floor consumer",
            "quick": args.quick,
            "repeat": args.repeat,
            "noise": asdict(noise),
            "machine": machine_info() | info | {"servers": args.servers},
            "oncely_source": source,
            "src_changed_during_run": _warn_if_changed(source),
            "scenarios": results,
            "total_s": round(time.monotonic() - started, 1),
        }
    finally:
        await bench.close()


def source_state() -> dict[str, str]:
    """What was measured: HEAD, src files changed in the working tree, and a
    digest of src/ (the worker imports it at each start; others may edit it)."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted((root / "src").rglob("*")):
        if path.suffix in (".py", ".sql") and path.is_file():
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return {
        "revision": _git(root, "rev-parse", "--short", "HEAD"),
        "uncommitted": _git(root, "status", "--porcelain", "--", "src"),
        "src_sha256": digest.hexdigest()[:16],
    }


def _warn_if_changed(before: dict[str, str]) -> bool:
    changed = source_state() != before
    if changed:
        print("WARNING: src/ changed during the run; results mix versions", file=sys.stderr)
    return changed


def _git(root: Path, *args: str) -> str:
    try:
        done = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return " ".join(done.stdout.split())


def machine_info() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "cpu_model": platform.processor() or _cpu_model(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


# -- entry point -----------------------------------------------------------------


@contextlib.contextmanager
def servers(args: argparse.Namespace, data_dir: Path) -> Iterator[tuple[str, str, Path | None]]:
    """The given servers, or embedded ones for the length of the benchmark
    (with the embedded PostgreSQL's data directory, to find its processes)."""
    if args.redis_url and args.database_url:
        args.servers = "given"
        yield args.redis_url, args.database_url, None
        return
    from oncely.embedded import EmbeddedServers

    embedded = EmbeddedServers(data_dir / "servers")
    try:
        urls = embedded.start()
        args.servers = "embedded"
        pgdata = None if args.database_url else data_dir / "servers" / "postgres"
        yield args.redis_url or urls.redis_url, args.database_url or urls.database_url, pgdata
    finally:
        embedded.stop()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny job counts: a smoke run")
    p.add_argument("--repeat", type=int, default=None, help="runs per contender (median kept)")
    p.add_argument(
        "--redis-url",
        default=os.environ.get("ONCELY_BENCH_REDIS_URL"),
        help="use this Redis, FLUSHED before each run (env ONCELY_BENCH_REDIS_URL)",
    )
    p.add_argument(
        "--database-url",
        default=os.environ.get("ONCELY_BENCH_DATABASE_URL"),
        help="use this database; jobs, results and outbox are TRUNCATED "
        "(env ONCELY_BENCH_DATABASE_URL)",
    )
    p.add_argument("--out", help="also write the JSON document to this file")
    p.add_argument(
        "--noise-max-cores",
        type=float,
        default=0.3,
        help="other work on the machine tolerated before and during a run (cores)",
    )
    p.add_argument("--quiet-wait-s", type=float, help="longest wait for a quiet machine")
    p.add_argument("--noise-retries", type=int, help="runs again after a noisy run")
    p.add_argument("--log-dir", help="children's logs (default: a temp dir)")
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="instead of the comparison: py-spy oncely@256 and floor_openai@256 (instant "
        "model), write folded stacks to DIR and print CPU per bucket",
    )
    p.add_argument("--profile-jobs", type=int, default=4000, help=argparse.SUPPRESS)
    # The floor consumer, run by the benchmark itself:
    p.add_argument("--floor-consumer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--transport", choices=("openai", "aiohttp"), help=argparse.SUPPRESS)
    p.add_argument("--concurrency", type=int, default=256, help=argparse.SUPPRESS)
    p.add_argument("--llm-url", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    # Five rounds: a shared VM drifts by ±20 % between runs seconds apart.
    defaults = (1, 0.0, 0) if args.quick else (5, 30.0, 2)
    for name, default in zip(("repeat", "quiet_wait_s", "noise_retries"), defaults, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, default)
    return args


def main() -> None:
    from oncely.logs import configure_logging

    configure_logging("console", "WARNING")  # stdout carries the JSON document only
    args = parse_args()
    if args.floor_consumer:
        import uvloop  # what `oncely worker` runs on too

        uvloop.run(floor_main(args))
        return
    # SIGTERM unwinds like Ctrl-C, so every finally (children, servers) runs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="oncely-bench-") as tmp:
        args.log_dir = args.log_dir or tmp
        for folder in (args.log_dir, args.profile):
            if folder:
                Path(folder).mkdir(parents=True, exist_ok=True)
        children = Children(Path(args.log_dir))
        try:
            # The fake model imports while the servers start.
            fake = FakeModelProcess.start(children)
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
