"""The worker against a floor: how much of the machine do oncely's guarantees cost?

Side by side on the same jobs, round-robin:

- ``oncely``: a real ``oncely worker --workflow summaries`` process (pre-check,
  fleet limiter, classified retries, owner-checked Lua acks, leases, index,
  NOTIFY, reconciler), the built-in summaries unstreamed as the floors'
  calls are (``bench/worker_app.py``; ``--streamed``: as they ship, each
  answer streamed to the job's live stream);
- ``oncely_lean``: the same worker with ``ONCELY_LLM_CLIENT=lean`` (the model
  called straight over aiohttp, no SDK);
- ``oncely_anthropic``, ``oncely_responses``, ``oncely_background`` (only
  when ``--only`` names them): the same worker in another dialect on the
  same fake: ``ONCELY_LLM_PROVIDER=anthropic`` (the anthropic SDK, ``POST
  /v1/messages``), ``ONCELY_LLM_PROVIDER=responses`` (the openai SDK's
  Responses API, ``POST /v1/responses``), and the latter in background mode
  (``ONCELY_LLM_BACKGROUND_S=1``: each call created in background, its id
  kept as an intent, then polled; its run's checks count the creates and
  polls);
- ``floor_openai``: the same work with none of the guarantees (this module
  with ``--floor-consumer``): batched XREADGROUP, one model call per message
  through the same openai SDK on its aiohttp transport, one statement
  writing the result and the outbox row and marking the job done, batched XACK;
- ``floor_aiohttp``: the same floor calling the model with raw aiohttp;
- ``against`` (with ``--against CHECKOUT``): ``oncely worker`` from another
  checkout (say, a git worktree of an earlier revision), in the same rounds.

Each is its own process, and so is the fake model, so each one's CPU is its
own. Every run starts from a flushed Redis and empty tables with the jobs
already in PostgreSQL and in the stream, and ends with its invariants
checked: every job done once, one result and one outbox row each, nothing
pending, one model call per job.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import psycopg
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool
from redis.asyncio import Redis

from bench.harness import jobs, profile
from bench.harness.drain import Drain
from bench.harness.fakes import API_KEY, FakeModel
from bench.harness.floor import pg_pool, until_stopped, whenever_set
from bench.harness.measure import Headline, Noise, ratio, ratio_json, summary
from bench.harness.processes import clean_env
from bench.harness.report import Context, main, parser
from bench.harness.servers import against_database, checkout_env, fresh_state, fresh_tables
from oncely.builtin.summaries import INSTRUCTION, SUMMARY_READY, dedupe_key, summaries

GOAL = 0.85
KINDS = ("oncely", "oncely_lean", "floor_openai", "floor_aiohttp")
# Contenders that run only when --only names them.
MORE_KINDS = ("oncely_anthropic", "oncely_responses", "oncely_background")
OURS = ("oncely", "oncely_lean", *MORE_KINDS)
# Each contender's dialect (ONCELY_LLM_PROVIDER); the others' is chat.
DIALECTS = {
    "oncely_anthropic": "anthropic",
    "oncely_responses": "responses",
    "oncely_background": "responses",
}
# <dialect> / oncely @256: another dialect costs the worker at most this much
# throughput (and at most its inverse in CPU per job). Background mode has no
# goal: its cost is reported (docs/providers.md, Background calls).
DIALECT_GOAL = 0.9
LEAN_GOAL = 0.8  # oncely_lean / floor_aiohttp @256
# The summaries workflow unstreamed, as the floors' calls are (--streamed:
# the built-in one, streamed).
WORKER_APP = "bench.worker_app:app"
MODEL = "oncely-fake"
HTTP_CONNECTIONS = 1000  # the openai SDK's aiohttp limit; raw aiohttp gets the same
SHOWN = ("jobs", "jobs_per_s", "cpu_ms_per_job", "machine_busy_cores")

# The floor's own SQL, not oncely's: the same rows as ``finish_job`` in one
# round trip (no ON CONFLICT, no NOTIFY).
FLOOR_STORE = """
WITH result AS (
    INSERT INTO results (job_id, result) VALUES (%(job_id)s, %(result)s)
), outbox_row AS (
    INSERT INTO outbox (topic, dedupe_key, payload, workflow, job_id)
    VALUES (%(topic)s, %(dedupe_key)s, %(payload)s, %(workflow)s, %(job_id)s)
)
UPDATE jobs SET status = 'done', updated_at = now() WHERE job_id = %(job_id)s
"""

# Where a consumer's CPU goes: inner work first (the limiter runs inside the
# adapter, the adapter inside the model-call wrappers, those inside the step,
# the step inside the handler).
BUCKETS = {
    "oncely": (
        ("limiter: FleetLimiter (acquire, settle)", ["oncely.llm.limiter:FleetLimiter"]),
        (
            "model call: openai SDK chat.completions.create",
            ["openai.resources.chat.completions:AsyncCompletions.create"],
        ),
        ("model call: OpenAICompatible", ["oncely.llm.openai_compat:OpenAICompatible"]),
        (
            "model call: LeanOpenAICompatible (aiohttp, JSON)",
            ["oncely.llm.lean:LeanOpenAICompatible"],
        ),
        ("model call: Trip.ask (retries, deadline, usage)", ["oncely.llm.trip:Trip.ask"]),
        ("step: summarise (prompt, emit)", ["oncely.builtin.summaries:summarise"]),
        (
            "Postgres statements: run_statement's own task (pre-check, store)",
            ["oncely.sql.bounded:_execute"],
        ),
        (
            "pre-check: Checkpoints.run_of (the job's run, batched)",
            [
                "oncely.jobs.checkpoints:Checkpoints.run_of",
                "oncely.jobs.checkpoints:Checkpoints._load_runs",
            ],
        ),
        ("checkpoints: Journal (replay, keys, pending writes)", ["oncely.journal:Journal"]),
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
            "handler: WorkflowHandler (validate, Context, Model)",
            ["oncely.jobs.handler:WorkflowHandler"],
        ),
        (
            "handler rest: Worker._handle / _process / _run_handler (metrics, logs)",
            ["oncely.queue.worker:Worker._handle"],
        ),
        ("read: XAUTOCLAIM + XREADGROUP + starting tasks", ["oncely.queue.worker:Worker.run_once"]),
        ("leases", ["oncely.queue.worker:Worker.renew_leases"]),
        ("reconciler", ["oncely.jobs.reconcile:Reconciler"]),
        ("trim", ["oncely.queue.stream:Stream.trim"]),
    ),
    "floor": (
        (
            "model call: openai SDK chat.completions.create",
            ["openai.resources.chat.completions:AsyncCompletions.create"],
        ),
        ("model call: raw aiohttp", ["bench.worker:AiohttpModel"]),
        ("store: one statement", ["bench.worker:FloorConsumer._store"]),
        ("ack: XACK batch", ["bench.worker:FloorConsumer._ack_batch"]),
        ("handler rest: parse", ["bench.worker:FloorConsumer._handle"]),
        ("read: XREADGROUP + starting tasks", ["bench.worker:FloorConsumer.run_once"]),
    ),
}


@dataclass(frozen=True)
class Contender:
    kind: str  # "oncely" | "oncely_lean" | "floor_openai" | "floor_aiohttp" | "against"
    concurrency: int
    jobs: int

    @property
    def key(self) -> str:
        return f"{self.kind}@{self.concurrency}"


@dataclass(frozen=True)
class Trial:
    """A contender on its jobs, the model taking ``model_sleep_s`` per call."""

    contender: Contender
    model_sleep_s: float

    @property
    def name(self) -> str:
        return self.contender.key

    @property
    def items(self) -> int:
        return self.contender.jobs

    @property
    def timeout_s(self) -> float:
        c = self.contender
        return 120 + c.jobs * (self.model_sleep_s + 0.05) * 3 / c.concurrency


@dataclass(frozen=True)
class Scenario:
    name: str
    model_sleep_s: float
    contenders: tuple[Contender, ...]


def scenarios(smoke: bool, kinds: Sequence[str] = KINDS) -> list[Scenario]:
    """Job counts sized so each run takes seconds. The smoke run touches
    every kind of contender once, with a few jobs each. ``kinds``: the
    contenders that run (``--only``; ``against`` with ``--against``)."""
    if smoke:
        return [Scenario("instant", 0.0, tuple(Contender(k, 256, 40) for k in kinds))]
    return [
        Scenario("instant", 0.0, _lineup(2000, 200, kinds)),
        Scenario("model_200ms", 0.2, _lineup(2000, 30, kinds)),
    ]


def _lineup(many: int, one: int, kinds: Sequence[str]) -> tuple[Contender, ...]:
    """oncely (both clients) and each floor at 256; oncely and the SDK floor
    at 1 (and the other checkout at both)."""
    at_256 = [Contender(k, 256, many) for k in kinds]
    at_1 = [Contender(k, 1, one) for k in kinds if k in ("oncely", "floor_openai", "against")]
    return (*at_256, *at_1)


# -- the floor consumer (its own process) -----------------------------------------


class OpenAIModel:
    """The summaries step's model call through the openai SDK, as oncely makes it."""

    def __init__(self, base_url: str) -> None:
        import openai

        self.client = openai.AsyncOpenAI(
            base_url=base_url,
            api_key=API_KEY,
            max_retries=0,
            http_client=openai.DefaultAioHttpClient(),
        )

    async def complete(self, system: str, user: str) -> str:
        completion = await self.client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
        )
        return completion.choices[0].message.content or ""

    async def aclose(self) -> None:
        await self.client.close()


class AiohttpModel:
    """The same call with raw aiohttp."""

    def __init__(self, base_url: str) -> None:
        connector = aiohttp.TCPConnector(limit=HTTP_CONNECTIONS, keepalive_timeout=5)
        headers = {"Authorization": f"Bearer {API_KEY}"}
        self.session = aiohttp.ClientSession(connector=connector, headers=headers)
        self.url = f"{base_url}/chat/completions"

    async def complete(self, system: str, user: str) -> str:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        async with self.session.post(self.url, json={"model": MODEL, "messages": messages}) as r:
            r.raise_for_status()
            answer = await r.json()
        return str(answer["choices"][0]["message"]["content"])

    async def aclose(self) -> None:
        await self.session.close()


class FloorConsumer:
    """oncely's work with none of its guarantees: no pre-check, retries, owner
    checks, leases, index or NOTIFY; a failed job is simply left pending."""

    def __init__(
        self,
        redis: Redis,
        pool: AsyncConnectionPool,
        model: OpenAIModel | AiohttpModel,
        concurrency: int,
    ) -> None:
        self.redis = redis
        self.pool = pool
        self.model = model
        self.concurrency = concurrency
        self.consumer = f"floor-{os.getpid()}"
        self._tasks: set[asyncio.Task[None]] = set()
        self._slot_free = asyncio.Event()
        self._acks: list[str] = []
        self._ack_wanted = asyncio.Event()

    async def run(self) -> None:
        acker = asyncio.create_task(whenever_set(self._ack_wanted, self._ack_batch))
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
        summary = await self.model.complete(INSTRUCTION, f"<text>\n{payload['text']}\n</text>")
        await self._store(job_id, payload["notify"], summary)
        self._acks.append(entry_id)
        self._ack_wanted.set()

    async def _store(self, job_id: str, to: str, summary: str) -> None:
        row = {
            "job_id": job_id,
            "result": Jsonb({"summary": summary}),
            "topic": SUMMARY_READY,
            "dedupe_key": dedupe_key(job_id),
            "payload": Jsonb({"job_id": job_id, "to": to, "summary": summary}),
            "workflow": summaries.name,
        }
        async with self.pool.connection() as conn:
            await conn.execute(FLOOR_STORE, row)

    async def _ack_batch(self) -> None:
        ids, self._acks = self._acks, []
        if ids:
            await self.redis.xack(summaries.keys.stream, summaries.keys.group, *ids)


async def floor_main(args: argparse.Namespace) -> None:
    model = OpenAIModel(args.llm_url) if args.transport == "openai" else AiohttpModel(args.llm_url)
    redis = Redis.from_url(args.redis_url, decode_responses=True)
    try:
        async with pg_pool(args.database_url) as pool:
            await until_stopped(FloorConsumer(redis, pool, model, args.concurrency).run())
    finally:
        await model.aclose()
        await redis.aclose()


# -- one run --------------------------------------------------------------------------


class Bench(Drain[Trial, FakeModel]):
    """Jobs in PostgreSQL and the stream, a consumer draining them."""

    item = "job"
    fake_name = "fake_model"
    shown = SHOWN

    def __init__(self, ctx: Context, model: FakeModel) -> None:
        super().__init__(ctx, model)
        self.redis = Redis.from_url(ctx.servers.redis_url, decode_responses=True)
        self.job_ids: list[str] = []  # the run's, for its checks
        # With --against: the other checkout's database (its URL and connection).
        self.against_url: str | None = None
        self.dbs: dict[str, psycopg.AsyncConnection[Any]] = {}

    async def open(self) -> None:
        await super().open()
        self.dbs["oncely"] = self.db
        if self.ctx.args.against:
            self.against_url = await against_database(self.ctx.servers, self.ctx.args.against)
            self.dbs["against"] = await psycopg.AsyncConnection.connect(
                self.against_url, autocommit=True
            )

    async def close(self) -> None:
        for db in self.dbs.values():
            if db is not self.db:
                await db.close()
        await super().close()
        await self.redis.aclose()

    async def load(self, trial: Trial) -> None:
        # Every run's waits and checks on the database its contender uses.
        self.db = self.dbs["against" if trial.contender.kind == "against" else "oncely"]
        if trial.contender.kind == "against":
            await fresh_tables(self.redis, self.db)
        else:
            await fresh_state(self.redis, self.db)
        await self.fake.reset()
        self.job_ids = await jobs.preload(self.redis, self.db, trial.items, trial.model_sleep_s)

    def spawn(self, trial: Trial) -> subprocess.Popen[bytes]:
        s, c = self.ctx.servers, trial.contender
        if c.kind in (*OURS, "against"):
            argv = ["-m", "oncely", "worker", "--workflow", summaries.name]
            database_url = s.database_url
            if c.kind == "against":
                assert self.against_url is not None  # made in open()
                database_url = self.against_url
            settings = {
                "redis_url": s.redis_url,
                "database_url": database_url,
                "llm_base_url": self.fake.url,
                "llm_api_key": API_KEY,
                "worker_concurrency": str(c.concurrency),
                "log_level": "WARNING",
                "llm_client": "lean" if c.kind == "oncely_lean" else "openai",
                "llm_provider": DIALECTS.get(c.kind, "chat"),
            }
            if not self.ctx.args.streamed:
                settings["app"] = WORKER_APP
            if c.kind == "oncely_background":
                settings["llm_background_s"] = "1"  # below the calls' 20 s: each in background
            env = (
                checkout_env(self.ctx.args.against, **settings)
                if c.kind == "against"
                else clean_env(**settings)
            )
        else:
            argv = [
                "-m",
                "bench.worker",
                "--floor-consumer",
                f"--transport={c.kind.removeprefix('floor_')}",
                f"--concurrency={c.concurrency}",
                f"--redis-url={s.redis_url}",
                f"--database-url={s.database_url}",
                f"--llm-url={self.fake.url}",
            ]
            env = clean_env()
        return self.ctx.children.python(c.key, argv, env)

    async def started(self, proc: subprocess.Popen[bytes], within_s: float) -> None:
        await jobs.first_delivery(self.redis, proc, within_s)

    async def drained(self, proc: subprocess.Popen[bytes], trial: Trial, within_s: float) -> None:
        await jobs.all_done(self.db, proc, trial.items, within_s)

    async def checks(self, trial: Trial) -> dict[str, Any]:
        return await jobs.checks(self.redis, self.db, self.fake, self.job_ids)


async def run_scenario(bench: Bench, scenario: Scenario) -> dict[str, Any]:
    trials = [Trial(c, scenario.model_sleep_s) for c in scenario.contenders]
    runs = await bench.run_rounds(trials, scenario.name)
    ratios = {}
    pairs = [(o, t) for o in OURS for t in ("oncely", "floor_openai", "floor_aiohttp", "against")]
    for conc in (256, 1):
        for mine, other in pairs:
            ours, theirs = runs.get(f"{mine}@{conc}"), runs.get(f"{other}@{conc}")
            if ours and theirs and mine != other:
                ratios[f"{mine}_vs_{other}@{conc}"] = {
                    "throughput": ratio_json(ours, theirs, "jobs_per_s"),
                    "throughput_incl_startup": ratio_json(ours, theirs, "jobs_per_s_incl_startup"),
                    "cpu_per_job": ratio_json(ours, theirs, "cpu_ms_per_job"),
                }
    return {
        "scenario": scenario.name,
        "model_sleep_s": scenario.model_sleep_s,
        "results": {key: summary(rs) for key, rs in runs.items()},
        "ratios": ratios,
        "_runs": runs,
    }


# -- the benchmark -------------------------------------------------------------------------


async def bench_main(ctx: Context) -> tuple[list[Headline], dict[str, Any], bool]:
    rules = {kind: profile.buckets(spec) for kind, spec in BUCKETS.items()}  # fail fast
    bench = Bench(ctx, FakeModel.start(ctx.children))
    await bench.open()
    try:
        results = [await run_scenario(bench, s) for s in scenarios(ctx.smoke, kinds_of(ctx.args))]
        profiles = []
        if ctx.args.profile:
            # A smoke run profiles oncely once; --against adds the other
            # checkout's worker, under oncely's buckets (matched by name).
            wanted = ("oncely",) if ctx.smoke else (*OURS, "floor_openai", "floor_aiohttp")
            kinds = tuple(k for k in (*wanted, "against") if k in kinds_of(ctx.args))
            for kind in kinds:
                rule = rules["floor" if kind.startswith("floor") else "oncely"]
                n = 60 if ctx.smoke else 4000
                profiles.append(await bench.profile(Trial(Contender(kind, 256, n), 0.0), rule))
    finally:
        await bench.close()
    ok = all(r.ok for s in results for rs in s["_runs"].values() for r in rs)
    ok = ok and all(p["checks_ok"] for p in profiles)
    headline = [h for s in results for h in _headlines(s["scenario"], s.pop("_runs"))]
    detail = {
        "streamed": ctx.args.streamed,
        "goal": GOAL,
        "lean_goal": LEAN_GOAL,
        "scenarios": results,
        "profiles": profiles or None,
    }
    return headline, detail, ok


def _headlines(scenario: str, runs: dict[str, Any]) -> list[Headline]:
    """Each of oncely's workers over each floor, the lean over the SDK's, and
    oncely over --against."""
    headline = []
    for mine in OURS:
        for floor in ("floor_openai", "floor_aiohttp"):
            for conc in (256, 1):
                ours, theirs = runs.get(f"{mine}@{conc}"), runs.get(f"{floor}@{conc}")
                if ours and theirs:
                    what = f"worker {scenario}: {mine} / {floor} @{conc}, jobs/s"
                    goal = _goal(mine, floor, conc)
                    headline.append(Headline.of(what, ratio(ours, theirs, "jobs_per_s"), **goal))
    ours, theirs = runs.get("oncely_lean@256"), runs.get("oncely@256")
    if ours and theirs:
        what = f"worker {scenario}: oncely_lean / oncely @256"
        for metric, unit in (("jobs_per_s", "jobs/s"), ("cpu_ms_per_job", "CPU per job")):
            headline.append(Headline.of(f"{what}, {unit}", ratio(ours, theirs, metric)))
    headline += _dialect_headlines(scenario, runs)
    for conc in (256, 1):
        ours, theirs = runs.get(f"oncely@{conc}"), runs.get(f"against@{conc}")
        if ours and theirs:
            what = f"worker {scenario}: oncely / --against @{conc}"
            for metric, unit in (("jobs_per_s", "jobs/s"), ("cpu_ms_per_job", "CPU per job")):
                headline.append(Headline.of(f"{what}, {unit}", ratio(ours, theirs, metric)))
    return headline


def _dialect_headlines(scenario: str, runs: dict[str, Any]) -> list[Headline]:
    """Each other dialect's worker over the chat one's, on the same fake."""
    headline = []
    theirs = runs.get("oncely@256")
    for kind in DIALECTS:
        ours = runs.get(f"{kind}@256")
        if not (ours and theirs):
            continue
        what = f"worker {scenario}: {kind} / oncely (chat) @256"
        goal = kind != "oncely_background"
        jobs_per_s = ratio(ours, theirs, "jobs_per_s")
        cpu = ratio(ours, theirs, "cpu_ms_per_job")
        headline += [
            Headline.of(
                f"{what}, jobs/s", jobs_per_s, **({"at_least": DIALECT_GOAL} if goal else {})
            ),
            Headline.of(
                f"{what}, CPU per job", cpu, **({"at_most": 1 / DIALECT_GOAL} if goal else {})
            ),
        ]
    return headline


def _goal(mine: str, floor: str, concurrency: int) -> dict[str, float]:
    """oncely's against the SDK floor, the lean client's against raw aiohttp
    (both at 256 in flight)."""
    if concurrency == 256 and (mine, floor) == ("oncely", "floor_openai"):
        return {"at_least": GOAL}
    if concurrency == 256 and (mine, floor) == ("oncely_lean", "floor_aiohttp"):
        return {"at_least": LEAN_GOAL}
    return {}


def kinds_of(args: argparse.Namespace) -> tuple[str, ...]:
    """The contenders ``--only`` names (all by default), and ``against``
    with ``--against``."""
    kinds = tuple(args.only.split(",")) if args.only else KINDS
    return kinds + (("against",) if args.against else ())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(
        "worker",
        __doc__ or "",
        rounds=3,
        noise=Noise(0.3, 30.0, 2, 90.0),
        profile="also py-spy oncely@256 and floor_openai@256 (and --against's worker; "
        "instant model): CPU per bucket",
    )
    p.add_argument(
        "--only",
        type=_kinds,
        help="comma-separated contenders ("
        + ",".join((*KINDS, *MORE_KINDS))
        + "); all but "
        + ",".join(MORE_KINDS)
        + " by default",
    )
    p.add_argument(
        "--against",
        metavar="CHECKOUT",
        type=lambda path: str(Path(path).resolve()),
        help="also run `oncely worker` from this checkout (e.g. a git worktree of an "
        "earlier revision) in every round, as the contender 'against'",
    )
    p.add_argument(
        "--streamed",
        action="store_true",
        help="run the built-in summaries as they are, each answer streamed to the "
        "job's live stream (by default unstreamed, as the floors' calls are: "
        "bench/worker_app.py)",
    )
    # The floor consumer, run by the benchmark itself:
    p.add_argument("--floor-consumer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--transport", choices=("openai", "aiohttp"), help=argparse.SUPPRESS)
    p.add_argument("--concurrency", type=int, default=256, help=argparse.SUPPRESS)
    p.add_argument("--llm-url", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _kinds(value: str) -> str:
    unknown = sorted(set(value.split(",")) - {*KINDS, *MORE_KINDS})
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown contender {unknown[0]!r}")
    return value


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.floor_consumer:
        import uvloop  # what `oncely worker` runs on too

        uvloop.run(floor_main(arguments))
    else:
        main("worker", "oncely worker vs floor consumers", arguments, bench_main)
