"""Unit tests of the LangGraph support agent with oncely.testing: no Redis,
no PostgreSQL, no model. The model's turns are scripted (a turn that calls
tools is ``ToolCalls``), so is the refund service's answer and a person's
decision; each path, and a crash in the middle of the run."""

from __future__ import annotations

import json

from examples.langgraph_support import workflow
from examples.shop_cases import CHAIR, CHAIR_TURNS, REFUNDED, TEAPOT, TEAPOT_TURNS
from oncely import ApprovalDecision
from oncely.testing import ToolCalls, run_step


async def test_a_small_refund_is_made_at_once() -> None:
    run = await run_step(workflow, TEAPOT, answers=TEAPOT_TURNS, calls={"refund.issue": REFUNDED})
    assert run.result.reply == "Sorry about the teapot: we refunded 42.00."
    assert run.result.refunded_cents == 4200
    assert run.result.tool_calls == ["lookup_order:success", "refund:success"]
    assert run.steps == (
        "support/model",
        "support/lookup_order/tool",
        "support/model#2",
        "support/refund/call",
        "support/model#3",
    )
    # The model saw the instructions, the message, then each tool's answer.
    last = run.calls[-1].messages
    assert [m.role for m in last] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert json.loads(last[3].content)["item"] == "teapot"
    assert json.loads(last[5].content)["id"] == "evt_1"
    [reply] = run.emitted
    assert (reply.topic, reply.payload["reply"]) == ("support.reply", run.result.reply)


async def test_a_large_refund_waits_for_a_person_and_a_rejection_refunds_nothing() -> None:
    rejected = await run_step(
        workflow,
        CHAIR,
        answers=CHAIR_TURNS,
        approvals={"refund": ApprovalDecision(approved=False, reason="ask the warehouse")},
    )
    assert rejected.result.refunded_cents == 0
    assert rejected.result.tool_calls == ["lookup_order:success", "refund:error"]
    assert "support/refund/call" not in rejected.steps
    told = [m.content for m in rejected.calls[-1].messages if m.role == "tool"]
    assert json.loads(told[1]) == {"rejected": True, "reason": "ask the warehouse"}

    approved = await run_step(
        workflow,
        CHAIR,
        answers=CHAIR_TURNS,
        calls={"refund.issue": REFUNDED},
        approvals={"refund": True},
    )
    assert approved.result.refunded_cents == 38900
    assert "support/refund/approval" in approved.steps


async def test_an_unknown_order_is_told_to_the_model() -> None:
    run = await run_step(
        workflow,
        {"customer": "cy@example.com", "message": "Where is order Z-1?"},
        answers=[ToolCalls(("lookup_order", {"order_id": "Z-1"})), "I could not find it."],
    )
    assert run.result.tool_calls == ["lookup_order:error"]
    told = [m.content for m in run.calls[-1].messages if m.role == "tool"]
    assert told == ["no order 'Z-1'"]


async def test_a_crash_after_the_lookup_repeats_nothing() -> None:
    run = await run_step(
        workflow,
        TEAPOT,
        answers=TEAPOT_TURNS,
        calls={"refund.issue": REFUNDED},
        crash_after="support/lookup_order/tool",
    )
    assert run.result.refunded_cents == 4200
    assert run.model_calls == 3, "no turn paid for twice"
