"""Agents end to end in process, on real Redis and PostgreSQL, the fake
model over HTTP and the fake receiver: a refund tool that needs a person's
approval waits holding no worker slot, sends nothing before the decision,
and the decision route keeps the whole idempotency contract (docs/agents.md)."""

from __future__ import annotations

import getpass
import json
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest
from pydantic import BaseModel

import oncely
from oncely import Agent, App, Context, Workflow
from oncely.api.auth import hash_api_key
from oncely.decisions import is_call_id
from oncely.fakes.mail import FakeMailServer
from oncely.outbox.relay import Relay
from tests.durable import (
    Harness,
    agent_desk,
    drain,
    pending,
    relayed,
    run_once,
    streamed,
    wait_until_due,
)
from tests.helpers import RefundArgs

SECRET = "approvals-test-secret"
REFUND = '[[fake:tool=refund {"order_id": "A1", "cents": 1200}]]'


class Ask(BaseModel):
    text: str


class Answer(BaseModel):
    reply: str
    tools: list[str]


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

    return agent_desk("helpdesk", "/v1/helpdesk", Ask, Answer, step, agent)


# For the operator commands, which load the app by name.
APP = helpdesk()


@pytest.fixture
async def desk(custom, mail) -> AsyncIterator[tuple[Harness, Relay, FakeMailServer]]:
    harness = await custom(APP)
    async with relayed(harness, mail, SECRET) as relay:
        yield harness, relay, mail


async def decide(
    harness: Harness,
    job_id: str,
    call_id: str,
    body: dict[str, Any],
    key: str | None = None,
    auth: dict[str, str] | None = None,
) -> Any:
    headers = {
        **(auth or harness.auth),
        "Idempotency-Key": key or f"decision-{uuid.uuid4()}",
        "Content-Type": "application/json",
    }
    # Escaped JSON: lone surrogates go as a client could send them.
    return await harness.api.post(
        f"/v1/helpdesk/{job_id}/approvals/{call_id}", content=json.dumps(body), headers=headers
    )


async def pending_call(harness: Harness, job_id: str) -> str:
    """The id of the tool call the job waits on a decision for (GET)."""
    view = await harness.get("/v1/helpdesk", job_id)
    return str(view["waiting"]["approval"]["call_id"])


async def topics(harness: Harness, job_id: str) -> list[str]:
    return await harness.outbox(job_id)


async def test_a_tool_waiting_for_approval_holds_no_slot_and_sends_nothing_before(desk) -> None:
    harness, relay, mail = desk
    worker = harness.worker("helpdesk", concurrency=1)
    job_id = await harness.submit("/v1/helpdesk", {"text": f"Refund A1. {REFUND}"})
    await drain(worker)

    view = await harness.get("/v1/helpdesk", job_id)
    assert view["status"] == "waiting"
    call = view["waiting"]["approval"]["call_id"]
    assert view["waiting"]["approval"] == {
        "call_id": call,
        "tool": "refund",
        "arguments": {"order_id": "A1", "cents": 1200},
    }
    # oncely's own id, never the provider's (call_1 here).
    assert is_call_id(call)
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
    bad = await decide(harness, job_id, call, {"approved": True, "arguments": {"cents": "x"}})
    assert bad.status_code == 422, bad.text
    assert bad.json()["type"].endswith("/validation")

    # Unknown call (the provider's id names none), another tenant: 404.
    assert (await decide(harness, job_id, "call_1", {"approved": True})).status_code == 404
    assert (await decide(harness, job_id, "0" * 20, {"approved": True})).status_code == 404
    stranger = await oncely_key(harness, "globex")
    assert (
        await decide(harness, job_id, call, {"approved": True}, auth=stranger)
    ).status_code == 404

    # The decision, with the idempotency contract.
    first = await decide(harness, job_id, call, {"approved": True}, key="approve-refund-a1")
    assert first.status_code == 202
    assert first.json() == {"job_id": job_id, "call_id": call, "status": "approved"}
    again = await decide(harness, job_id, call, {"approved": True}, key="approve-refund-a1")
    assert again.status_code == 202 and again.headers["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    same = await decide(harness, job_id, call, {"approved": True})
    assert same.status_code == 202
    other_decision = await decide(harness, job_id, call, {"approved": False})
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
    # Who decided: the API key's id, as `oncely keys list` shows it.
    key_id = hash_api_key(harness.auth["Authorization"].removeprefix("Bearer "))[:12]
    assert view["steps"][1]["decision"] == {"approved": True, "by": f"key:{key_id}", "reason": None}

    finished = await decide(harness, job_id, call, {"approved": False})
    assert finished.status_code in (404, 409)


async def oncely_key(harness: Harness, tenant: str) -> dict[str, str]:
    from oncely.api.auth import create_api_key

    return {"Authorization": f"Bearer {await create_api_key(harness.pool, tenant)}"}


async def test_a_rejected_refund_is_never_sent_and_the_model_hears_why(desk) -> None:
    harness, relay, mail = desk
    worker = harness.worker("helpdesk")
    job_id = await harness.submit("/v1/helpdesk", {"text": f"Refund A1. {REFUND}"})
    await drain(worker)
    call = await pending_call(harness, job_id)
    rejected = await decide(harness, job_id, call, {"approved": False, "reason": "over the limit"})
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
    from oncely.cli.ops import decide_call
    from oncely.jobs.approvals import ArgumentsRefused

    harness, _, _ = desk
    worker = harness.worker("helpdesk")
    job_id = await harness.submit("/v1/helpdesk", {"text": f"Refund A1. {REFUND}"})
    await drain(worker)
    s = harness.settings.model_copy(update={"app": "tests.test_approvals:APP"})
    call = await pending_call(harness, job_id)
    # Edited arguments are checked as the API checks them: nothing stored.
    for edited in ({"cents": "x"}, {"cents": 100, "bogus": 1}):
        with pytest.raises(ArgumentsRefused) as refused:
            await decide_call(s, uuid.UUID(job_id), call, {"approved": True, "arguments": edited})
        assert refused.value.errors and refused.value.errors[0]["loc"][0] == "arguments"
    assert await harness.checkpoints.events(job_id) == {}
    outcome = await decide_call(
        s, uuid.UUID(job_id), call, {"approved": False, "reason": "no refunds today"}
    )
    assert outcome is not None and outcome.outcome == "received"
    [stored] = (await harness.checkpoints.events(job_id)).values()
    assert stored["by"] == f"cli:{getpass.getuser()}"
    assert stored["reason"] == "no refunds today"
    assert await harness.status(job_id) == "queued"
    missing = await decide_call(s, uuid.UUID(job_id), "0" * 20, {"approved": True})
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
    call = await pending_call(harness, job_id)
    settings = harness.settings.model_copy(update={"console_key": SecretStr(KEY)})
    transport = httpx.ASGITransport(app=asgi_app(settings, redis, pool, APP))
    async with httpx.AsyncClient(transport=transport, base_url="http://oncely.test") as console:
        assert (await console.post("/console/login", data={"key": KEY})).status_code == 303
        page = (await console.get(f"/console/workflows/helpdesk/jobs/{job_id}")).text
        assert 'id="approval"' in page and "refund" in page and call in page
        action = f"/console/workflows/helpdesk/jobs/{job_id}/approvals/{call}"
        forged = await console.post(action, data={"csrf": "f" * 64, "decision": "approve"})
        assert forged.status_code == 403
        # A provider's id (or a path in one) names nothing on the console either.
        for other in ("call_1", "..%2F..%2Foutbox%2F1%2Fretry"):
            stray = f"/console/workflows/helpdesk/jobs/{job_id}/approvals/{other}"
            refused = await console.post(stray, data={"csrf": csrf_of(page), "decision": "approve"})
            assert refused.status_code == 404, (other, refused.status_code)
        assert await harness.status(job_id) == "waiting"
        decided = await console.post(
            action, data={"csrf": csrf_of(page), "decision": "reject", "reason": "no"}
        )
        assert decided.status_code == 303
        assert "decided=rejected" in decided.headers["location"]
    assert await harness.status(job_id) == "queued"
    await drain(harness.worker("helpdesk"))
    view = await harness.get("/v1/helpdesk", job_id)
    assert view["result"]["tools"] == ["refund:rejected"]
    [approval] = [step for step in view["steps"] if step["kind"] == "approval"]
    assert approval["decision"] == {"approved": False, "by": "console", "reason": "no"}


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
    assert (view["status"], view["error"]) == ("dead", "agent-limit: max_turns")
    [(error,)] = await harness.rows("SELECT error FROM jobs WHERE job_id = %s", job_id)
    assert error.startswith("agent-limit: ") and "max_turns (2 turns" in error
    assert [s["kind"] for s in view["steps"]] == ["model", "tool", "model", "tool"]


@pytest.mark.parametrize("ids", ["repeat", "none"])
async def test_a_decision_decides_only_the_call_it_was_made_for(desk, ids) -> None:
    """A provider that repeats ``call_0`` on every turn (or sends no ids):
    approving a 500-cent refund does not approve the 999,999-cent one the
    model asks for next; that one waits for a decision of its own."""
    harness, relay, mail = desk
    worker = harness.worker("helpdesk")
    text = (
        '[[fake:tool=refund {"order_id": "A1", "cents": 500}]] '
        '[[fake:tool=refund {"order_id": "A1", "cents": 999999}]] '
        f"[[fake:tool_ids={ids}]] Refund A1 twice."
    )
    job_id = await harness.submit("/v1/helpdesk", {"text": text})
    await drain(worker)
    first = (await harness.get("/v1/helpdesk", job_id))["waiting"]["approval"]
    assert first["arguments"]["cents"] == 500 and is_call_id(first["call_id"])
    approved = await decide(harness, job_id, first["call_id"], {"approved": True})
    assert approved.status_code == 202, approved.text
    await drain(worker)
    await relay.run_once()
    await drain(worker)

    view = await harness.get("/v1/helpdesk", job_id)
    assert view["status"] == "waiting", view
    second = view["waiting"]["approval"]
    assert second["arguments"]["cents"] == 999999
    assert is_call_id(second["call_id"]) and second["call_id"] != first["call_id"]
    # One refund went out, the approved one; the other waits for a person.
    assert await topics(harness, job_id) == [
        "approval.requested",
        "refund.issue",
        "approval.requested",
    ]
    assert [
        (s["key"], s["status"]) for s in view["steps"] if s["kind"] in ("approval", "call")
    ] == [
        ("support/refund/approval", "done"),
        ("support/refund/call", "done"),
        ("support/refund#2/approval", "waiting"),
    ]
    rejected = await decide(harness, job_id, second["call_id"], {"approved": False})
    assert rejected.json()["status"] == "rejected"
    await drain(worker)
    view = await harness.get("/v1/helpdesk", job_id)
    assert view["status"] == "done", view
    assert view["result"]["tools"] == ["refund:ok", "refund:rejected"]
    await relay.run_once()
    refunds = [k for k in (await mail.deliveries())["by_key"] if k.startswith("refund.issue")]
    assert refunds == [f"refund.issue:{job_id}:support/refund/call"]


async def test_decisions_with_unstorable_text_or_loose_arguments_are_refused(desk) -> None:
    """NUL or a lone surrogate in a reason or in edited arguments, a call id
    with NUL, extra fields and ``true`` for cents: 4xx, nothing stored, the
    job still waits for its decision."""
    harness, _, _ = desk
    job_id = await harness.submit("/v1/helpdesk", {"text": f"Refund A1. {REFUND}"})
    await drain(harness.worker("helpdesk"))
    call = await pending_call(harness, job_id)
    for body in (
        {"approved": False, "reason": "no\u0000"},
        {"approved": False, "reason": "half \ud800 a pair"},
        {"approved": True, "arguments": {"order_id": "A1\u0000", "cents": 5}},
        {"approved": True, "arguments": {"order_id": "A1", "cents": 5, "note": "x"}},
        {"approved": True, "arguments": {"order_id": "A1", "cents": True}},
    ):
        refused = await decide(harness, job_id, call, body)
        assert refused.status_code == 422, (body, refused.text)
    nul_id = await harness.api.post(
        f"/v1/helpdesk/{job_id}/approvals/%00",
        json={"approved": True},
        headers={**harness.auth, "Idempotency-Key": f"decision-{uuid.uuid4()}"},
    )
    assert nul_id.status_code == 404
    assert await harness.checkpoints.events(job_id) == {}
    assert await harness.status(job_id) == "waiting"


async def test_tool_arguments_with_nul_are_answered_to_the_model_as_an_error(desk) -> None:
    harness, _, _ = desk
    nul = '[[fake:tool=lookup_order {"order_id": "A\\u0000"}]]'
    _, view = await run_once(harness, "helpdesk", {"text": f"Look it up. {nul}"})
    assert view["status"] == "done", view
    assert view["result"]["tools"] == ["lookup_order:error"]
    told = harness.fake.model.recent[-1]
    assert any("NUL" in (m.get("content") or "") for m in told if m["role"] == "tool")


async def test_every_turn_of_a_streaming_agent_streams_its_tokens(custom) -> None:
    """``Workflow(stream=True)``: each model turn of an agent sends its text
    as token events for its own step, and the tokens kept are the stored turn."""
    agent = Agent("support", "You help.", [lookup_order])

    async def step(request: Ask, ctx: Context) -> Answer:
        run = await agent.run(ctx, request.text)
        return Answer(reply=str(run.output), tools=[c.tool for c in run.tool_calls])

    app = App(
        [
            Workflow(
                name="streamer",
                route="/v1/streamer",
                request=Ask,
                result=Answer,
                step=step,
                stream=True,
            )
        ]
    )
    harness = await custom(app)
    lookup = '[[fake:tool=lookup_order {"order_id": "A1"}]]'
    view, tokens = await streamed(harness, "streamer", "/v1/streamer", f"Where is A1? {lookup}")
    assert tokens.get("support/model#2") == view["result"]["reply"]
    assert view["result"]["reply"]
