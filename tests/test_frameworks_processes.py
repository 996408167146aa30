"""Framework agents (Pydantic AI, the OpenAI Agents SDK, LangGraph: the
examples/*_support.py apps) through real `oncely api`, `worker` and `relay`
processes, the fake model and the fake receiver: each turn paid once, the
lookup run once, the refund sent once and its answer told to the model; a
framework's own approval flag waits for a person through the API and the
CLI; and a soak per framework that SIGKILLs workers and the relay while
agents run (docs/frameworks.md)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.exceptions import ResponseError

from oncely.api.auth import create_api_key
from oncely.names import workflow_keys
from oncely.senders.webhook import verify
from tests.helpers import all_done, rows, scalar, webhook_events
from tests.processes import (
    SECRET,
    Deployment,
    deployment_env,
    free_port,
    oncely,
    repays_allowed,
    running,
    start,
    wait_for,
    wait_healthy,
)
from tests.steps_app import SIDE_CALLS, side_calls
from tests.test_agents_processes import LOOKUP, SOAK_ENV, done, refund, request

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


# A framework's imports take seconds on a loaded machine, three processes at once.
STARTED_WITHIN_S = 120
# What every support example's run reaches, in order: three turns, the
# lookup between the first two, the refund's call between the last two.
STEPS = [
    ("support/model", "model", None),
    ("support/lookup_order/tool", "tool", "lookup_order"),
    ("support/model#2", "model", None),
    ("support/refund/call", "call", "refund"),
    ("support/model#3", "model", None),
]


@dataclass(frozen=True)
class Framework:
    """One framework's support example, and its desk in tests/frameworks_app.py."""

    app: str
    workflow: str
    route: str
    # The example emails its reply too (an effect besides the refund).
    replies: bool
    # Its app in tests/frameworks_app.py: one workflow, `<desk>_desk`.
    desk: str

    @property
    def desk_app(self) -> str:
        return f"tests.frameworks_app:{self.desk}"

    @property
    def desk_route(self) -> str:
        return f"/v1/{self.desk}-desk"


FRAMEWORKS = {
    "pydantic_ai": Framework(
        "examples.pydantic_ai_support:app", "pai_support", "/v1/pai-support", True, "pai"
    ),
    "openai_agents": Framework(
        "examples.openai_agents_support:app", "support_oaa", "/v1/support-oaa", True, "oaa"
    ),
    "langgraph": Framework(
        "examples.langgraph_support:app", "lg_support", "/v1/lg-support", True, "lg"
    ),
}


@pytest.fixture(params=sorted(FRAMEWORKS))
def framework(request: pytest.FixtureRequest) -> Framework:
    return FRAMEWORKS[request.param]


async def ask(client: httpx.AsyncClient, framework: Framework, text: str, key: str) -> str:
    """A support request to the framework's example: its job's id."""
    posted = await client.post(
        framework.route, json=request(text), headers={"Idempotency-Key": key}
    )
    assert posted.status_code == 202, posted.text
    return str(posted.json()["job_id"])


async def test_a_framework_agent_looks_up_once_refunds_once_and_the_model_hears_the_refund(
    redis_url, database_url, api_key, redis, pool, providers, tmp_path, framework
):
    model, mail = providers
    env = deployment_env(redis_url, database_url, model, mail)
    with Deployment(env, tmp_path, app=framework.app) as d:
        async with d.client(api_key, STARTED_WITHIN_S) as client:
            text = f"My teapot A-1001 broke. {LOOKUP} {refund('A-1001', 4200)}"
            job_id = await ask(client, framework, text, f"{framework.workflow}-end-to-end-1")
            view = await done(client, job_id, framework.route)

            async def delivered() -> bool:
                return (await mail.deliveries())["effects"] == 1 + framework.replies

            await wait_for(delivered, STARTED_WITHIN_S, what="the refund (and the reply)")

            async def ledgered() -> bool:
                found = await scalar(
                    pool, "SELECT count(*) FROM model_calls WHERE job_id = %s", job_id
                )
                return bool(found == 3)

            await wait_for(ledgered, what="three model calls in the ledger")

    assert view["status"] == "done", view
    assert view["result"]["refunded_cents"] == 4200
    assert [(s["key"], s["kind"], s["tool"]) for s in view["steps"]] == STEPS
    assert model.stats().total == 3, "one model call per turn"
    told = [m for m in model.model.recent[-1] if m["role"] == "tool"]
    assert len(told) == 2, "the last turn heard the lookup once and the refund once"
    assert "teapot" in told[0]["content"], "the lookup's answer"
    by_key = (await mail.deliveries())["by_key"]
    assert by_key[f"refund.issue:{job_id}:support/refund/call"] == 1
    [call] = webhook_events(tmp_path / "mailbox.jsonl", "refund.issue")
    assert verify(SECRET, call["headers"], call["body"].encode())
    assert call["data"]["cents"] == 4200
    assert call["id"] in told[1]["content"], "the receiver's answer reached the model"
    ledger = await rows(pool, "SELECT step, outcome FROM model_calls WHERE job_id = %s", job_id)
    assert sorted(ledger) == [(k, "ok") for k, kind, _ in STEPS if kind == "model"]


async def test_a_framework_approval_flag_waits_for_a_person_through_the_api_and_the_cli(
    redis_url, database_url, api_key, redis, pool, providers, tmp_path, framework
):
    """The tool flagged with the framework's own approval runs for no job
    before its decision; one job is approved through the route, one with
    `oncely jobs approve`; each then runs the tool once."""
    model, mail = providers
    side = tmp_path / "side.jsonl"
    env = deployment_env(redis_url, database_url, model, mail, **{SIDE_CALLS: str(side)})
    route = framework.desk_route
    with Deployment(env, tmp_path, app=framework.desk_app) as d:
        async with d.client(api_key, STARTED_WITHIN_S) as client:
            ids = []
            for how in ("api", "cli"):
                text = f'Cancel A-1001 ({how}). [[fake:tool=cancel_order {{"order_id": "A-1001"}}]]'
                posted = await client.post(
                    route,
                    json={"text": text},
                    headers={"Idempotency-Key": f"desk-{framework.desk}-{how}-00001"},
                )
                assert posted.status_code == 202, posted.text
                ids.append(posted.json()["job_id"])

            views: dict[str, dict[str, Any]] = {}

            async def waiting() -> bool:
                for job_id in ids:
                    views[job_id] = (await client.get(f"{route}/{job_id}")).json()
                return all(
                    v["status"] == "waiting" and "approval" in (v["waiting"] or {})
                    for v in views.values()
                )

            await wait_for(waiting, STARTED_WITHIN_S, what="both approval waits")
            assert side_calls(side) == [], "nothing ran before a decision"
            for view in views.values():
                assert view["waiting"]["approval"]["tool"] == "cancel_order"
                assert [(s["key"], s["status"]) for s in view["steps"]] == [
                    ("desk/model", "done"),
                    ("desk/cancel_order/approval", "waiting"),
                ]
            assert model.stats().total == 2, "one turn each, then the wait"

            by_api, by_cli = ids
            call = views[by_api]["waiting"]["approval"]["call_id"]
            decided = await client.post(
                f"{route}/{by_api}/approvals/{call}",
                json={"approved": True},
                headers={"Idempotency-Key": "desk-approve-api-0001"},
            )
            assert decided.status_code == 202, decided.text
            call = views[by_cli]["waiting"]["approval"]["call_id"]
            approved = await asyncio.to_thread(
                oncely, "--app", framework.desk_app, "jobs", "approve", by_cli, call, env=env
            )
            assert approved.returncode == 0, approved.stderr
            assert approved.stdout.split() == [by_cli, call, "approved"]
            finished = [await done(client, job_id, route) for job_id in ids]

    assert [v["status"] for v in finished] == ["done", "done"], finished
    ran = sorted(c["text"] for c in side_calls(side, "cancel_order"))
    assert ran == sorted(f"{job_id}:desk/cancel_order/tool" for job_id in ids), "once each"
    assert model.stats().total == 4
    for view in finished:
        kinds = [(s["kind"], s["tool"]) for s in view["steps"]]
        assert kinds == [
            ("model", None),
            ("approval", "cancel_order"),
            ("tool", "cancel_order"),
            ("model", None),
        ]
    last = list(model.model.recent)[-2:]
    told = [m["content"] for sent in last for m in sent if m["role"] == "tool"]
    assert all("cancelled A-1001" in said for said in told) and len(told) == 2, told


@dataclass
class Fleet:
    """One framework's workers and relay, SIGKILLed and replaced on demand."""

    app: str
    env: dict[str, str]
    logs: Path
    procs: dict[str, list[subprocess.Popen[bytes]]] = field(default_factory=dict)
    kills: dict[str, int] = field(default_factory=lambda: {"worker": 0, "relay": 0})
    # The jobs the killed workers held: each had at most one turn in flight.
    held_at_kills: int = 0

    def spawn(self, kind: str) -> None:
        started = sum(len(p) for p in self.procs.values()) + sum(self.kills.values())
        log = self.logs / f"{kind}{started}.log"
        self.procs.setdefault(kind, []).append(start(["--app", self.app, kind], self.env, log))

    async def kill(self, kind: str, held_by: Callable[[int], Awaitable[int]]) -> None:
        """SIGKILL the one of ``kind`` holding the most jobs, and start another."""
        held = [await held_by(p.pid) for p in self.procs[kind]]
        victim = self.procs[kind].pop(held.index(max(held)))
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        self.kills[kind] += 1
        self.held_at_kills += max(held) if kind == "worker" else 0
        self.spawn(kind)

    def all(self) -> list[subprocess.Popen[bytes]]:
        return [p for procs in self.procs.values() for p in procs]


async def submit_cases(client: httpx.AsyncClient, framework: Framework, n: int) -> list[str]:
    """``n`` agents, each a lookup and a refund of its own amount; every model
    call takes a second, so kills land in the middle of runs."""
    return [
        await ask(
            client,
            framework,
            f"Order A-1001, case {i}. [[fake:sleep=1]] {LOOKUP} {refund('A-1001', 100 + i)}",
            f"{framework.workflow}-soak-{i:04}",
        )
        for i in range(n)
    ]


async def checkpoints_by_job(pool, ids: list[str]) -> dict[str, list[tuple[str, str]]]:
    """Each job's checkpoints (key, kind) in order: the rows its deliveries
    wrote, and the last ones, kept with its result."""
    reached = await rows(
        pool,
        "SELECT job_id, key, kind FROM ("
        " SELECT job_id, key, ordinal, kind FROM checkpoints WHERE job_id = ANY(%s::uuid[])"
        " UNION ALL SELECT r.job_id, k.key, k.ordinal, k.kind FROM results r,"
        " jsonb_to_recordset(r.steps) AS k (key text, ordinal integer, kind text)"
        " WHERE r.job_id = ANY(%s::uuid[])) s ORDER BY job_id, ordinal",
        ids,
        ids,
    )
    found: dict[str, list[tuple[str, str]]] = {}
    for job_id, key, kind in reached:
        found.setdefault(str(job_id), []).append((key, kind))
    return found


SOAK_KILLS = ("worker", "relay", "worker", "worker", "relay", "worker")


@pytest.mark.soak
async def test_framework_agents_survive_sigkilled_workers_and_relays_with_each_refund_once(
    redis_url, database_url, redis, pool, providers, tmp_path, framework
):
    """Ten agents of one framework, each a lookup and a refund; a worker (the
    one holding the most jobs) or the relay SIGKILLed and restarted each time
    a few more model calls came in. Every job ends done with the same five
    checkpoints, every refund is one effect (one webhook-id per job), and no
    turn is paid twice: a job pays again at most the turn a lost delivery had
    in flight."""
    model, mail = providers
    key = await create_api_key(pool, "acme")
    port = free_port()
    env = deployment_env(redis_url, database_url, model, mail, **SOAK_ENV)
    api = start(["--app", framework.app, "api", "--port", str(port)], env, tmp_path / "api.log")
    fleet = Fleet(framework.app, env, tmp_path)
    for kind in ("worker", "worker", "relay"):
        fleet.spawn(kind)
    held_by = holdings(redis, framework.workflow)
    n = 10

    base = f"http://127.0.0.1:{port}"
    try:
        await wait_healthy(base, api, tmp_path / "api.log", STARTED_WITHIN_S)
        async with httpx.AsyncClient(
            base_url=base, headers={"Authorization": f"Bearer {key}"}
        ) as client:
            ids = await submit_cases(client, framework, n)

            async def every_one_done() -> bool:
                return await all_done(pool, ids)

            for kind in SOAK_KILLS:
                # Kill on progress, not on a clock: a few more calls came in.
                calls = model.stats().total + 3

                async def progressed(calls: int = calls) -> bool:
                    return model.stats().total >= calls or await every_one_done()

                await wait_for(progressed, STARTED_WITHIN_S, what="more model calls")
                if await every_one_done():
                    break
                await fleet.kill(kind, held_by)
            await wait_for(every_one_done, within_s=240, what="every agent done")

            async def refunded() -> bool:
                by_key = (await mail.deliveries())["by_key"]
                return len([k for k in by_key if k.startswith("refund.issue")]) == n

            await wait_for(refunded, within_s=120, what="every refund delivered")
    finally:
        with running(api, *fleet.all()):
            pass

    by_key = (await mail.deliveries())["by_key"]
    refunds = sorted(k for k in by_key if k.startswith("refund.issue"))
    assert refunds == sorted(f"refund.issue:{j}:support/refund/call" for j in ids)
    events = webhook_events(tmp_path / "mailbox.jsonl", "refund.issue")
    assert len(events) == n, "one refund effect per job"
    assert len({e["idempotency_key"] for e in events}) == n
    assert sorted(e["data"]["cents"] for e in events) == [100 + i for i in range(n)]

    assert fleet.held_at_kills > 0, "the kills interrupted runs"
    # Each job's three turns paid once, plus at most the one turn each lost
    # delivery (a SIGKILLed or overtaken worker's) had in flight.
    repays = await repays_allowed(pool, ids)
    paid = [sum(p.billed for p in model.stats(contains=f"case {i}.").prompts) for i in range(n)]
    for i, job in enumerate(ids):
        assert 3 <= paid[i] <= 3 + repays[job], (i, paid[i], repays[job], fleet)
    expected = [(k, kind) for k, kind, _ in STEPS]
    assert await checkpoints_by_job(pool, ids) == {j: expected for j in ids}, "one lookup each"
    [ok] = await rows(
        pool,
        "SELECT count(*) FROM model_calls WHERE outcome = 'ok' AND job_id = ANY(%s::uuid[])",
        ids,
    )
    # The ledger invents no call (a SIGKILLed worker loses its last
    # quarter second of rows, so it may hold fewer).
    assert ok[0] <= sum(paid), (ok, paid)
    print(
        f"{framework.workflow} soak: {n} jobs, kills {fleet.kills}, {fleet.held_at_kills} jobs"
        f" held at kills, {sum(paid)} model turns paid, {ok[0]} ledgered ok"
    )


def holdings(redis: Any, workflow: str) -> Callable[[int], Awaitable[int]]:
    """How many of ``workflow``'s entries the worker of a pid holds (pending)."""
    stream = workflow_keys(workflow, f"{workflow}-workers")

    async def held_by(pid: int) -> int:
        try:
            consumers = await redis.xinfo_consumers(stream.stream, stream.group)
        except ResponseError:  # no group yet: nothing held
            return 0
        return sum(int(c["pending"]) for c in consumers if f"-{pid}-" in _text(c["name"]))

    return held_by


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
