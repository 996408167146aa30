"""An agent with an MCP server's tools (tests/mcp_app.py) through real
`oncely api`, `worker` and `relay` processes, the MCP server being the
`oncely fake-mcp` command, a process of its own, counting calls and
refunds per key at ``/_calls`` (docs/mcp.md):

- the stable key reaches the server in ``_meta``; a read-only lookup whose
  worker was SIGKILLed mid-call is sent again with the same key and the job
  ends done; a destructive refund whose worker was SIGKILLed after it
  happened is never sent again alone: the job waits ``uncertain`` until a
  person says what happened, one refund all along;
- with a server that dedupes on the key (``--idempotent``), the same kill
  ends with the refund retried under its key: one refund, nobody asked;
- a soak: thirty agents, workers SIGKILLed again and again: at most one
  refund per job, every job done or waiting ``uncertain``, none lost.

The claim and lease settings are the project's defaults (a SIGKILLed
worker's jobs are taken over after ``ONCELY_CLAIM_IDLE_MS``, 30 s), so each
kill costs a test about half a minute."""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from oncely.api.auth import create_api_key
from tests.helpers import scalar, webhook_events
from tests.mcp_app import MCP_URL
from tests.processes import (
    api_client,
    deployment_env,
    free_port,
    running,
    start,
    tail,
    wait_for,
)
from tests.test_frameworks_processes import Fleet, holdings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


APP = "tests.mcp_app:app"
ROUTE = "/v1/mcpdesk"
LOOKUP_KEY = "support/lookup_order/tool"
REFUND_KEY = "support/refund/tool"
# How long a call with ``[[fake:slow]]`` in its arguments takes at the fake
# (a refund: after it happened). Long enough to SIGKILL its worker mid-call.
SLOW_S = 8.0
# A job's whole life with one kill: the takeover (30 s) and the calls after it.
SETTLED_WITHIN_S = 180


def lookup(order: str, *, slow: bool = False) -> str:
    args = {"order_id": order + (" [[fake:slow]]" if slow else "")}
    return f"[[fake:tool=lookup_order {json.dumps(args)}]]"


def refund(order: str, cents: int, *, slow: bool = False) -> str:
    args = {"order_id": order + (" [[fake:slow]]" if slow else ""), "cents": cents}
    return f"[[fake:tool=refund {json.dumps(args)}]]"


class FakeMCPProcess:
    """The ``oncely fake-mcp`` command, started as a process on a free port."""

    def __init__(self, log: Path, *options: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.base}/mcp"
        self.log = log
        self.proc = start(["fake-mcp", "--port", str(self.port), *options], {}, log)

    async def calls(self) -> dict[str, Any]:
        async with httpx.AsyncClient() as client:
            answer = await client.get(f"{self.base}/_calls")
        answer.raise_for_status()
        return dict(answer.json())

    async def started(self) -> None:
        async def answers() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"fake-mcp exited {self.proc.returncode}: {tail(self.log)}")
            try:
                await self.calls()
            except httpx.TransportError:
                return False
            return True

        await wait_for(answers, within_s=60, what="oncely fake-mcp answering /_calls")

    async def effects_by_key(self) -> Counter[str]:
        """How many refunds each key made."""
        return Counter(r["key"] for r in (await self.calls())["refunds"])


@contextmanager
def fake_mcp(log: Path, *options: str) -> Iterator[FakeMCPProcess]:
    fake = FakeMCPProcess(log, *options)
    with running(fake.proc):
        yield fake


class Desk:
    """The API, a relay and workers of tests/mcp_app.py against ``fake``."""

    def __init__(self, env: dict[str, str], tmp_path: Path, workers: int = 1) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.api = start(["--app", APP, "api", "--port", str(self.port)], env, tmp_path / "api.log")
        self.fleet = Fleet(APP, env, tmp_path)
        for kind in ["relay"] + ["worker"] * workers:
            self.fleet.spawn(kind)

    def __enter__(self) -> Desk:
        return self

    def __exit__(self, *_: object) -> None:
        with running(self.api, *self.fleet.all()):
            pass


@pytest.fixture
def desk_env(redis_url, database_url, providers) -> dict[str, str]:
    model, mail = providers
    return deployment_env(redis_url, database_url, model, mail)


async def post(client: httpx.AsyncClient, message: str, key: str) -> str:
    r = await client.post(ROUTE, json={"message": message}, headers={"Idempotency-Key": key})
    assert r.status_code == 202, r.text
    return str(r.json()["job_id"])


async def view(client: httpx.AsyncClient, job_id: str) -> dict[str, Any]:
    r = await client.get(f"{ROUTE}/{job_id}")
    assert r.status_code == 200, r.text
    return dict(r.json())


async def until(client: httpx.AsyncClient, job_id: str, status: str) -> dict[str, Any]:
    found: dict[str, Any] = {}

    async def reached() -> bool:
        nonlocal found
        found = await view(client, job_id)
        assert found["status"] != "dead", found
        return found["status"] == status

    await wait_for(reached, within_s=SETTLED_WITHIN_S, what=f"job {job_id} {status}")
    return found


async def decide(
    client: httpx.AsyncClient, job_id: str, call_id: str, body: dict[str, Any], key: str
) -> httpx.Response:
    return await client.post(
        f"{ROUTE}/{job_id}/uncertain/{call_id}", json=body, headers={"Idempotency-Key": key}
    )


async def nothing_held(pid: int) -> int:
    return 0


def raised_for(mailbox: Path) -> list[str]:
    """The jobs an ``uncertain.raised`` webhook told a person of."""
    return [e["data"]["job_id"] for e in webhook_events(mailbox, "uncertain.raised")]


async def test_the_key_reaches_the_server_a_lookup_is_retried_a_refund_waits_for_a_person(
    redis, pool, desk_env, tmp_path
):
    key = await create_api_key(pool, "acme")
    with fake_mcp(tmp_path / "fake-mcp.log", "--slow-s", str(SLOW_S)) as fake:
        await fake.started()
        with Desk({**desk_env, MCP_URL: fake.url}, tmp_path) as desk:
            async with api_client(desk.base, desk.api, tmp_path / "api.log", key) as client:
                looked = await post(
                    client, f"Where is A-1? {lookup('A-1', slow=True)}", "mcp-proc-lookup-1"
                )
                refunded = await post(
                    client,
                    f"Refund B-2, please. {refund('B-2', 1200, slow=True)}",
                    "mcp-proc-refund-1",
                )

                async def both_mid_call() -> bool:
                    calls = await fake.calls()
                    by_key = calls["by_key"]
                    return (
                        by_key.get(f"{looked}:{LOOKUP_KEY}") == 1
                        and by_key.get(f"{refunded}:{REFUND_KEY}") == 1
                        and calls["effects"] == 1
                    )

                await wait_for(both_mid_call, within_s=60, what="the lookup and the refund sent")
                # Both calls are at the server (the refund happened; each
                # answers SLOW_S later): their worker dies now.
                await desk.fleet.kill("worker", nothing_held)

                done = await until(client, looked, "done")
                waiting = await until(client, refunded, "waiting")
                calls = await fake.calls()
                # The lookup only reads: sent again, with the same key.
                assert calls["by_key"][f"{looked}:{LOOKUP_KEY}"] == 2
                assert done["result"]["tool_calls"] == ["lookup_order:ok"]
                assert done["result"]["results"][0]["status"] == "shipped"
                # The refund is never sent again without a person's word.
                assert calls["by_key"][f"{refunded}:{REFUND_KEY}"] == 1
                assert calls["effects"] == 1
                pending = waiting["waiting"]["uncertain"]
                assert pending["tool"] == "refund"
                assert pending["arguments"] == {"order_id": "B-2 [[fake:slow]]", "cents": 1200}

                async def told() -> bool:
                    return raised_for(tmp_path / "mailbox.jsonl") == [refunded]

                await wait_for(told, within_s=60, what="uncertain.raised for the refund")

                # A person looked at the shop: the refund happened.
                found = {"refunded": True, "id": "re_1", "cents": 1200}
                r = await decide(
                    client, refunded, pending["call_id"], {"result": found}, "mcp-proc-decide-0001"
                )
                assert r.status_code == 202, r.text
                decided = await until(client, refunded, "done")
        calls = await fake.calls()

    assert decided["result"]["tool_calls"] == ["refund:ok"]
    assert decided["result"]["results"] == [found]
    assert calls["by_key"][f"{refunded}:{REFUND_KEY}"] == 1
    assert calls["effects"] == 1 and calls["refunds"][0]["key"] == f"{refunded}:{REFUND_KEY}"
    [resolution] = [s["resolution"] for s in decided["steps"] if s["resolution"]]
    assert resolution["chose"] == "result"
    # The tools were listed by each job's run (a run taken over may list again).
    assert calls["lists"] >= 2


async def test_a_server_that_dedupes_on_the_key_gets_the_refund_again_one_effect_nobody_asked(
    redis, pool, desk_env, tmp_path
):
    key = await create_api_key(pool, "acme")
    options = ("--idempotent", "--slow-s", str(SLOW_S))
    with fake_mcp(tmp_path / "fake-mcp.log", *options) as fake:
        await fake.started()
        with Desk({**desk_env, MCP_URL: fake.url}, tmp_path) as desk:
            async with api_client(desk.base, desk.api, tmp_path / "api.log", key) as client:
                job_id = await post(
                    client, f"Refund C-3. {refund('C-3', 700, slow=True)}", "mcp-proc-idempotent-1"
                )

                async def refunded() -> bool:
                    return (await fake.calls())["effects"] == 1

                await wait_for(refunded, within_s=60, what="the refund made")
                await desk.fleet.kill("worker", nothing_held)
                done = await until(client, job_id, "done")
        calls = await fake.calls()

    # Sent twice under one key; the server answered the repeat with the
    # first call's result: one refund, and the job never waited for anyone.
    assert calls["by_key"] == {f"{job_id}:{REFUND_KEY}": 2}
    assert calls["effects"] == 1
    assert done["result"]["tool_calls"] == ["refund:ok"]
    assert done["result"]["results"] == [{"refunded": True, "id": "re_1", "cents": 700}]
    keys = [s["key"] for s in done["steps"]]
    assert f"{REFUND_KEY}/intent" not in keys and f"{REFUND_KEY}/uncertain" not in keys
    outcomes = await scalar(
        pool,
        "SELECT array_agg(outcome ORDER BY delivery) FROM job_deliveries WHERE job_id = %s",
        job_id,
    )
    assert "waiting" not in outcomes, outcomes
    assert raised_for(tmp_path / "mailbox.jsonl") == []


SOAK_JOBS = 30
# What each kill waits for: a few more calls of a tool. After refunds, every
# worker is killed (the refunds just made are in flight: each of those jobs
# must wait for a person); after lookups, the worker holding the most jobs.
# A job's delivery is lost at most once a kill, and a job whose delivery was
# lost ONCELY_MAX_DELIVERIES (5) times is dead (a crash loop,
# docs/failure-model.md): four kills, so each job's fifth delivery ends it.
SOAK_KILLS = ("refund", "lookup_order", "refund", "lookup_order")
# How long a slow call takes at the fake: a refund is in flight this long
# after it happened.
SOAK_SLOW_S = 3.0


async def job_states(pool: Any, ids: list[str]) -> dict[str, str]:
    """Each job's status, ``uncertain`` for one waiting on an uncertain call."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT job_id::text, status, coalesce(waiting_detail ? 'uncertain', false)"
            " FROM jobs WHERE job_id = ANY(%s::uuid[])",
            (ids,),
        )
        found = await cur.fetchall()
    return {j: "uncertain" if s == "waiting" and uncertain else s for j, s, uncertain in found}


async def kill_while_running(
    desk: Desk,
    fake: FakeMCPProcess,
    held_by: Callable[[int], Awaitable[int]],
    settled: Callable[[], Awaitable[bool]],
) -> None:
    """Kill as ``SOAK_KILLS`` says, each time a few more calls of its tool
    reached the server (on progress, not on a clock), until every job
    settled; each killed worker is replaced."""
    rng = random.Random(38)
    for tool in SOAK_KILLS:
        calls = (await fake.calls())["by_tool"].get(tool, 0) + rng.randint(2, 6)

        async def progressed(tool: str = tool, calls: int = calls) -> bool:
            return (await fake.calls())["by_tool"].get(tool, 0) >= calls or await settled()

        await wait_for(progressed, SETTLED_WITHIN_S, what=f"more {tool} calls")
        if await settled():
            return
        victims = len(desk.fleet.procs["worker"]) if tool == "refund" else 1
        for _ in range(victims):
            await desk.fleet.kill("worker", held_by)


async def answer_each(client: httpx.AsyncClient, uncertain: list[str]) -> None:
    """A person's word on each waiting job's refund: it happened."""
    for n, job_id in enumerate(uncertain):
        pending = (await view(client, job_id))["waiting"]["uncertain"]
        assert pending["tool"] == "refund", pending
        r = await decide(
            client,
            job_id,
            pending["call_id"],
            {"result": {"refunded": True, "by": "a person"}},
            f"mcp-soak-decide-{n:04}",
        )
        assert r.status_code == 202, r.text


@pytest.mark.soak
async def test_soak_agents_with_mcp_tools_and_sigkilled_workers_refund_at_most_once(
    redis, pool, desk_env, tmp_path
):
    """Thirty agents of different paces, each a lookup (a third of them slow)
    and a slow refund at the fake MCP server; workers SIGKILLed and replaced each time a few
    more lookups or refunds came in (``SOAK_KILLS``). Every job ends done, or
    waiting ``uncertain`` for the refund its killed worker had in flight;
    none is lost; each job's refund happened at most once, and exactly once
    for the jobs nobody was asked about. Answering ``result`` for each
    waiting one ends them all done, with no refund sent again."""
    key = await create_api_key(pool, "acme")
    held_by = holdings(redis, "mcpdesk")

    with fake_mcp(tmp_path / "fake-mcp.log", "--slow-s", str(SOAK_SLOW_S)) as fake:
        await fake.started()
        with Desk({**desk_env, MCP_URL: fake.url}, tmp_path, workers=2) as desk:
            async with api_client(desk.base, desk.api, tmp_path / "api.log", key) as client:
                ids = [
                    await post(
                        client,
                        # Turns of 0.1 to 2.2 s: the jobs' refunds come over seconds.
                        f"Case {i}. [[fake:sleep={0.1 + 0.3 * (i % 8):.1f}]]"
                        f" {lookup(f'A-{i}', slow=i % 3 == 0)}"
                        f" {refund(f'A-{i}', 100 + i, slow=True)}",
                        f"mcp-soak-intake-{i:04}",
                    )
                    for i in range(SOAK_JOBS)
                ]

                async def settled() -> bool:
                    found = await job_states(pool, ids)
                    return all(found.get(j) in ("done", "uncertain") for j in ids)

                async def all_done() -> bool:
                    return set((await job_states(pool, ids)).values()) == {"done"}

                await kill_while_running(desk, fake, held_by, settled)
                await wait_for(settled, within_s=300, what="every job done or uncertain")
                found = await job_states(pool, ids)
                effects_before = await fake.effects_by_key()
                uncertain = [j for j in ids if found[j] == "uncertain"]
                await answer_each(client, uncertain)
                await wait_for(all_done, within_s=SETTLED_WITHIN_S, what="every job done")
                views = [await view(client, j) for j in ids]
        calls = await fake.calls()
        effects = await fake.effects_by_key()

    # Nothing lost: every job accounted for, each ended with both tools' results.
    assert len(found) == SOAK_JOBS and set(found.values()) <= {"done", "uncertain"}
    for job in views:
        assert job["status"] == "done", job
        assert job["result"]["tool_calls"] == ["lookup_order:ok", "refund:ok"], job
    refund_keys = {f"{j}:{REFUND_KEY}" for j in ids}
    assert set(effects) <= refund_keys, "every refund is one of the jobs' calls"
    # At most once per job, whatever the kills; the decisions sent nothing.
    assert max(effects.values()) == 1, effects
    assert effects == effects_before
    assert max(calls["by_key"][k] for k in refund_keys if k in calls["by_key"]) == 1
    # A job nobody was asked about had its refund exactly once.
    for job_id in set(ids) - set(uncertain):
        assert effects[f"{job_id}:{REFUND_KEY}"] == 1, job_id
    lookups_again = sum(calls["by_key"].get(f"{j}:{LOOKUP_KEY}", 0) - 1 for j in ids)
    assert desk.fleet.kills["worker"] > 0 and desk.fleet.held_at_kills > 0
    assert uncertain, "a kill caught refunds in flight"
    unsent = sum(1 for j in uncertain if not effects[f"{j}:{REFUND_KEY}"])
    print(
        f"mcp soak: {SOAK_JOBS} jobs, {desk.fleet.kills['worker']} worker kills,"
        f" {desk.fleet.held_at_kills} jobs held at kills, {len(uncertain)} waited uncertain"
        f" (answered; {unsent} of them never reached the shop), {lookups_again} lookups"
        f" sent again, {sum(effects.values())} refunds"
    )
