"""The support agent (examples/support_agent.py) through real `oncely api`,
`worker` and `relay` processes, the fake model and the fake receiver: each
turn paid once, the refund sent once and answered, an approval through the
API; and a soak that SIGKILLs workers and relays while agents run
(docs/agents.md)."""

from __future__ import annotations

import asyncio
import json
import random
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from oncely.fakes.mail import Faults
from oncely.outbox.relay import LISTENER_APPLICATION_NAME
from oncely.senders.webhook import verify
from tests.helpers import all_done, scalar, webhook_events
from tests.processes import SECRET, Deployment, deployment_env, post, repays_allowed, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


APP = "examples.support_agent:app"
LOOKUP = '[[fake:tool=lookup_order {"order_id": "A-1001"}]]'
# For soaks: a SIGKILLed worker's jobs are taken over within seconds (a
# relay's sends are by default: ONCELY_RELAY_LEASE_S).
SOAK_ENV = {
    "ONCELY_CLAIM_IDLE_MS": "1500",
    "ONCELY_RECONCILE_AFTER_S": "3",
    "ONCELY_LLM_TIMEOUT_S": "5",
    "ONCELY_REDELIVERY_BASE_S": "0.5",
    "ONCELY_REDELIVERY_MAX_S": "2",
}


# The refund call's checkpoint, by its outbox row's job id.
CALL_CHECKPOINT = (
    "FROM checkpoints c JOIN outbox o ON o.job_id = c.job_id AND o.call_key = c.key"
    " WHERE o.job_id = %s"
)


def refund(order: str, cents: int) -> str:
    args = json.dumps({"order_id": order, "cents": cents, "reason": "broken"})
    return f"[[fake:tool=refund {args}]]"


def request(text: str) -> dict[str, str]:
    return {"customer": "ada@example.com", "message": text}


@pytest.fixture
def env(redis, redis_url, database_url, providers) -> dict[str, str]:
    """The processes' settings, on a flushed Redis database (``redis``)."""
    model, mail = providers
    return deployment_env(redis_url, database_url, model, mail)


@asynccontextmanager
async def support_desk(
    env: dict[str, str], tmp_path: Path, api_key: str
) -> AsyncIterator[tuple[Deployment, httpx.AsyncClient]]:
    """A deployment of the support agent, and a client of its API."""
    with Deployment(env, tmp_path, app=APP) as d:
        async with d.client(api_key) as client:
            yield d, client


async def done(
    client: httpx.AsyncClient, job_id: str, route: str = "/v1/support"
) -> dict[str, Any]:
    view: dict[str, Any] = {}

    async def finished() -> bool:
        nonlocal view
        view = (await client.get(f"{route}/{job_id}")).json()
        return view["status"] in ("done", "dead")

    await wait_for(finished, within_s=120, what=f"job {job_id} finished")
    return view


async def test_an_agent_looks_up_refunds_once_and_replies(api_key, pool, providers, env, tmp_path):
    model, mail = providers
    async with support_desk(env, tmp_path, api_key) as (_, client):
        text = f"My teapot A-1001 broke. {LOOKUP} {refund('A-1001', 4200)}"
        job_id = await post(client, "/v1/support", request(text), "agent-end-to-end-0001")
        view = await done(client, job_id)

        async def replied() -> bool:
            return (await mail.deliveries())["effects"] == 2

        await wait_for(replied, what="the refund and the reply")

    assert view["status"] == "done", view
    assert view["result"]["refunded_cents"] == 4200
    assert view["result"]["tool_calls"] == ["lookup_order:ok", "refund:ok"]
    assert [s["kind"] for s in view["steps"]] == ["model", "tool", "model", "call", "model"]
    assert model.stats().total == 3, "one model call per turn"
    by_key = (await mail.deliveries())["by_key"]
    assert by_key[f"refund.issue:{job_id}:support/refund/call"] == 1
    events = webhook_events(tmp_path / "mailbox.jsonl")
    [call] = [e for e in events if e["type"] == "refund.issue"]
    assert verify(SECRET, call["headers"], call["body"].encode())
    assert call["data"]["cents"] == 4200
    assert await scalar(pool, "SELECT answer->>'ok' FROM outbox WHERE call_key IS NOT NULL") == (
        "true"
    )


async def test_a_large_refund_is_approved_through_the_api(api_key, providers, env, tmp_path):
    _, mail = providers
    async with support_desk(env, tmp_path, api_key) as (_, client):
        text = f"Wrong armchair. {refund('A-1002', 38900)}"
        job_id = await post(client, "/v1/support", request(text), "agent-end-to-end-0002")

        pending: dict[str, Any] = {}

        async def waiting() -> bool:
            view = (await client.get(f"/v1/support/{job_id}")).json()
            pending.update((view["waiting"] or {}).get("approval") or {})
            return view["status"] == "waiting" and bool(pending)

        await wait_for(waiting, what="the approval wait")
        by_key = (await mail.deliveries())["by_key"]
        assert not [k for k in by_key if k.startswith("refund.issue")], "nothing sent yet"
        decided = await client.post(
            f"/v1/support/{job_id}/approvals/{pending['call_id']}",
            json={"approved": True},
            headers={"Idempotency-Key": "agent-e2e-approve-0002"},
        )
        assert decided.status_code == 202, decided.text
        view = await done(client, job_id)
    assert view["result"]["refunded_cents"] == 38900
    refunds = [k for k in (await mail.deliveries())["by_key"] if k.startswith("refund.issue")]
    assert refunds == [f"refund.issue:{job_id}:support/refund/call"]


async def test_a_call_whose_relay_is_sigkilled_mid_send_resumes_its_job_within_seconds(
    api_key, pool, providers, env, tmp_path
):
    """The refund's receiver is slow: the relay sending it is SIGKILLed with
    the call in flight, a second relay running beside it. With the default
    lease (ONCELY_RELAY_LEASE_S, renewed in short steps), the second relay
    sends it again once the dead one's lease ends: the job's wait ends
    within about 5 s of the kill, never the old 30 s, and the receiver got
    the call twice under one webhook-id, one effect."""
    _, mail = providers
    mail.state.script(Faults(delay_s=60))  # the first send of the refund hangs
    async with support_desk(env, tmp_path, api_key) as (d, client):
        text = f"My teapot A-1001 broke. {LOOKUP} {refund('A-1001', 4200)}"
        job_id = await post(client, "/v1/support", request(text), "agent-relay-killed-0001")
        call = f"refund.issue:{job_id}:support/refund/call"

        async def sends(n: int) -> bool:
            return (await mail.deliveries())["by_key"].get(call, 0) >= n

        await wait_for(lambda: sends(1), what="the refund in flight at the receiver")
        d.relays.append(d.start("relay", log="relay2.log"))

        async def both_listening() -> bool:
            listening = await scalar(
                pool,
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE application_name = %s AND datname = current_database()",
                LISTENER_APPLICATION_NAME,
            )
            return bool(listening == 2)

        await wait_for(both_listening, what="the second relay listening")
        assert (await mail.deliveries())["by_key"][call] == 1, "a live relay's send kept"
        d.relay.send_signal(signal.SIGKILL)
        d.relay.wait(10)
        killed_at = await scalar(pool, "SELECT now()")
        mail.state.script(Faults())  # the receiver answers the resend at once

        async def answered() -> bool:
            status = await scalar(pool, f"SELECT c.status {CALL_CHECKPOINT}", job_id)
            return bool(status == "done")

        await wait_for(answered, what="the refund answered after the kill")
        resumed_s = await scalar(
            pool,
            f"SELECT extract(epoch FROM c.finished_at - %s)::float8 {CALL_CHECKPOINT}",
            killed_at,
            job_id,
        )
        view = await done(client, job_id)

    print(f"a call whose relay was SIGKILLed mid-send: its job resumed {resumed_s:.2f} s after")
    assert resumed_s < 15, (
        f"the job resumed {resumed_s:.1f} s after its relay's kill: the bound is about 5 s"
        " (a 3 s lease and a 1 s poll); 15 s allowed for a loaded machine"
    )
    assert view["status"] == "done", view
    assert view["result"]["refunded_cents"] == 4200
    deliveries = await mail.deliveries()
    assert deliveries["by_key"][call] == 2, "sent again once, under the same webhook-id"
    events = webhook_events(tmp_path / "mailbox.jsonl")
    assert len([e for e in events if e["type"] == "refund.issue"]) == 1, "one effect"
    assert await scalar(pool, "SELECT attempts FROM outbox WHERE call_key IS NOT NULL") == 2


@pytest.mark.soak
async def test_agents_survive_sigkilled_workers_and_relays_with_each_refund_once(
    redis_url, database_url, api_key, redis, pool, providers, tmp_path
):
    """Thirty agents, each a lookup and a refund; workers and relays killed
    with SIGKILL and restarted every second or so meanwhile. Every job ends
    done, every refund reaches the receiver's effects once (one webhook-id
    per job), and no answered turn is paid for twice: a job pays again at most
    the turn a lost delivery had in flight."""
    model, mail = providers
    env = deployment_env(redis_url, database_url, model, mail, **SOAK_ENV)
    logs = iter(range(1000))
    rng = random.Random(7)
    kills = 0
    with Deployment(env, tmp_path, app=APP) as d:
        d.workers.append(d.start_worker())
        fleet = {"worker": d.workers, "relay": d.relays}

        def spawn(kind: str) -> Any:
            return d.start(kind, log=f"{kind}{next(logs)}.log")

        async with d.client(api_key) as client:
            ids = []
            for i in range(30):
                text = (
                    f"Order A-1001, case {i}. [[fake:sleep=1]] {LOOKUP} {refund('A-1001', 100 + i)}"
                )
                r = await client.post(
                    "/v1/support", json=request(text), headers={"Idempotency-Key": f"soak-{i:012}"}
                )
                assert r.status_code == 202, r.text
                ids.append(r.json()["job_id"])

            async def every_one_done() -> bool:
                return await all_done(pool, ids)

            for _ in range(20):
                if await every_one_done():
                    break
                await asyncio.sleep(0.3 + rng.random() / 2)
                kind = rng.choice(["worker", "worker", "relay"])
                victim = fleet[kind].pop(rng.randrange(len(fleet[kind])))
                victim.send_signal(signal.SIGKILL)
                victim.wait(10)
                kills += 1
                fleet[kind].append(spawn(kind))
            await wait_for(every_one_done, within_s=240, what="every agent done")

            async def refunded() -> bool:
                by_key = (await mail.deliveries())["by_key"]
                return len([k for k in by_key if k.startswith("refund.issue")]) == len(ids)

            await wait_for(refunded, within_s=120, what="every refund delivered")

    deliveries = await mail.deliveries()
    refunds = sorted(k for k in deliveries["by_key"] if k.startswith("refund.issue"))
    assert refunds == sorted(f"refund.issue:{j}:support/refund/call" for j in ids)
    events = webhook_events(tmp_path / "mailbox.jsonl")
    assert len([e for e in events if e["type"] == "refund.issue"]) == len(ids), "one effect each"
    # Each job's three turns paid once, plus at most the one turn each lost
    # delivery (a SIGKILLed or overtaken worker's) had in flight.
    repays = await repays_allowed(pool, ids)
    paid = [sum(p.billed for p in model.stats(contains=f"case {i}.").prompts) for i in range(30)]
    for i, job in enumerate(ids):
        assert 3 <= paid[i] <= 3 + repays[job], (i, paid[i], repays[job])
    print(
        f"agent soak: {len(ids)} jobs, {kills} kills, {sum(repays.values())} turns allowed twice,"
        f" {sum(paid)} model turns paid"
    )
