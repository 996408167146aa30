"""An agent with three tool turns and a call against the same work written by
hand with ``ctx.step`` and ``ctx.call``: what does the agent loop cost in
jobs/s and PostgreSQL statements, and how long does a call wait in the
outbox?

Side by side on the same cases, round-robin, each a real ``oncely worker``
process (``--app bench.agents_app:app``) on the fake model, with one
``oncely relay`` (shared, started once) sending the calls to the fake
receiver:

- ``agent``: four model turns (three call a tool: two function tools and a
  call tool), so two tool checkpoints, one call, four model checkpoints;
- ``by_hand``: the same four model calls, two ``ctx.step`` and one
  ``ctx.call`` in a fixed order;
- ``pydantic_ai``, ``openai_agents``, ``langgraph``: the same agent (same
  instructions, tools, turns and call) written in each framework and run
  through its integration (``oncely.integrations.<framework>.run``).

Reported per contender: jobs/s and CPU per job, the worker's PostgreSQL
statements per job and per model turn (``pg_stat_statements``, as in
``bench.steps``), and the call's wait: from the call's checkpoint written
(the job starts waiting) to the job queued again by the relay's answer,
p50 and p99; and each against ``agent`` (``oncely.Agent``), round by round:
jobs/s, CPU per job (the frameworks' goal: at most 1.2 ×) and statements
per turn (goal: equal). Every run ends with its invariants: every job done
once, four model calls per job, each side call once, one call per job at
the receiver with one effect, nothing pending. ``--profile`` also py-spies
every worker (at 64, on 400 jobs): CPU per bucket, the agent's own loop,
the integrations' adapter and each framework's own code apart.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import uuid
from dataclasses import dataclass
from typing import Any

from psycopg.types.json import Jsonb

from bench import agents_app
from bench.harness import profile
from bench.harness.fakes import API_KEY, FakeMail, FakeModel
from bench.harness.measure import Headline, Noise, ratio, ratio_json, say, summary
from bench.harness.processes import clean_env
from bench.harness.report import Context, main, parser
from bench.harness.servers import count, fresh_state
from bench.steps import BUCKETS as STEP_BUCKETS
from bench.steps import Bench as StepsBench
from bench.steps import Statements, _median, _per_round, count_statements
from oncely.queue.stream import JobMessage, Stream
from oncely.sql import query
from oncely.workflow import Workflow

APP = "bench.agents_app:app"
SECRET = "bench-agents-webhook-secret"
SHOWN = ("jobs", "jobs_per_s", "cpu_ms_per_job", "statements_per_turn", "call_wait_p50_ms")
TURNS = 4  # model calls per job, either way
OURS, THEIRS = "agent", "by_hand"
# oncely.Agent with one tool at most once: an intent's cost over a plain tool.
ONCE = "at_most_once"
FRAMEWORKS = ("pydantic_ai", "openai_agents", "langgraph")
# A framework's worker CPU per job against oncely.Agent's (the goal in docs/performance.md).
FRAMEWORK_CPU_AT_MOST = 1.2
# The steps benchmark's buckets, with the agent's own work first (inner
# work before what encloses it: harness/profile.py). For the frameworks:
# the model turn and the tool checkpoints as oncely.Agent has them, then
# the adapter (FrameworkRun; the integration's conversions, with the
# framework helpers they call), then everything else of the framework's.
# Imports are not sampled: py-spy attaches once the worker started.
BUCKETS = (
    ("tool: Tool.run (arguments validated, the function, its JSON)", ["oncely.tools:Tool"]),
    ("model turn: Model.respond (messages, tools, Reply)", ["oncely.llm.model:Model.respond"]),
    (
        "framework's tool checkpoint: Context.tool (the framework's tool call inside it)",
        ["oncely.context:Context.tool"],
    ),
    (
        "adapter: FrameworkRun (limits, the calls' scopes, usage)",
        ["oncely.integrations.runs:FrameworkRun"],
    ),
    (
        "adapter: the integration's conversions (messages, tool specs, replies, wrappers)",
        [
            "oncely.integrations.pydantic_ai:OncelyModel",
            "oncely.integrations.pydantic_ai:conversation",
            "oncely.integrations.pydantic_ai:_response",
            "oncely.integrations.pydantic_ai:CheckpointedToolset",
            "oncely.integrations.pydantic_ai:OncelyCheckpoints",
            "oncely.integrations.pydantic_ai:_refuse_durability",
            "oncely.integrations.openai_agents:OncelyModel",
            "oncely.integrations.openai_agents:chat_messages",
            "oncely.integrations.openai_agents:tool_specs",
            "oncely.integrations.openai_agents:model_response",
            "oncely.integrations.openai_agents:_Clones",
            "oncely.integrations.openai_agents:_needs_approval",
            "oncely.integrations.openai_agents:_json_object",
            "oncely.integrations.openai_agents:_as_json",
            "oncely.integrations.langgraph:OncelyChatModel",
            "oncely.integrations.langgraph:openai_messages",
            "oncely.integrations.langgraph:ai_message",
            "oncely.integrations.langgraph:_CheckpointedTool",
            "oncely.integrations.langgraph:_OncelyTool",
        ],
    ),
    (
        "framework: its own code (Pydantic AI, the Agents SDK, LangGraph, LangChain)",
        ["pydantic_ai/", "pydantic_graph/", "agents/", "langgraph/", "langchain_core/"],
    ),
    # After the frameworks': their agents are classes named Agent too.
    ("agent loop: Agent (turns, messages, tool calls, limits)", ["oncely.agent:Agent"]),
    (
        "step: the workflows' own code",
        [
            f"bench.agents_app:{step}"
            for step in ("with_agent", "with_agent_once", "by_hand", *agents_app.STEPS)
        ],
    ),
    *(bucket for bucket in STEP_BUCKETS if not bucket[0].startswith("step:")),
)
WORKFLOWS = {
    OURS: agents_app.agent,
    THEIRS: agents_app.hand,
    ONCE: agents_app.agent_once,
    "pydantic_ai": agents_app.with_pai,
    "openai_agents": agents_app.with_oaa,
    "langgraph": agents_app.with_lg,
}
KINDS = (OURS, THEIRS, ONCE, *FRAMEWORKS)
# The statements a job's path makes: checkpoint writes, the wait (one
# statement, the lock inside it), the finish. The others are batched or
# periodic (the pre-check's job_runs, notify_outbox, the usage ledger, the
# scheduler's sweeps), so their count per job moves with timing; so do
# write_checkpoints' and finish_job's, batched across jobs (equal work:
# equal checkpoint rows, ``checkpoint_rows``, and at most one finish a
# job); the wait is one per job (``PER_JOB``: equal for equal work).
JOB_PATH = ("write_checkpoints", "start_wait", "finish_job")
PER_JOB = ("start_wait",)


@dataclass(frozen=True)
class Contender:
    kind: str
    concurrency: int
    jobs: int

    @property
    def key(self) -> str:
        return f"{self.kind}@{self.concurrency}"

    @property
    def workflow(self) -> Workflow[Any, Any]:
        return WORKFLOWS[self.kind]


@dataclass(frozen=True)
class Trial:
    contender: Contender

    @property
    def name(self) -> str:
        return self.contender.key

    @property
    def items(self) -> int:
        return self.contender.jobs

    @property
    def timeout_s(self) -> float:
        return 180 + self.contender.jobs * TURNS * 0.05


def lineup(smoke: bool, only: str | None = None) -> tuple[Contender, ...]:
    """Every kind (``--only``: those named, ``agent`` always among them: the
    ratios are against it)."""
    kinds = KINDS if not only else (OURS, *(k for k in only.split(",") if k != OURS))
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise SystemExit(f"unknown contender {unknown[0]!r}: one of {', '.join(KINDS)}")
    jobs = 20 if smoke else 400
    return tuple(Contender(kind, 64, jobs) for kind in kinds)


def case(i: int) -> str:
    sku = f"SKU-{i:05d}"
    return f"{sku} The item arrived broken; please refund it. {agents_app.directives(sku)}"


class Bench(StepsBench):
    """``bench.steps``' course, with the relay and the fake receiver the
    calls need, and this benchmark's invariants and call waits."""

    def __init__(
        self, ctx: Context, model: FakeModel, mail: FakeMail, statements: Statements | None
    ) -> None:
        super().__init__(ctx, model, statements)
        self.mail = mail
        self.relay: subprocess.Popen[bytes] | None = None

    async def open(self) -> None:
        await super().open()
        await self.mail.ready()
        s = self.ctx.servers
        env = clean_env(
            app=APP,
            redis_url=s.redis_url,
            database_url=s.database_url,
            webhook_url=self.mail.root_url + "/v1/events",
            webhook_secret=SECRET,
            log_level="WARNING",
        )
        self.relay = self.ctx.children.python("relay", ["-m", "oncely", "relay"], env)

    async def close(self) -> None:
        if self.relay is not None:
            self.ctx.children.kill(self.relay)
        await super().close()

    async def load(self, trial: Trial) -> None:  # type: ignore[override]
        await fresh_state(self.redis, self.db)
        await self.fake.reset()
        await self.mail.reset()
        self.side_calls.write_bytes(b"")
        self.counted = {}
        self.workflow = trial.contender.workflow
        messages = [
            JobMessage.new(str(uuid.uuid4()), "bench", {"text": case(i)})
            for i in range(trial.items)
        ]
        async with self.db.cursor() as cur:
            rows = [(m.job_id, m.tenant, self.workflow.name, Jsonb(m.payload)) for m in messages]
            await cur.executemany(query("insert_job"), rows)
        stream = Stream(self.redis, self.workflow.keys)
        await stream.ensure_group()
        for m in messages:
            await stream.enqueue(m)
        self.job_ids = [m.job_id for m in messages]
        if self.statements is not None:
            await self.statements.reset(self.db)

    def spawn(self, trial: Trial) -> subprocess.Popen[bytes]:  # type: ignore[override]
        s, c = self.ctx.servers, trial.contender
        env = clean_env(
            app=APP,
            redis_url=s.redis_url,
            database_url=self.statements.worker_url if self.statements else s.database_url,
            llm_base_url=self.fake.url,
            llm_api_key=API_KEY,
            worker_concurrency=str(c.concurrency),
            webhook_secret=SECRET,
            log_level="WARNING",
            bench_side_calls=str(self.side_calls),
        )
        argv = ["-m", "oncely", "worker", "--workflow", c.workflow.name]
        return self.ctx.children.python(c.key, argv, env)

    async def checks(self, trial: Trial) -> dict[str, Any]:  # type: ignore[override]
        n = len(self.job_ids)
        statements = await self._statements(trial)
        waits = await self._call_waits()
        calls = await self.fake.calls()
        deliveries = await self.mail.deliveries()
        side = self.side_calls.read_text().splitlines()
        db = self.db
        c: dict[str, Any] = {
            "jobs": n,
            "done": await count(db, "SELECT count(*) FROM jobs WHERE status = 'done'"),
            "model_calls": int(calls["total"]),
            "model_calls_expected": n * TURNS,
            "side_calls": len(side),
            "side_calls_distinct": len(set(side)),
            "calls_sent": int(deliveries["requests"]),
            "calls_effects": int(deliveries["effects"]),
            "calls_answered": await count(
                db, "SELECT count(*) FROM outbox WHERE answer IS NOT NULL"
            ),
            "pending_after_done": await self._settled(trial.contender.workflow),
            "checkpoint_rows": await count(db, "SELECT count(*) FROM checkpoints"),
            "statements": statements,
        }
        c["ok"] = (
            c["done"] == n
            and c["model_calls"] == c["model_calls_expected"]
            and c["side_calls"] == c["side_calls_distinct"] == 2 * n
            and c["calls_effects"] == c["calls_answered"] == n
            and c["pending_after_done"] == 0
        )
        if waits:
            self.counted["call_wait_p50_ms"] = round(statistics.median(waits), 1)
            self.counted["call_wait_p99_ms"] = round(
                statistics.quantiles(waits, n=100)[98] if len(waits) > 1 else waits[0], 1
            )
        return c

    async def _statements(self, trial: Trial) -> dict[str, int] | None:
        if self.statements is None:
            return None
        counted = await self.statements.read(self.db)
        n = trial.items
        calls = sum(c.calls for c in counted)
        self.counted = {
            "statements_per_job": round(calls / n, 3),
            "statements_per_turn": round(calls / (n * TURNS), 3),
            "job_path_statements_per_turn": round(
                sum(c.calls for c in counted if c.name in JOB_PATH) / (n * TURNS), 3
            ),
            "pg_exec_ms_per_job": round(sum(c.exec_ms for c in counted) / n, 3),
        } | {f"statements_per_job.{c.name}": round(c.calls / n, 3) for c in counted}
        return {c.name: c.calls for c in counted}

    async def _call_waits(self) -> list[float]:
        """Per job, ms from its call's checkpoint written to its resume."""
        cur = await self.db.execute(
            "SELECT extract(epoch FROM j.resumed_at - c.created_at) * 1000"
            "  FROM checkpoints c JOIN jobs j USING (job_id)"
            " WHERE c.kind = 'call' AND j.resumed_at IS NOT NULL"
        )
        return [float(r[0]) for r in await cur.fetchall()]


def _intent_cost(conc: int, once: list[Any], ours: list[Any]) -> Headline:
    """The job path's statements per job with one tool at most once, over
    the same agent's: what its intent costs (the goal: at most one)."""
    per_job = "job_path_statements_per_turn"
    rounds = [
        round((a - b) * TURNS, 3)
        for a, b in zip(_per_round(once, per_job), _per_round(ours, per_job), strict=False)
    ]
    value = round(statistics.median(rounds), 3) if rounds else None
    return Headline(
        f"agents @{conc}: an at-most-once tool's statements over a plain tool's, per job",
        value,
        "statements",
        rounds,
        at_most=1.0,
    )


async def bench_main(ctx: Context) -> tuple[list[Headline], dict[str, Any], bool]:
    rules = profile.buckets(BUCKETS)  # fail fast on a renamed function
    statements, counted_by = await count_statements(ctx)
    if statements is None:
        say(f"statements not counted: {counted_by}")
    model = FakeModel.start(ctx.children)
    mail = FakeMail.start(ctx.children, "fake-receiver")
    bench = Bench(ctx, model, mail, statements)
    await bench.open()
    profiles = []
    contenders = lineup(ctx.smoke, ctx.args.only)
    try:
        runs = await bench.run_rounds([Trial(c) for c in contenders], "agents ")  # type: ignore[misc]
        if ctx.args.profile:
            # Smoke: the agent and one framework, so both kinds of bucket are read.
            for contender in _profiled(contenders, ctx.smoke):
                profiles.append(await bench.profile(Trial(contender), rules))  # type: ignore[arg-type]
    finally:
        await bench.close()
    ok = all(r.ok for rs in runs.values() for r in rs) and all(p["checks_ok"] for p in profiles)
    conc = contenders[0].concurrency
    found = {c.kind: runs[c.key] for c in contenders}
    ours = found[OURS]
    headline = []
    if THEIRS in found:
        headline.append(
            Headline.of(
                f"agents @{conc}: an agent / the same work by hand, jobs/s",
                ratio(ours, found[THEIRS], "jobs_per_s"),
            )
        )
    for kind in found:
        if kind in FRAMEWORKS:
            headline += _framework_headlines(kind, conc, found[kind], ours)
    if ONCE in found:
        headline.append(_intent_cost(conc, found[ONCE], ours))
    for kind, kept in found.items():
        for metric, unit in (
            ("cpu_ms_per_job", "ms"),
            ("statements_per_turn", "/ turn"),
            ("call_wait_p50_ms", "ms"),
            ("call_wait_p99_ms", "ms"),
        ):
            headline.append(
                Headline(
                    f"agents, {kind}: {metric}",
                    _median(kept, metric),
                    unit,
                    _per_round(kept, metric),
                )
            )
    detail = {
        "profiles": profiles or None,
        "statements_counted_by": counted_by,
        "turns_per_job": TURNS,
        "framework_cpu_per_job_at_most": FRAMEWORK_CPU_AT_MOST,
        "results": {key: summary(rs) for key, rs in runs.items()},
        "ratios": {
            f"{kind}_vs_{OURS}@{conc}": {
                "throughput": ratio_json(kept, ours, "jobs_per_s"),
                "cpu_per_job": ratio_json(kept, ours, "cpu_ms_per_job"),
                "statements_per_job": ratio_json(kept, ours, "statements_per_job"),
                "statements_per_turn": ratio_json(kept, ours, "statements_per_turn"),
                "job_path_statements_per_turn": ratio_json(
                    kept, ours, "job_path_statements_per_turn"
                ),
            }
            for kind, kept in found.items()
            if kind != OURS
        },
    }
    return headline, detail, ok


def _profiled(contenders: tuple[Contender, ...], smoke: bool) -> tuple[Contender, ...]:
    if not smoke:
        return contenders
    framework = next((c for c in contenders if c.kind in FRAMEWORKS), None)
    return (contenders[0],) if framework is None else (contenders[0], framework)


def _framework_headlines(
    kind: str, conc: int, theirs: list[Any], ours: list[Any]
) -> list[Headline]:
    """A framework against ``oncely.Agent``: jobs/s; CPU per job (goal: at
    most 1.2 ×); statements per turn, all of them and the job path's
    (``JOB_PATH``; goal: equal)."""
    return [
        Headline.of(f"agents @{conc}: {kind} / agent, jobs/s", ratio(theirs, ours, "jobs_per_s")),
        Headline.of(
            f"agents @{conc}: {kind} / agent, worker CPU per job",
            ratio(theirs, ours, "cpu_ms_per_job"),
            at_most=FRAMEWORK_CPU_AT_MOST,
        ),
        Headline.of(
            f"agents @{conc}: {kind} / agent, statements per turn",
            ratio(theirs, ours, "statements_per_turn"),
        ),
        Headline.of(
            f"agents @{conc}: {kind} / agent, the job path's statements per turn",
            ratio(theirs, ours, "job_path_statements_per_turn"),
            at_most=1.0,
        ),
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(
        "agents",
        __doc__ or "",
        rounds=3,
        noise=Noise(0.3, 30.0, 2, 90.0),
        profile="also py-spy every worker: CPU per bucket, the agent's loop, the"
        " integrations' adapter and each framework's own code apart",
    )
    p.add_argument(
        "--only",
        help=f"comma-separated contenders, of {', '.join(KINDS)} (agent always runs)",
    )
    return p.parse_args(argv)


if __name__ == "__main__":
    main(
        "agents",
        "an agent vs the same work by hand and through each framework's integration",
        parse_args(),
        bench_main,
    )
