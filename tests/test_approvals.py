"""Agents end to end in process, on real Redis and PostgreSQL, the fake
model over HTTP and the fake receiver: a refund tool that needs a person's
approval waits holding no worker slot, sends nothing before the decision,
and the decision route keeps the whole idempotency contract (docs/agents.md)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest
from pydantic import BaseModel

import oncely
from oncely import Agent, App, Context, Workflow, webhook
from oncely.fakes.mail import FakeMailServer
from oncely.outbox.relay import Relay, RelayConfig
from oncely.outbox.store import OutboxStore
from oncely.senders import SendersConfig, build_router
from tests.durable import Harness, drain, pending, wait_until_due

SECRET = "approvals-test-secret"
REFUND = '[[fake:tool=refund {"order_id": "A1", "cents": 1200}]]'


class Ask(BaseModel):
    text: str


class Answer(BaseModel):
    reply: str
    tools: list[str]


class RefundArgs(BaseModel):
    order_id: str
    cents: int


class Refunded(BaseModel):
    ok: bool
    id: str


@oncely.tool
def lookup_order(order_id: str) -> dict[str, Any]:
    """Look an order up."""
    return {"order_id": order_id, "total_cents": 4200}


refund = oncely.call_tool(
    "refund.issue", args=RefundArgs, description="Refund.", name="refund", approval=True
)


def helpdesk(approval_timeout: timedelta = timedelta(hours=1)) -> App:
    agent = Agent(
        "support",
        "You help.",
        [lookup_order, refund],
        approval_timeout=approval_timeout,
    )

    async def step(request: Ask, ctx: Context) -> Answer:
        run = await agent.run(ctx, request.text)
        return Answer(reply=str(run.output), tools=[f"{c.tool}:{c.status}" for c in run.tool_calls])

    workflow = Workflow(
        name="helpdesk",
        route="/v1/helpdesk",
        request=Ask,
        result=Answer,
        step=step,
        effects=[webhook("refund.issue", returns=Refunded), webhook("approval.requested")],
        agents=[agent],
    )
    return App([workflow])


# For the operator commands, which load the app by name.
APP = helpdesk()


@pytest.fixture
async def desk(custom, pool, tmp_path) -> AsyncIterator[tuple[Harness, Relay, FakeMailServer]]:
    app = APP
    harness = await custom(app)
    async with FakeMailServer(tmp_path / "mailbox.jsonl") as mail:
        config = SendersConfig(webhook_secret=SECRET, default_webhook_url=mail.events_url)
        router = build_router(app.effects(), config)

        async def resume(ids: list[str]) -> None:
            await harness.checkpoints.resume_due(len(ids), ids)

        relay = Relay(OutboxStore(pool), router, RelayConfig(batch=10), resume=resume)
        yield harness, relay, mail
        await router.aclose()


async def decide(
    harness: Harness,
    job_id: str,
    call_id: str,
    body: dict[str, Any],
    key: str | None = None,
    auth: dict[str, str] | None = None,
) -> Any:
    headers = {**(auth or harness.auth), "Idempotency-Key": key or f"decision-{uuid.uuid4()}"}
    return await harness.api.post(
        f"/v1/helpdesk/{job_id}/approvals/{call_id}", json=body, headers=headers
    )


async def topics(harness: Harness, job_id: str) -> list[str]:
    return await harness.outbox(job_id)


async def test_a_tool_waiting_for_approval_holds_no_slot_and_sends_nothing_before(desk) -> None:
    harness, relay, mail = desk
    worker = harness.worker("helpdesk", concurrency=1)
    job_id = await harness.submit("/v1/helpdesk", {"text": f"Refund A1. {REFUND}"})
    await drain(worker)

    view = await harness.get("/v1/helpdesk", job_id)
    assert view["status"] == "waiting"
    assert view["waiting"]["approval"] == {
        "call_id": "call_1",
        "tool": "refund",
        "arguments": {"order_id": "A1", "cents": 1200},
    }
    assert [(s["key"], s["kind"], s["status"]) for s in view["steps"]] == [
        ("support/model", "model", "done"),
        ("support/refund/approval", "approval", "waiting"),
    ]
    assert view["steps"][1]["tool"] == "refund"
    # Asked for, and nothing else: no refund before the decision.
    assert await topics(harness, job_id) == ["approval.requested"]
    assert await pending(harness, "helpdesk") == 0

    # The one slot is free: another job runs to its end meanwhile.
    other = await harness.submit("/v1/helpdesk", {"text": "Just say hello."})
    await drain(worker)
    assert (await harness.get("/v1/helpdesk", other))["status"] == "done"

    # Edited arguments that fail the tool's schema: 422, nothing stored.
    bad = await decide(harness, job_id, "call_1", {"approved": True, "arguments": {"cents": "x"}})
    assert bad.status_code == 422, bad.text
    assert bad.json()["type"].endswith("/validation")

    # Unknown call, another tenant: 404.
    assert (await decide(harness, job_id, "call_9", {"approved": True})).status_code == 404
    stranger = await oncely_key(harness, "globex")
    assert (
        await decide(harness, job_id, "call_1", {"approved": True}, auth=stranger)
    ).status_code == 404

    # The decision, with the idempotency contract.
    first = await decide(harness, job_id, "call_1", {"approved": True}, key="approve-refund-a1")
    assert first.status_code == 202
    assert first.json() == {"job_id": job_id, "call_id": "call_1", "status": "approved"}
    again = await decide(harness, job_id, "call_1", {"approved": True}, key="approve-refund-a1")
    assert again.status_code == 202 and again.headers["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    same = await decide(harness, job_id, "call_1", {"approved": True})
    assert same.status_code == 202
    other_decision = await decide(harness, job_id, "call_1", {"approved": False})
    assert other_decision.status_code == 409
    assert other_decision.json()["type"].endswith("/approval-already-decided")

    # Approved: the refund is called once, its answer resumes the job.
    assert await harness.status(job_id) == "queued"
    await drain(worker)
    assert await topics(harness, job_id) == ["approval.requested", "refund.issue"]
    await relay.run_once()
    await relay.run_once()
    await drain(worker)
    view = await harness.get("/v1/helpdesk", job_id)
    assert view["status"] == "done", view
    assert view["result"]["tools"] == ["refund:ok"]
    refunds = [k for k in (await mail.deliveries())["by_key"] if k.startswith("refund.issue")]
    assert refunds == [f"refund.issue:{job_id}:support/refund/call"]
    assert [s["kind"] for s in view["steps"]] == ["model", "approval", "call", "model"]

    finished = await decide(harness, job_id, "call_1", {"approved": False})
    assert finished.status_code in (404, 409)


async def oncely_key(harness: Harness, tenant: str) -> dict[str, str]:
    from oncely.api.auth import create_api_key

    return {"Authorization": f"Bearer {await create_api_key(harness.pool, tenant)}"}


async def test_a_rejected_refund_is_never_sent_and_the_model_hears_why(desk) -> None:
    harness, relay, mail = desk
    worker = harness.worker("helpdesk")
    job_id = await harness.submit("/v1/helpdesk", {"text": f"Refund A1. {REFUND}"})
    await drain(worker)
    rejected = await decide(
        harness, job_id, "call_1", {"approved": False, "reason": "over the limit"}
    )
    assert rejected.json()["status"] == "rejected"
    await drain(worker)
    view = await harness.get("/v1/helpdesk", job_id)
    assert view["status"] == "done"
    assert view["result"]["tools"] == ["refund:rejected"]
    assert await topics(harness, job_id) == ["approval.requested"]
    await relay.run_once()
    assert not [k for k in (await mail.deliveries())["by_key"] if k.startswith("refund.issue")]
    told = harness.fake.model.recent[-1]
    assert any(
        '"rejected":true' in (m.get("content") or "") and "over the limit" in m["content"]
        for m in told
        if m["role"] == "tool"
    )


async def test_no_decision_in_time_rejects_by_default(custom, pool) -> None:
    harness = await custom(helpdesk(approval_timeout=timedelta(seconds=0.2)))
    worker = harness.worker("helpdesk")
    job_id = await harness.submit("/v1/helpdesk", {"text": f"Refund A1. {REFUND}"})
    await drain(worker)
    assert await harness.status(job_id) == "waiting"
    await wait_until_due(harness, job_id)
    assert await harness.checkpoints.resume_due(10) != []
    await drain(worker)
    view = await harness.get("/v1/helpdesk", job_id)
    assert view["result"]["tools"] == ["refund:rejected"]
    assert await topics(harness, job_id) == ["approval.requested"]


async def test_jobs_approve_decides_from_the_command_line(desk) -> None:
    from oncely.cli.ops import decide_approval

    harness, _, _ = desk
    worker = harness.worker("helpdesk")
    job_id = await harness.submit("/v1/helpdesk", {"text": f"Refund A1. {REFUND}"})
    await drain(worker)
    s = harness.settings.model_copy(update={"app": "tests.test_approvals:APP"})
    outcome = await decide_approval(s, uuid.UUID(job_id), "call_1", {"approved": False})
    assert outcome is not None and outcome.outcome == "received"
    assert await harness.status(job_id) == "queued"
    missing = await decide_approval(s, uuid.UUID(job_id), "call_7", {"approved": True})
    assert missing is not None and missing.outcome in ("missing", "duplicate")


async def test_the_console_lists_a_pending_approval_and_decides_it_with_csrf(
    desk, redis, pool
) -> None:
    import httpx
    from pydantic import SecretStr

    from tests.helpers import asgi_app
    from tests.test_console import KEY, csrf_of

    harness, _, _ = desk
    job_id = await harness.submit("/v1/helpdesk", {"text": f"Refund A1. {REFUND}"})
    await drain(harness.worker("helpdesk"))
    settings = harness.settings.model_copy(update={"console_key": SecretStr(KEY)})
    transport = httpx.ASGITransport(app=asgi_app(settings, redis, pool, APP))
    async with httpx.AsyncClient(transport=transport, base_url="http://oncely.test") as console:
        assert (await console.post("/console/login", data={"key": KEY})).status_code == 303
        page = (await console.get(f"/console/workflows/helpdesk/jobs/{job_id}")).text
        assert 'id="approval"' in page and "refund" in page and "call_1" in page
        action = f"/console/workflows/helpdesk/jobs/{job_id}/approvals/call_1"
        forged = await console.post(action, data={"csrf": "f" * 64, "decision": "approve"})
        assert forged.status_code == 403
        assert await harness.status(job_id) == "waiting"
        decided = await console.post(
            action, data={"csrf": csrf_of(page), "decision": "reject", "reason": "no"}
        )
        assert decided.status_code == 303
        assert "decided=rejected" in decided.headers["location"]
    assert await harness.status(job_id) == "queued"
    await drain(harness.worker("helpdesk"))
    assert (await harness.get("/v1/helpdesk", job_id))["result"]["tools"] == ["refund:rejected"]


async def test_a_run_past_max_turns_is_dead_with_its_reason(custom) -> None:
    agent = Agent("looper", "Loop.", [lookup_order], max_turns=2)

    async def step(request: Ask, ctx: Context) -> Answer:
        run = await agent.run(ctx, request.text)
        return Answer(reply=str(run.output), tools=[])

    workflow = Workflow(
        name="looping", route="/v1/looping", request=Ask, result=Answer, step=step, agents=[agent]
    )
    harness = await custom(App([workflow]))
    lookups = " ".join(f'[[fake:tool=lookup_order {{"order_id": "A{i}"}}]]' for i in range(3))
    job_id = await harness.submit("/v1/looping", {"text": f"Loop. {lookups}"})
    await drain(harness.worker("looping"))
    view = await harness.get("/v1/looping", job_id)
    assert (view["status"], view["error"]) == ("dead", "agent-limit")
    [(error,)] = await harness.rows("SELECT error FROM jobs WHERE job_id = %s", job_id)
    assert error.startswith("agent-limit: ") and "max_turns (2 turns" in error
    assert [s["kind"] for s in view["steps"]] == ["model", "tool", "model", "tool"]
