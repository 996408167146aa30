"""The intake against its durable floor: what does the idempotent POST cost?

One load generator (``wrk``, with a Lua script making a fresh
``Idempotency-Key`` per request), the same machine and servers, round-robin:

- ``oncely``: a real ``oncely api`` process serving ``POST /v1/summaries``
  with a valid bearer key: key lookup, idempotency claim, INSERT of the job
  row, XADD, finalise;
- ``floor``: a minimal FastAPI app in one uvicorn process (this module with
  ``--serve floor``), the same request model, the same durable work with no
  guarantees: INSERT of a ``jobs`` row and XADD, answering 202;
- ``minimal``: the same app inserting into a table of its own with only a
  primary key and the payload (no indexes, no other columns), then XADD: the
  floor of the durable work itself, without oncely's schema;
- ``xadd``: the same app doing the XADD only, for reference;
- ``oncely_dup30``: oncely with 30 % of requests repeating a key the same wrk
  thread sent at least 64 requests earlier (mostly finished: replays).

- ``against`` (with ``--against CHECKOUT``): ``oncely api`` from another
  checkout (say, a git worktree of an earlier revision), in the same rounds,
  on a database of its own (migrated by that checkout, its own key).

Every run starts from a flushed Redis and empty tables (its contender's
database) and ends with its invariants checked there: every 202's job id
once in ``jobs`` and once in the stream, rows exactly the keys sent and
accepted, replays naming accepted jobs. A py-spy profile of ``oncely api``
(and of the minimal app, and of ``--against``'s API) under the same load
follows.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import resource
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
import psycopg
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool
from redis.asyncio import Redis

from bench.harness import floor, profile
from bench.harness.measure import Headline, Meter, Noise, Run, ratio, round_robin, summary
from bench.harness.processes import clean_env, free_port, wait_http
from bench.harness.report import Context, main, parser
from bench.harness.servers import (
    against_database,
    against_key,
    checkout_env,
    checkout_revision,
    fresh_state,
    fresh_tables,
    migrate_and_key,
)

# Module level: FastAPI resolves the route's (string) annotations from here.
from oncely.builtin.summaries import SummaryRequest, summaries

TENANT = "bench"
ROUTE = "/v1/summaries"
FLOOR_STREAM = "bench:intake:floor"
MINIMAL_STREAM = "bench:intake:minimal"
MINIMAL_TABLE = "bench_intake_minimal"
XADD_STREAM = "bench:intake:xadd"
GOAL_THROUGHPUT, GOAL_P99 = 0.8, 1.5
DUP_GAP = 64  # a duplicate repeats a key sent at least this many requests earlier
SHOWN = ("req_per_s", "p50_ms", "p99_ms", "server_busy_cores", "wrk_cores")

FLOOR_INSERT = (
    "INSERT INTO jobs (job_id, tenant, kind, payload) VALUES (%s, %s, %s, %s) "
    "ON CONFLICT (job_id) DO NOTHING"
)
MINIMAL_INSERT = f"INSERT INTO {MINIMAL_TABLE} (job_id, payload) VALUES (%s, %s)"
MINIMAL_SCHEMA = (
    f"CREATE TABLE IF NOT EXISTS {MINIMAL_TABLE} (job_id uuid PRIMARY KEY, payload jsonb NOT NULL)"
)


@dataclass(frozen=True)
class Contender:
    name: str  # the row in the report
    server: str  # "oncely" | "floor" | "minimal" | "xadd" | "against"
    dup_rate: float


CONTENDERS = (
    Contender("oncely", "oncely", 0.0),
    Contender("floor", "floor", 0.0),
    Contender("minimal", "minimal", 0.0),
    Contender("xadd", "xadd", 0.0),
    Contender("oncely_dup30", "oncely", 0.3),
)
# With --against: oncely from another checkout (say, a worktree of an
# earlier revision), under the same load in the same rounds.
AGAINST = Contender("against", "against", 0.0)


@dataclass(frozen=True)
class Load:
    seconds: int  # wrk takes whole seconds
    connections: int
    threads: int


# -- the floor and XADD-only servers (their own processes) ---------------------


def floor_app(mode: str, redis_url: str, database_url: str) -> FastAPI:
    """The durable floor on oncely's ``jobs`` (``floor``), on a table with
    only a key and the payload (``minimal``), or the XADD alone (``xadd``):
    the same request model as oncely's route, no auth, no idempotency."""
    redis = Redis.from_url(redis_url)
    pools: list[AsyncConnectionPool] = []  # the one pool, once the lifespan opened it
    stream = {"floor": FLOOR_STREAM, "minimal": MINIMAL_STREAM}.get(mode, XADD_STREAM)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with floor.pg_pool(database_url) as pool:
            pools.append(pool)
            try:
                yield
            finally:
                await redis.aclose()

    app = FastAPI(lifespan=lifespan)

    @app.post(ROUTE, status_code=202, response_model=None)
    async def create(body: SummaryRequest) -> JSONResponse:
        job_id = str(uuid.uuid4())
        payload = body.model_dump(mode="json")
        if mode == "floor":
            async with pools[0].connection() as conn:
                await conn.execute(FLOOR_INSERT, (job_id, TENANT, summaries.name, Jsonb(payload)))
        elif mode == "minimal":
            async with pools[0].connection() as conn:
                await conn.execute(MINIMAL_INSERT, (job_id, Jsonb(payload)))
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
    argv = [
        "wrk",
        f"-t{load.threads}",
        f"-c{load.connections}",
        f"-d{load.seconds}s",
        "--timeout",
        "10s",
        "--latency",
        "-s",
        str(script),
        url,
        "--",
        str(out_dir),
        f"ib{uuid.uuid4().hex[:10]}",
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
    summary_ = json.loads(line.removeprefix("WRKJSON "))
    return WrkOutput(summary_, statuses, fresh, replayed, keys, cpu)


# -- the runs ------------------------------------------------------------------------


class Bench:
    def __init__(self, ctx: Context, load: Load) -> None:
        self.ctx = ctx
        self.load = load
        self.redis = Redis.from_url(ctx.servers.redis_url, decode_responses=True)
        # Per database ("main": oncely, floor, xadd; "against": --against's
        # own): a connection for fresh state and checks, and the bearer key.
        self.dbs: dict[str, psycopg.AsyncConnection[Any]] = {}
        self.keys: dict[str, str] = {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ports: dict[str, int] = {}
        self.script = ctx.log_dir / "intake.lua"
        self.script.write_text(WRK_LUA)

    async def open(self) -> None:
        s, against = self.ctx.servers, self.ctx.args.against
        self.keys["main"] = await migrate_and_key(s.database_url, TENANT)
        self.dbs["main"] = await psycopg.AsyncConnection.connect(s.database_url, autocommit=True)
        await self.dbs["main"].execute(MINIMAL_SCHEMA)
        env = clean_env(redis_url=s.redis_url, database_url=s.database_url, log_level="WARNING")
        if against:
            against_url = await against_database(s, against)
            self.keys["against"] = await against_key(s, against, against_url, TENANT)
            self.dbs["against"] = await psycopg.AsyncConnection.connect(
                against_url, autocommit=True
            )
            against_env = checkout_env(
                against, redis_url=s.redis_url, database_url=against_url, log_level="WARNING"
            )
        for name in ["oncely", "floor", "minimal", "xadd"] + (["against"] if against else []):
            port = self.ports[name] = free_port()
            argv = ["-m", "oncely", "api", "--port", str(port)]
            server_env = env
            if name == "against":
                server_env = against_env
            elif name != "oncely":
                argv = ["-m", "bench.intake", f"--serve={name}", f"--port={port}"]
                argv += [f"--redis-url={s.redis_url}", f"--database-url={s.database_url}"]
            self.procs[name] = self.ctx.children.python(f"server-{name}", argv, server_env)
        for name, proc in self.procs.items():
            await wait_http(f"{self.url(name)}/readyz", proc, f"server-{name}", self.ctx.children)

    async def close(self) -> None:
        for db in self.dbs.values():
            await db.close()
        await self.redis.aclose()

    @staticmethod
    def database(c: Contender) -> str:
        """The database ``c``'s server uses: --against's own, or the main one."""
        return "against" if c.server == "against" else "main"

    @staticmethod
    def stream(c: Contender) -> str:
        """The stream ``c``'s server adds to (oncely's, whichever checkout)."""
        streams = {"floor": FLOOR_STREAM, "minimal": MINIMAL_STREAM, "xadd": XADD_STREAM}
        return streams.get(c.server, summaries.keys.stream)

    @staticmethod
    def table(c: Contender) -> str:
        """The table ``c``'s server inserts into."""
        return MINIMAL_TABLE if c.server == "minimal" else "jobs"

    async def fresh(self, c: Contender) -> None:
        """A flushed Redis and empty tables in ``c``'s database (``--against``'s
        schema may lack some of them)."""
        if self.database(c) == "against":
            await fresh_tables(self.redis, self.dbs["against"])
        else:
            await fresh_state(self.redis, self.dbs["main"])
            await self.dbs["main"].execute(f"TRUNCATE {MINIMAL_TABLE}")

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    async def wrk(self, c: Contender, load: Load, out_dir: Path) -> WrkOutput:
        url, key = self.url(c.server), self.keys[self.database(c)]
        return await asyncio.to_thread(run_wrk, url, self.script, out_dir, load, key, c.dup_rate)

    async def warm_up(self, seconds: int) -> None:
        """Imports, pools and caches filled, first-touch paths taken (every
        server). Each settles before the next flushes Redis: a request cut off
        when wrk stopped must not add to the stream the next run checks (oncely
        and --against's share one)."""
        for c in (*CONTENDERS[:4], *((AGAINST,) if self.ctx.args.against else ())):
            await self.fresh(c)
            warm = Load(seconds, self.load.connections, self.load.threads)
            await self.wrk(c, warm, self.ctx.log_dir / f"warm-{c.name}")
            await self.settle(self.dbs[self.database(c)], self.stream(c), self.table(c))

    async def run(self, c: Contender, round_no: int) -> Run:
        attempt = len(list(self.ctx.log_dir.glob(f"r{round_no}-{c.name}-*")))
        out_dir = self.ctx.log_dir / f"r{round_no}-{c.name}-{attempt}"
        await self.fresh(c)
        run = Run(c.name, round_no, busy_cores_before=await self.ctx.noise.quiet())
        meter = Meter({"server": psutil.Process(self.procs[c.server].pid)}, self.ctx.servers.cpu)
        before = meter.sample()
        wrk = await self.wrk(c, self.load, out_dir)
        after = meter.sample()
        use = Meter.usage(before, after, other_s=wrk.cpu_s)
        s = wrk.summary
        secs = s["duration_us"] / 1e6
        n = max(s["requests"], 1)
        run.metrics = {
            "seconds": round(secs, 2),
            "requests": s["requests"],
            "req_per_s": round(s["requests"] / secs, 1),
            "p50_ms": round(s["p50_us"] / 1000, 2),
            "p90_ms": round(s["p90_us"] / 1000, 2),
            "p99_ms": round(s["p99_us"] / 1000, 2),
            "max_ms": round(s["max_us"] / 1000, 2),
            "non_2xx": s["status"],
            "socket_errors": s["connect"] + s["read"] + s["write"] + s["timeout"],
            "server_cpu_ms_per_req": use.ms_per("server", n),
            "server_busy_cores": use.cores("server"),
            "wrk_cores": round(wrk.cpu_s / use.wall_s, 2),
            "machine_busy_cores": use.busy_cores,
        }
        if (servers_ms := use.servers_ms_per(n)) is not None:
            run.metrics["servers_cpu_ms_per_req"] = servers_ms
        run.foreign_cores = use.foreign_cores
        run.checks = await self.checks(c, wrk)
        run.checks["statuses"] = {str(k): v for k, v in sorted(wrk.statuses.items())}
        run.ok = bool(run.checks["ok"]) and run.metrics["socket_errors"] == 0
        return run

    async def settle(
        self,
        db: psycopg.AsyncConnection[Any],
        stream: str,
        table: str = "jobs",
        within_s: float = 30.0,
    ) -> None:
        """Until requests cut off when wrk stopped have finished in the server:
        rows (in ``db``) and stream entries unchanged for a second (a server
        on a busy machine, the suite's smoke run among others, can take that
        long between two late requests)."""
        deadline = time.monotonic() + within_s
        last: tuple[int, int] | None = None
        while time.monotonic() < deadline:
            row = await (await db.execute(f"SELECT count(*) FROM {table}")).fetchone()
            now = (int(row[0]) if row else 0, int(await self.redis.xlen(stream)))
            if now == last:
                return
            last = now
            await asyncio.sleep(1.0)

    async def _stream_ids(self, stream: str) -> collections.Counter[str]:
        seen: collections.Counter[str] = collections.Counter()
        last = "-"
        while True:
            batch: Any = await self.redis.xrange(stream, min=last, max="+", count=5000)
            batch = [e for e in batch if e[0] != last]
            if not batch:
                return seen
            seen.update(fields["job_id"] for _, fields in batch)
            last = batch[-1][0]

    async def checks(self, c: Contender, wrk: WrkOutput) -> dict[str, Any]:
        """On ``c``'s database (``--against``'s own for ``against``)."""
        db = self.dbs[self.database(c)]
        await self.settle(db, self.stream(c), self.table(c))
        if c.server == "minimal":
            cur = await db.execute(f"SELECT job_id FROM {MINIMAL_TABLE}")
        else:
            cur = await db.execute("SELECT job_id FROM jobs WHERE kind = %s", (summaries.name,))
        rows = [str(r[0]) for r in await cur.fetchall()]
        in_stream = await self._stream_ids(self.stream(c))
        checks: dict[str, Any] = {
            "rows": len(rows),
            "stream_entries": sum(in_stream.values()),
            "fresh_202": len(wrk.fresh_ids),
            "replayed_202": len(wrk.replayed_ids),
            "distinct_keys_sent": len(wrk.keys),
        }
        all_202 = set(wrk.statuses) == {202}
        if c.server == "xadd":
            checks["ok"] = all_202 and checks["stream_entries"] >= len(wrk.fresh_ids)
        elif c.server in ("floor", "minimal"):
            checks["ok"] = (
                all_202 and len(rows) >= len(wrk.fresh_ids) and sorted(rows) == sorted(in_stream)
            )
        else:
            checks |= oncely_checks(c, wrk, rows, in_stream, self.load.connections)
        return checks


def oncely_checks(
    c: Contender,
    wrk: WrkOutput,
    rows: list[str],
    in_stream: collections.Counter[str],
    connections: int,
) -> dict[str, Any]:
    from oncely.identity import Scope

    row_set = set(rows)
    accepted = set(wrk.fresh_ids) | set(wrk.replayed_ids)
    expected = {
        str(Scope(tenant=TENANT, method="POST", route=ROUTE, key=k).job_id) for k in wrk.keys
    }
    # Requests still in flight when wrk stopped may have been accepted unseen.
    unseen = len(row_set - accepted)
    # Duplicates may meet their first request still running: 409, retry later.
    allowed = {202} if c.dup_rate == 0 else {202, 409}
    checks: dict[str, Any] = {
        "only_expected_statuses": set(wrk.statuses) <= allowed,
        "distinct_202_job_ids": len(accepted),
        "fresh_202_ids_unique": len(wrk.fresh_ids) == len(set(wrk.fresh_ids)),
        "every_202_in_jobs_once": accepted <= row_set and len(rows) == len(row_set),
        "every_202_in_stream_once": all(in_stream[j] == 1 for j in accepted),
        "every_row_in_stream_once": all(in_stream[j] == 1 for j in row_set)
        and sum(in_stream.values()) == len(row_set),
        "rows_are_keys_sent": row_set <= expected,
        "replays_name_accepted_jobs": set(wrk.replayed_ids) <= row_set,
        "rows_minus_distinct_202": unseen,
        "rows_eq_distinct_keys_accepted": 0 <= unseen <= connections,
    }
    checks["ok"] = all(v for v in checks.values() if isinstance(v, bool))
    return checks


# -- the profile -----------------------------------------------------------------

# The API's CPU by stage; inner work first. run_statement runs every statement
# in a task of its own, so psycopg's work for the key lookup and the INSERT
# is under neither caller.
PROFILE_BUCKETS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("auth lookup on a key-cache miss (Postgres SELECT)", ("oncely.api.auth:_tenant_for_hash",)),
    (
        "claim: IdempotentRequest._claim (Redis SET NX GET)",
        ("oncely.api.idempotency:IdempotentRequest._claim",),
    ),
    (
        "finalise + enqueue: IdempotentRequest._finalise (one script: stored response, XADD)",
        ("oncely.api.idempotency:IdempotentRequest._finalise",),
    ),
    (
        "Postgres statements: run_statement's own task (accept_job INSERT)",
        ("oncely.sql.bounded:_execute",),
    ),
    ("insert: Jobs.record (accept_job statement)", ("oncely.jobs.store:Jobs.record",)),
    (
        "serialisation: fingerprint, JSONResponse, response capture",
        (
            "oncely.identity:fingerprint",
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
        "reading the request: FastAPI's solve_dependencies (the floor's body), oncely's "
        "direct intake (body, bearer key, validation)",
        (
            "fastapi.dependencies.utils:solve_dependencies",
            "oncely.api.workflows:_json_body",
            "oncely.api.workflows:_validated",
            "oncely.api.auth:ApiKeyAuth",
        ),
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
    (
        "Redis answers arriving on the shared connection (outside a request frame)",
        ("oncely.redis_client:_Wire.data_received",),
    ),
)


async def profile_server(
    bench: Bench, c: Contender, seconds: int, rules: list[profile.Bucket]
) -> dict[str, Any]:
    """py-spy on one server under the fresh-key load (it slows the server:
    compare the shares, and the two servers' milliseconds side by side, not
    the speed). Each bucket is [share, main-thread ms per request]: the
    server is busy on its core, so samples / rate / requests is its time
    per request under py-spy."""
    await bench.fresh(c)
    spy = profile.Spy(
        bench.ctx.children, f"{c.name}-api", bench.procs[c.server].pid, bench.ctx.log_dir
    )
    await spy.attached()
    load = Load(seconds, bench.load.connections, bench.load.threads)
    wrk = await bench.wrk(c, load, bench.ctx.log_dir / f"profile-wrk-{c.name}")
    folded = await spy.stop()
    secs = wrk.summary["duration_us"] / 1e6
    requests = max(wrk.summary["requests"], 1)
    samples = profile.shares(folded, rules)["main_thread_samples"]
    ms_per_request = samples / 100 / requests * 1000
    return {
        "rate_hz": 100,
        "seconds": seconds,
        "req_per_s_under_py_spy": round(requests / secs, 1),
        "main_thread_ms_per_request": round(ms_per_request, 3),
        "folded": str(folded),
        **profile.shares(folded, rules, cpu_ms=ms_per_request),
    }


# -- the benchmark ----------------------------------------------------------------


async def bench_main(ctx: Context) -> tuple[list[Headline], dict[str, Any], bool]:
    rules = profile.buckets(PROFILE_BUCKETS)  # fail fast on a renamed function
    a = ctx.args
    load = Load(a.seconds or (1 if ctx.smoke else 10), a.connections, a.threads)
    bench = Bench(ctx, load)
    try:
        await bench.open()
        if not ctx.smoke:
            await bench.warm_up(2)
        contenders = CONTENDERS + ((AGAINST,) if a.against else ())
        by_name = {c.name: c for c in contenders}
        names = [c.name for c in contenders if not a.only or c.name in a.only.split(",")]

        async def one(name: str, round_no: int) -> Run:
            return await bench.run(by_name[name], round_no)

        ran = await round_robin(names, ctx.rounds, one, ctx.noise, SHOWN)
        runs = {name: ran.get(name, []) for name in by_name}
        prof: dict[str, Any] | None = None
        minimal_prof: dict[str, Any] | None = None
        against_prof: dict[str, Any] | None = None
        if not a.no_profile:
            seconds = 1 if ctx.smoke else 8
            prof = await profile_server(bench, by_name["oncely"], seconds, rules)
            minimal_prof = await profile_server(bench, by_name["minimal"], seconds, rules)
            if a.against:
                # The same buckets: where a revision's CPU per request went.
                against_prof = await profile_server(bench, by_name["against"], seconds, rules)
    finally:
        await bench.close()
    pairs = {
        "oncely_vs_minimal": ("oncely", "minimal"),
        "oncely_vs_floor": ("oncely", "floor"),
        "floor_vs_minimal": ("floor", "minimal"),
        "oncely_dup30_vs_floor": ("oncely_dup30", "floor"),
        "floor_vs_xadd": ("floor", "xadd"),
    }
    ratios = {
        key: {m: _json(ratio(runs[x], runs[y], m)) for m in ("req_per_s", "p99_ms", "p50_ms")}
        for key, (x, y) in pairs.items()
    }

    def of(what: str, ours: str, theirs: str, metric: str, **goal: float) -> Headline:
        return Headline.of(f"intake: {what}", ratio(runs[ours], runs[theirs], metric), **goal)

    headline = [
        of("oncely / minimal, req/s", "oncely", "minimal", "req_per_s", at_least=GOAL_THROUGHPUT),
        of("oncely / minimal, p99", "oncely", "minimal", "p99_ms", at_most=GOAL_P99),
        of("oncely / floor (jobs table), req/s", "oncely", "floor", "req_per_s"),
        of("oncely / floor (jobs table), p99", "oncely", "floor", "p99_ms"),
        of("floor (jobs table) / minimal, req/s", "floor", "minimal", "req_per_s"),
        of("oncely 30 % duplicates / floor, req/s", "oncely_dup30", "floor", "req_per_s"),
        of("oncely 30 % duplicates / floor, p99", "oncely_dup30", "floor", "p99_ms"),
        of("floor / XADD only, req/s", "floor", "xadd", "req_per_s"),
    ]
    if a.against:
        headline += [
            of("oncely / --against, req/s", "oncely", "against", "req_per_s"),
            of("CPU per request, oncely / --against", "oncely", "against", "server_cpu_ms_per_req"),
        ]
    detail = {
        "load": asdict(load) | {"dup_rate": 0.3, "dup_gap": DUP_GAP},
        "goal": {"throughput_min": GOAL_THROUGHPUT, "p99_max": GOAL_P99},
        "results": {name: summary(rs) for name, rs in runs.items() if rs},
        "ratios": ratios,
        "profile": prof,
        "profile_minimal": minimal_prof,
        "profile_against": against_prof,
        "against": {"checkout": a.against, "revision": checkout_revision(a.against)}
        if a.against
        else None,
    }
    return headline, detail, all(r.ok for rs in runs.values() for r in rs)


def _json(r: Any) -> Any:
    return None if r is None else r.to_json()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("intake", __doc__ or "", rounds=3, noise=Noise(0.3, 5.0, 1, 40.0))
    p.add_argument("--seconds", type=int, help="wrk duration per run (10; smoke 1)")
    p.add_argument("--connections", type=int, default=32)
    p.add_argument("--threads", type=int, default=2, help="wrk threads")
    p.add_argument(
        "--no-profile",
        action="store_true",
        help="skip the py-spy profiles (oncely, minimal and --against's)",
    )
    p.add_argument(
        "--only",
        help="comma-separated contenders (oncely,floor,minimal,xadd,oncely_dup30); all by default",
    )
    p.add_argument(
        "--against",
        metavar="CHECKOUT",
        type=lambda path: str(Path(path).resolve()),
        help="also run oncely from this checkout (e.g. a git worktree of an earlier "
        "revision) in every round, as the contender 'against'",
    )
    # The floor / XADD-only server, run by the benchmark itself:
    p.add_argument("--serve", choices=("floor", "minimal", "xadd"), help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.serve:
        serve_floor(arguments)
    elif shutil.which("wrk") is None:
        sys.exit("bench.intake needs wrk: apt-get install -y wrk")
    else:
        main("intake", "oncely intake vs durable floor vs XADD only (wrk)", arguments, bench_main)
