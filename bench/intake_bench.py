"""The intake against its durable floor: what does the idempotent POST cost?

One run, one load generator (``wrk``), the same machine and servers, side by
side, round-robin:

- ``oncely``: a real ``oncely api`` process (one uvicorn process) serving
  ``POST /v1/summaries`` with a valid bearer key: key lookup, idempotency
  claim, INSERT of the job row, XADD, finalise;
- ``floor``: a minimal FastAPI app in one uvicorn process (this file with
  ``--serve floor``), the same request model, doing the same durable work
  with no guarantees: INSERT of a ``jobs`` row (kind ``summaries``, a fresh
  uuid4, ON CONFLICT DO NOTHING) and XADD, answering 202;
- ``xadd``: the same app doing the XADD only, for reference.

wrk's Lua script sends a fresh ``Idempotency-Key`` per request; the
``oncely_dup30`` run sends 30 % duplicates of keys this wrk thread sent at
least 64 requests earlier (mostly finished: replays). Each run starts from a
flushed Redis and truncated tables; every oncely run ends with its
invariants checked (every 202 job id once in ``jobs`` and once in the
stream, no extra rows for duplicates).

    .venv/bin/python bench/intake_bench.py --quick   # smoke, ~30 s
    .venv/bin/python bench/intake_bench.py           # ~3 min, writes bench/intake-report.json

Given servers (``--redis-url``/``--database-url``) are FLUSHED and TRUNCATED.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import importlib
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import psycopg
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool
from redis.asyncio import Redis

# Module level: FastAPI resolves the route's (string) annotations from here.
from oncely.builtin.summaries import SummaryRequest, summaries
from worker_bench import (
    Children,
    Noise,
    Probes,
    _warn_if_changed,
    clean_env,
    cpu_s,
    free_port,
    machine_busy_s,
    machine_info,
    servers,
    source_state,
    wait_for_quiet,
)

TENANT = "bench"
ROUTE = "/v1/summaries"
FLOOR_STREAM = "bench:intake:floor"
XADD_STREAM = "bench:intake:xadd"
PG_POOL_MIN, PG_POOL_MAX = 2, 20  # oncely's defaults (Settings.pg_pool_min/max)
GOAL_THROUGHPUT, GOAL_P99 = 0.8, 1.5
DUP_GAP = 64  # a duplicate repeats a key sent at least this many requests earlier
THIS = Path(__file__).resolve()
REPORT = THIS.parent / "intake-report.json"

FLOOR_INSERT = (
    "INSERT INTO jobs (job_id, tenant, kind, payload) VALUES (%s, %s, %s, %s) "
    "ON CONFLICT (job_id) DO NOTHING"
)


@dataclass(frozen=True)
class Contender:
    name: str  # the row in the report
    server: str  # "oncely" | "floor" | "xadd"
    dup_rate: float


CONTENDERS = (
    Contender("oncely", "oncely", 0.0),
    Contender("floor", "floor", 0.0),
    Contender("xadd", "xadd", 0.0),
    Contender("oncely_dup30", "oncely", 0.3),
)


# -- the floor and XADD-only servers (their own processes) ---------------------


def floor_app(mode: str, redis_url: str, database_url: str) -> FastAPI:
    """The durable floor (``floor``) or the XADD alone (``xadd``): the same
    request model as oncely's route, no auth, no idempotency."""
    redis = Redis.from_url(redis_url)
    pool = AsyncConnectionPool(
        database_url,
        min_size=PG_POOL_MIN,
        max_size=PG_POOL_MAX,
        open=False,
        kwargs={"autocommit": True},
    )
    stream = FLOOR_STREAM if mode == "floor" else XADD_STREAM

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await pool.open(wait=True)
        try:
            yield
        finally:
            await pool.close()
            await redis.aclose()

    app = FastAPI(lifespan=lifespan)

    @app.post(ROUTE, status_code=202, response_model=None)
    async def create(body: SummaryRequest) -> JSONResponse:
        job_id = str(uuid.uuid4())
        payload = body.model_dump(mode="json")
        if mode == "floor":
            async with pool.connection() as conn:
                await conn.execute(FLOOR_INSERT, (job_id, TENANT, summaries.name, Jsonb(payload)))
        fields = {"job_id": job_id, "tenant": TENANT, "payload": json.dumps(payload)}
        await redis.xadd(stream, fields)  # type: ignore[arg-type]
        return JSONResponse({"job_id": job_id, "status": "queued"}, status_code=202)

    @app.get("/readyz")
    async def readyz() -> dict[str, str]:
        return {"status": "ok"}

    return app


def serve_floor(args: argparse.Namespace) -> None:
    """uvicorn as ``oncely api`` runs it: one process, uvloop, default HTTP parser."""
    import uvicorn
    import uvloop

    app = floor_app(args.serve, args.redis_url, args.database_url)
    config = uvicorn.Config(
        app, host="127.0.0.1", port=args.port, log_config=None, access_log=False, lifespan="on"
    )
    uvloop.run(uvicorn.Server(config).serve())


# -- wrk -----------------------------------------------------------------------

# One line per response in <dir>/resp-<thread>.tsv (status, job id, replayed)
# and one per fresh key in <dir>/keys-<thread>.txt; done() prints the summary.
WRK_LUA = r"""
local threads = {}
local counter = 0
local sent = {}
local prefix, dup_rate, auth, out, keys_out

function setup(thread)
  table.insert(threads, thread)
  thread:set("tid", #threads)
end

function init(args)
  local dir = args[1]
  prefix = args[2] .. "-" .. tid
  dup_rate = tonumber(args[3])
  auth = "Bearer " .. args[4]
  math.randomseed(tonumber(args[5]) + tid)
  out = io.open(dir .. "/resp-" .. tid .. ".tsv", "w")
  keys_out = io.open(dir .. "/keys-" .. tid .. ".txt", "w")
end

function request()
  local key
  if dup_rate > 0 and #sent > DUP_GAP and math.random() < dup_rate then
    key = sent[math.random(1, #sent - DUP_GAP)]
  else
    counter = counter + 1
    key = prefix .. "-" .. counter
    sent[#sent + 1] = key
    keys_out:write(key, "\n")
  end
  local body = '{"text":"Ticket ' .. key .. ': the customer reports that an invoice was '
    .. 'charged twice. Support refunded the second charge and apologised.",'
    .. '"notify":"user@example.com"}'
  local headers = {
    ["Content-Type"] = "application/json",
    ["Authorization"] = auth,
    ["Idempotency-Key"] = key,
  }
  return wrk.format("POST", "/v1/summaries", headers, body)
end

function response(status, headers, body)
  local job = string.match(body, '"job_id":"([^"]+)"') or "-"
  local replayed = headers["idempotent-replayed"] or headers["Idempotent-Replayed"]
  out:write(status, "\t", job, "\t", replayed and "1" or "0", "\n")
end

function done(summary, latency, requests)
  io.write(string.format(
    'WRKJSON {"requests":%d,"duration_us":%d,"connect":%d,"read":%d,"write":%d,'
    .. '"status":%d,"timeout":%d,"p50_us":%d,"p90_us":%d,"p99_us":%d,"max_us":%d,'
    .. '"mean_us":%.1f}\n',
    summary.requests, summary.duration, summary.errors.connect, summary.errors.read,
    summary.errors.write, summary.errors.status, summary.errors.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency.max, latency.mean))
end
""".replace("DUP_GAP", str(DUP_GAP))


@dataclass(frozen=True)
class Load:
    seconds: float
    connections: int
    threads: int


@dataclass
class WrkOutput:
    summary: dict[str, Any]
    statuses: collections.Counter[int]
    fresh_ids: list[str]  # 202 without Idempotent-Replayed
    replayed_ids: list[str]
    keys: list[str]  # fresh keys sent (a duplicate reuses one of them)
    cpu_s: float


def run_wrk(url: str, script: Path, out_dir: Path, load: Load, key: str, dup: float) -> WrkOutput:
    out_dir.mkdir(parents=True)
    prefix = f"ib{uuid.uuid4().hex[:10]}"
    argv = [
        "wrk",
        f"-t{load.threads}",
        f"-c{load.connections}",
        f"-d{load.seconds:g}s",
        "--timeout",
        "10s",
        "--latency",
        "-s",
        str(script),
        url,
        "--",
        str(out_dir),
        prefix,
        str(dup),
        key,
        str(int(time.time()) % 100000),
    ]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=load.seconds + 60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    line = next((x for x in done.stdout.splitlines() if x.startswith("WRKJSON ")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stdout[-800:]}{done.stderr}")
    statuses: collections.Counter[int] = collections.Counter()
    fresh: list[str] = []
    replayed: list[str] = []
    for path in sorted(out_dir.glob("resp-*.tsv")):
        for row in path.read_text().splitlines():
            status, job, rep = row.split("\t")
            statuses[int(status)] += 1
            if status == "202" and job != "-":
                (replayed if rep == "1" else fresh).append(job)
    keys = [k for p in sorted(out_dir.glob("keys-*.txt")) for k in p.read_text().split()]
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return WrkOutput(
        json.loads(line.removeprefix("WRKJSON ")), statuses, fresh, replayed, keys, cpu
    )


# -- one run ---------------------------------------------------------------------


@dataclass
class RunResult:
    contender: str
    round: int
    seconds: float = 0.0
    requests: int = 0
    req_per_s: float = 0.0
    ok_per_s: float = 0.0  # 2xx per second
    p50_ms: float = 0.0
    p90_ms: float = 0.0
    p99_ms: float = 0.0
    max_ms: float = 0.0
    statuses: dict[str, int] = field(default_factory=dict)
    non_2xx: int = 0
    socket_errors: int = 0
    server_cpu_ms_per_req: float = 0.0
    server_busy_cores: float = 0.0
    servers_cpu_ms_per_req: float | None = None  # Postgres + Valkey, embedded only
    wrk_cores: float = 0.0
    machine_busy_cores: float = 0.0
    foreign_cores: float | None = None
    busy_cores_before: float | None = None
    noise_retries: int = 0
    checks: dict[str, Any] = field(default_factory=dict)
    ok: bool = True


class Bench:
    def __init__(self, urls: tuple[str, str], children: Children, probes: Probes) -> None:
        self.redis_url, self.database_url = urls
        self.children = children
        self.probes = probes
        self.redis = Redis.from_url(self.redis_url, decode_responses=True)
        self._db: psycopg.AsyncConnection[Any] | None = None
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ports: dict[str, int] = {}
        self.api_key = ""
        self.script = Path(tempfile.mkdtemp(prefix="oncely-intake-lua-")) / "intake.lua"
        self.script.write_text(WRK_LUA)

    @property
    def db(self) -> psycopg.AsyncConnection[Any]:
        assert self._db is not None
        return self._db

    async def open(self) -> None:
        from oncely.sql.migrate import migrate

        await migrate(self.database_url)
        self._db = await psycopg.AsyncConnection.connect(self.database_url, autocommit=True)
        env = clean_env(redis_url=self.redis_url, database_url=self.database_url)
        argv = [sys.executable, "-m", "oncely", "keys", "create", "--tenant", TENANT]
        made = await asyncio.to_thread(
            subprocess.run, argv, env=env, capture_output=True, text=True, check=True, timeout=60
        )
        self.api_key = made.stdout.strip()

    async def close(self) -> None:
        if self._db is not None:
            await self._db.close()
        await self.redis.aclose()

    async def start_servers(self) -> None:
        oncely_env = clean_env(
            redis_url=self.redis_url, database_url=self.database_url, log_level="WARNING"
        )
        for name in ("oncely", "floor", "xadd"):
            port = self.ports[name] = free_port()
            if name == "oncely":
                argv = [sys.executable, "-m", "oncely", "api", "--port", str(port)]
                env = oncely_env
            else:
                argv = [
                    sys.executable,
                    str(THIS),
                    f"--serve={name}",
                    f"--port={port}",
                    f"--redis-url={self.redis_url}",
                    f"--database-url={self.database_url}",
                ]
                env = clean_env()
            self.procs[name] = self.children.start(f"server-{name}", argv, env)
        async with aiohttp.ClientSession() as session:
            for name in self.procs:
                await self._ready(session, name)

    async def _ready(self, session: aiohttp.ClientSession, name: str) -> None:
        for _ in range(600):
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(f"{self.url(name)}/readyz") as r:
                    if r.status == 200:
                        return
            if self.procs[name].poll() is not None:
                break
            await asyncio.sleep(0.05)
        raise RuntimeError(f"{name} did not start: {self.children.log_tail(f'server-{name}')}")

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    async def fresh_state(self) -> None:
        await self.redis.flushdb()
        await self.db.execute("TRUNCATE jobs, results, outbox, job_deliveries RESTART IDENTITY")
        await self.db.execute("ANALYZE jobs")

    async def server_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {}
        for setting in ("server_version", "synchronous_commit", "fsync"):
            row = await (await self.db.execute(f"SHOW {setting}")).fetchone()
            info[f"postgres_{setting}"] = row[0] if row else None
        server = await self.redis.info("server")
        info["redis_version"] = server.get("valkey_version") or server.get("redis_version")
        return info

    async def run(
        self, contender: Contender, round_no: int, load: Load, out_dir: Path, noise: Noise
    ) -> RunResult:
        for attempt in range(noise.retries + 1):
            await self.fresh_state()
            before_busy = await wait_for_quiet(noise)
            result = await self._run_once(contender, round_no, load, out_dir / f"a{attempt}")
            result.busy_cores_before = before_busy
            result.noise_retries = attempt
            if result.foreign_cores is None or result.foreign_cores <= noise.max_cores:
                break
            if attempt < noise.retries:
                print(f"  noisy run ({result.foreign_cores} foreign cores): again", file=sys.stderr)
        return result

    async def _run_once(
        self, contender: Contender, round_no: int, load: Load, out_dir: Path
    ) -> RunResult:
        server = psutil.Process(self.procs[contender.server].pid)
        harness = psutil.Process()
        cpu0, servers0, busy0, h0, t0 = (
            cpu_s(server),
            self.probes.servers(),
            machine_busy_s(),
            cpu_s(harness),
            time.monotonic(),
        )
        url = self.url(contender.server)
        wrk = await asyncio.to_thread(
            run_wrk, url, self.script, out_dir, load, self.api_key, contender.dup_rate
        )
        cpu1, servers1, busy1, h1, t1 = (
            cpu_s(server),
            self.probes.servers(),
            machine_busy_s(),
            cpu_s(harness),
            time.monotonic(),
        )
        s = wrk.summary
        secs = s["duration_us"] / 1e6
        n = max(s["requests"], 1)
        ok = sum(v for k, v in wrk.statuses.items() if 200 <= k < 300)
        server_cpu = cpu1 - cpu0
        srv = None
        if servers0 is not None and servers1 is not None:
            srv = sum(c - servers0.get(pid, 0.0) for pid, c in servers1.items())
        wall = t1 - t0
        busy = busy1 - busy0
        foreign = None
        if srv is not None:
            foreign = round((busy - server_cpu - srv - wrk.cpu_s - (h1 - h0)) / wall, 2)
        result = RunResult(
            contender=contender.name,
            round=round_no,
            seconds=round(secs, 2),
            requests=s["requests"],
            req_per_s=round(s["requests"] / secs, 1),
            ok_per_s=round(ok / secs, 1),
            p50_ms=round(s["p50_us"] / 1000, 2),
            p90_ms=round(s["p90_us"] / 1000, 2),
            p99_ms=round(s["p99_us"] / 1000, 2),
            max_ms=round(s["max_us"] / 1000, 2),
            statuses={str(k): v for k, v in sorted(wrk.statuses.items())},
            non_2xx=s["status"],
            socket_errors=s["connect"] + s["read"] + s["write"] + s["timeout"],
            server_cpu_ms_per_req=round(server_cpu * 1000 / n, 3),
            server_busy_cores=round(server_cpu / wall, 2),
            servers_cpu_ms_per_req=None if srv is None else round(srv * 1000 / n, 3),
            wrk_cores=round(wrk.cpu_s / wall, 2),
            machine_busy_cores=round(busy / wall, 2),
            foreign_cores=foreign,
        )
        result.checks = await self.checks(contender, wrk, load)
        result.ok = bool(result.checks.get("ok")) and result.socket_errors == 0
        return result

    async def settle(self, stream: str, within_s: float = 5.0) -> None:
        """Until requests cut off when wrk stopped have finished in the server:
        rows and stream entries unchanged for 0.3 s."""
        deadline = time.monotonic() + within_s
        last: tuple[int, int] | None = None
        while time.monotonic() < deadline:
            row = await (await self.db.execute("SELECT count(*) FROM jobs")).fetchone()
            now = (int(row[0]) if row else 0, int(await self.redis.xlen(stream)))
            if now == last:
                return
            last = now
            await asyncio.sleep(0.3)

    async def checks(self, contender: Contender, wrk: WrkOutput, load: Load) -> dict[str, Any]:
        stream = {"oncely": summaries.keys.stream, "floor": FLOOR_STREAM, "xadd": XADD_STREAM}[
            contender.server
        ]
        await self.settle(stream)
        rows = [
            str(r[0])
            for r in await (
                await self.db.execute("SELECT job_id FROM jobs WHERE kind = %s", (summaries.name,))
            ).fetchall()
        ]
        in_stream: collections.Counter[str] = collections.Counter()
        last = "-"
        while True:
            batch: Any = await self.redis.xrange(stream, min=last, max="+", count=5000)
            batch = [e for e in batch if e[0] != last]
            if not batch:
                break
            in_stream.update(fields["job_id"] for _, fields in batch)
            last = batch[-1][0]
        accepted = set(wrk.fresh_ids) | set(wrk.replayed_ids)
        checks: dict[str, Any] = {
            "rows": len(rows),
            "stream_entries": sum(in_stream.values()),
            "fresh_202": len(wrk.fresh_ids),
            "replayed_202": len(wrk.replayed_ids),
            "distinct_keys_sent": len(wrk.keys),
        }
        all_202 = set(wrk.statuses) == {202}
        if contender.server == "xadd":
            checks["all_202"] = all_202
            checks["ok"] = all_202 and checks["stream_entries"] >= len(wrk.fresh_ids)
            return checks
        if contender.server == "floor":
            checks["all_202"] = all_202
            checks["ok"] = (
                all_202 and len(rows) >= len(wrk.fresh_ids) and sorted(rows) == sorted(in_stream)
            )
            return checks
        from oncely.api.keys import Scope

        row_set = set(rows)
        expected = {
            str(Scope(tenant=TENANT, method="POST", route=ROUTE, key=k).job_id) for k in wrk.keys
        }
        # Requests still in flight when wrk stopped may have been accepted unseen.
        unseen = len(row_set - accepted)
        # Duplicates may meet their first request still running: 409, retry later.
        allowed = {202} if contender.dup_rate == 0 else {202, 409}
        checks |= {
            "only_expected_statuses": set(wrk.statuses) <= allowed,
            "distinct_202_job_ids": len(accepted),
            "fresh_202_ids_unique": len(wrk.fresh_ids) == len(set(wrk.fresh_ids)),
            "every_202_in_jobs_once": accepted <= row_set,
            "every_202_in_stream_once": all(in_stream[j] == 1 for j in accepted),
            "every_row_in_stream_once": all(in_stream[j] == 1 for j in row_set)
            and sum(in_stream.values()) == len(row_set),
            "rows_are_keys_sent": row_set <= expected,
            "replays_name_accepted_jobs": set(wrk.replayed_ids) <= row_set,
            "rows_minus_distinct_202": unseen,
            "rows_eq_distinct_keys_accepted": 0 <= unseen <= load.connections,
        }
        checks["ok"] = all(v for k, v in checks.items() if isinstance(v, bool))
        return checks


# -- the profile -----------------------------------------------------------------

# Each main-thread sample goes to the first bucket one of whose functions is on
# its stack (py-spy names a frame "<qualname> (<file>:<line>)"); inner work
# comes before what encloses it. Every function is looked up in the live code
# before the profile runs, so a renamed one fails loudly instead of silently
# misfiling samples.
PROFILE_BUCKETS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("auth lookup: tenant_for_key (Postgres SELECT)", ("oncely.api.auth:tenant_for_key",)),
    (
        "claim: IdempotentRequest._claim (Redis SET NX / GET)",
        ("oncely.api.idempotency:IdempotentRequest._claim",),
    ),
    (
        "finalise: IdempotentRequest._finalise (Lua, stored response)",
        ("oncely.api.idempotency:IdempotentRequest._finalise",),
    ),
    (
        "XADD: Jobs._enqueue_recorded (Lua XADD + index)",
        ("oncely.jobs.store:Jobs._enqueue_recorded",),
    ),
    # run_statement runs every statement in a task of its own, so psycopg's
    # work for the key lookup and the INSERT is not under either caller.
    (
        "Postgres statements: run_statement's own task (auth SELECT + accept_job INSERT)",
        ("oncely.jobs.store:_execute",),
    ),
    ("insert: Jobs.accept (accept_job statement)", ("oncely.jobs.store:Jobs.accept",)),
    (
        "serialisation: fingerprint, JSONResponse, response capture",
        (
            "oncely.api.keys:fingerprint",
            "fastapi.encoders:jsonable_encoder",
            "starlette.responses:JSONResponse.render",
            "oncely.api.idempotency:_capture",
            "oncely.api.idempotency:_replay",
        ),
    ),
    (
        "handler rest: create, accept_job, IdempotentRequest.run/_execute (lock keeper task)",
        (
            "oncely.api.workflows:accept_job",
            "oncely.api.idempotency:IdempotentRequest._execute",
            "oncely.api.idempotency:IdempotentRequest._keep_lock",
            "oncely.api.idempotency:IdempotentRequest.run",
        ),
    ),
    (
        "dependency solving: solve_dependencies (body validation, bearer, idempotency dep)",
        ("fastapi.dependencies.utils:solve_dependencies",),
    ),
    ("thread pool hop: run_in_threadpool", ("starlette.concurrency:run_in_threadpool",)),
    (
        "ASGI stack: middleware, routing, request body",
        ("uvicorn.protocols.http.httptools_impl:RequestResponseCycle.run_asgi",),
    ),
    (
        "HTTP parser/transport: HttpToolsProtocol",
        ("uvicorn.protocols.http.httptools_impl:HttpToolsProtocol",),
    ),
    (
        "redis-py writes outside a request frame",
        ("redis.asyncio.connection:AbstractConnection._send_packed_command",),
    ),
)


def _live_needles() -> list[tuple[str, tuple[str, ...]]]:
    """(bucket, py-spy frame prefixes), every function checked to exist."""
    out = []
    for name, targets in PROFILE_BUCKETS:
        needles = []
        for target in targets:
            module, _, qualname = target.partition(":")
            obj: Any = importlib.import_module(module)
            for part in qualname.split("."):
                obj = getattr(obj, part, None)
                if obj is None:
                    raise RuntimeError(f"profile bucket names a missing function: {target}")
            # A class stands for any of its methods.
            needles.append(f"{qualname}." if isinstance(obj, type) else f"{qualname} (")
        out.append((name, tuple(needles)))
    return out


def py_spy() -> str | None:
    for candidate in (
        shutil.which("py-spy"),
        str(Path(sys.executable).with_name("py-spy")),
        "/tmp/pyspy/bin/py-spy",
    ):
        if candidate and Path(candidate).exists():
            return candidate
    return None


def buckets(folded: Path) -> dict[str, Any]:
    rules = _live_needles()
    counts: collections.Counter[str] = collections.Counter()
    threads = 0
    for line in folded.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack:
            continue
        if "Thread._bootstrap" in stack:
            threads += int(n)
            continue
        name = next(
            (b for b, needles in rules if any(x in stack for x in needles)),
            "event loop and the rest (uvloop callbacks, task/future bookkeeping, pools)",
        )
        counts[name] += int(n)
    total = sum(counts.values()) or 1
    return {
        "main_thread_samples": total,
        "other_thread_samples": threads,
        "buckets": {k: round(v / total, 3) for k, v in counts.most_common()},
    }


async def profile(bench: Bench, load: Load, seconds: float, out_dir: Path) -> dict[str, Any]:
    spy = py_spy()
    if spy is None:
        return {"skipped": "py-spy not found (pip install --target /tmp/pyspy py-spy)"}
    await bench.fresh_state()
    folded = out_dir / "oncely-api.folded"
    pid = bench.procs["oncely"].pid
    argv = [spy, "record", "--pid", str(pid), "--rate", "100", "--format", "raw"]
    argv += ["--duration", f"{seconds:g}", "-o", str(folded)]
    proc = bench.children.start("py-spy", argv, clean_env())
    await asyncio.sleep(1.0)  # py-spy attaches
    run_load = Load(seconds + 1, load.connections, load.threads)
    url, key = bench.url("oncely"), bench.api_key
    wrk = await asyncio.to_thread(
        run_wrk, url, bench.script, out_dir / "profile-wrk", run_load, key, 0.0
    )
    await asyncio.to_thread(proc.wait, 30)
    if not folded.exists():
        return {"skipped": f"py-spy wrote nothing: {bench.children.log_tail('py-spy')}"}
    secs = wrk.summary["duration_us"] / 1e6
    return {
        "rate_hz": 100,
        "seconds": seconds,
        "req_per_s_under_py_spy": round(wrk.summary["requests"] / secs, 1),
        "folded": str(folded),
        **buckets(folded),
    }


# -- the report --------------------------------------------------------------------


def summarise(runs: dict[str, list[RunResult]]) -> dict[str, Any]:
    def med(rs: list[RunResult], attr: str) -> float:
        return round(float(statistics.median(float(getattr(r, attr)) for r in rs)), 2)

    table = {}
    for name, rs in runs.items():
        table[name] = {
            "req_per_s": med(rs, "req_per_s"),
            "p50_ms": med(rs, "p50_ms"),
            "p99_ms": med(rs, "p99_ms"),
            "server_cpu_ms_per_req": med(rs, "server_cpu_ms_per_req"),
            "server_busy_cores": med(rs, "server_busy_cores"),
            "wrk_cores": med(rs, "wrk_cores"),
            "non_2xx": sum(r.non_2xx for r in rs),
            "socket_errors": sum(r.socket_errors for r in rs),
            "statuses": dict(
                sum((collections.Counter(r.statuses) for r in rs), collections.Counter())
            ),
            "req_per_s_per_round": [r.req_per_s for r in rs],
            "p99_ms_per_round": [r.p99_ms for r in rs],
            "spread_req_per_s": [min(r.req_per_s for r in rs), max(r.req_per_s for r in rs)],
            "checks_ok": all(r.ok for r in rs),
        }
    return table


def ratios(runs: dict[str, list[RunResult]], name: str, vs: str) -> dict[str, Any]:
    pairs = list(zip(runs[name], runs[vs], strict=True))
    thr = [round(a.req_per_s / b.req_per_s, 3) for a, b in pairs]
    p99 = [round(a.p99_ms / b.p99_ms, 3) for a, b in pairs]
    t, p = statistics.median(thr), statistics.median(p99)
    return {
        "throughput": round(t, 3),
        "throughput_per_round": thr,
        "p99": round(p, 3),
        "p99_per_round": p99,
        "goal": {"throughput_min": GOAL_THROUGHPUT, "p99_max": GOAL_P99},
        "meets_goal": t >= GOAL_THROUGHPUT and p <= GOAL_P99,
    }


async def bench_main(
    args: argparse.Namespace, urls: tuple[str, str], pgdata: Path | None, children: Children
) -> dict[str, Any]:
    started = time.monotonic()
    src_before = source_state()
    load = Load(args.seconds, args.connections, args.threads)
    noise = Noise(args.noise_max_cores, args.quiet_wait_s, args.noise_retries)
    bench = Bench(urls, children, Probes(pgdata))
    out_dir = Path(args.log_dir)
    try:
        await bench.open()
        await bench.start_servers()
        # Warm-up: imports, pools and caches filled, JIT-free but first-touch paths.
        for name in ("oncely", "floor", "xadd"):
            await bench.fresh_state()
            warm = Load(args.warmup, load.connections, load.threads)
            c = next(c for c in CONTENDERS if c.server == name)
            await asyncio.to_thread(
                run_wrk, bench.url(name), bench.script, out_dir / f"warm-{name}", warm,
                bench.api_key, c.dup_rate,
            )  # fmt: skip
        runs: dict[str, list[RunResult]] = {c.name: [] for c in CONTENDERS}
        for round_no in range(1, args.rounds + 1):
            for c in CONTENDERS:
                r = await bench.run(c, round_no, load, out_dir / f"r{round_no}-{c.name}", noise)
                runs[c.name].append(r)
                print(
                    f"round {round_no} {c.name:<13} {r.req_per_s:>8.1f} req/s "
                    f"p50 {r.p50_ms:>6.1f} p99 {r.p99_ms:>6.1f} ms  "
                    f"server {r.server_busy_cores:.2f} cores  wrk {r.wrk_cores:.2f}  "
                    f"statuses {r.statuses}  {'ok' if r.ok else 'CHECKS FAILED'}",
                    file=sys.stderr,
                    flush=True,
                )
        prof: dict[str, Any] = {"skipped": "--no-profile"}
        if not args.no_profile:
            print(f"profiling oncely api ({args.profile_s:g} s)", file=sys.stderr, flush=True)
            prof = await profile(bench, load, args.profile_s, out_dir)
        info = await bench.server_info()
    finally:
        await bench.close()
    return {
        "benchmark": "oncely intake vs durable floor vs XADD only (wrk)",
        "quick": args.quick,
        "command": " ".join(sys.argv),
        "load": asdict(load) | {"rounds": args.rounds, "dup_rate": 0.3, "dup_gap": DUP_GAP},
        "noise": asdict(noise),
        "machine": machine_info() | info | {"servers": args.servers},
        "oncely_source": src_before,
        "src_changed_during_run": _warn_if_changed(src_before),
        "results": summarise(runs),
        "ratios": {
            "oncely_vs_floor": ratios(runs, "oncely", "floor"),
            "oncely_dup30_vs_floor": ratios(runs, "oncely_dup30", "floor"),
            "floor_vs_xadd": ratios(runs, "floor", "xadd"),
        },
        "checks_ok": all(r.ok for rs in runs.values() for r in rs),
        "runs": {k: [asdict(r) for r in rs] for k, rs in runs.items()},
        "profile": prof,
        "total_s": round(time.monotonic() - started, 1),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a ~30 s smoke run")
    p.add_argument("--rounds", type=int, help="rounds (each runs every contender once)")
    p.add_argument("--seconds", type=float, help="wrk duration per run")
    p.add_argument("--connections", type=int, default=32)
    p.add_argument("--threads", type=int, default=2, help="wrk threads")
    p.add_argument("--warmup", type=float, help="seconds of load per server before the rounds")
    p.add_argument("--profile-s", type=float, help="py-spy seconds on oncely api")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--out", default=str(REPORT), help="where the JSON goes (also to stdout)")
    p.add_argument("--redis-url", default=os.environ.get("ONCELY_BENCH_REDIS_URL"))
    p.add_argument("--database-url", default=os.environ.get("ONCELY_BENCH_DATABASE_URL"))
    p.add_argument("--noise-max-cores", type=float, default=0.3)
    p.add_argument("--quiet-wait-s", type=float)
    p.add_argument("--noise-retries", type=int)
    p.add_argument("--log-dir", help="children's logs and wrk's output (default: a temp dir)")
    # The floor / XADD-only server, run by the benchmark itself:
    p.add_argument("--serve", choices=("floor", "xadd"), help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    quick = {"rounds": 1, "seconds": 4.0, "warmup": 1.0, "profile_s": 3.0}
    full = {"rounds": 3, "seconds": 10.0, "warmup": 2.0, "profile_s": 8.0}
    quick |= {"quiet_wait_s": 0.0, "noise_retries": 0}
    full |= {"quiet_wait_s": 5.0, "noise_retries": 1}
    for name, default in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    return args


def main() -> None:
    from oncely.logs import configure_logging

    configure_logging("console", "WARNING")
    args = parse_args()
    if args.serve:
        serve_floor(args)
        return
    if shutil.which("wrk") is None:
        raise SystemExit("needs wrk: apt-get install -y wrk")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="oncely-intake-") as tmp:
        args.log_dir = args.log_dir or tmp
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        children = Children(Path(args.log_dir))
        try:
            with servers(args, Path(tmp)) as (redis_url, database_url, pgdata):
                report = asyncio.run(bench_main(args, (redis_url, database_url), pgdata, children))
        finally:
            children.close()
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
