"""Unit tests of the OpenAI Agents SDK support agent with oncely.testing: no
Redis, no PostgreSQL, no model. The model's turns are scripted (a turn that
calls tools is ``ToolCalls``), so is the refund service's answer and a
person's decision; each path, and a crash in the middle of the run."""

from __future__ import annotations

import agents

from examples.openai_agents_support import workflow
from examples.shop_cases import CHAIR, CHAIR_TURNS, REFUNDED, TEAPOT, TEAPOT_TURNS
from oncely import ApprovalDecision
from oncely.testing import run_step

agents.set_tracing_disabled(True)


async def test_a_small_refund_is_made_at_once_and_the_customer_gets_one_email() -> None:
    run = await run_step(workflow, TEAPOT, answers=TEAPOT_TURNS, calls={"refund.issue": REFUNDED})
    assert run.result.refunded_cents == 4200
    assert run.result.tool_calls == ["lookup_order", "refund"]
    assert run.steps == (
        "support/model",
        "support/lookup_order/tool",
        "support/model#2",
        "support/refund/call",
        "support/model#3",
    )
    assert [e.topic for e in run.emitted] == ["support.reply"]
    # The lookup's answer reached the model as the SDK tells it.
    told = [m.content for m in run.calls[1].messages if m.role == "tool"]
    assert "teapot" in told[0]


async def test_a_large_refund_waits_for_a_person_and_a_rejection_refunds_nothing() -> None:
    no = ApprovalDecision(approved=False, reason="ask for photos first")
    rejected = await run_step(workflow, CHAIR, answers=CHAIR_TURNS, approvals={"refund": no})
    assert rejected.result.refunded_cents == 0
    assert "support/refund/call" not in rejected.steps
    assert [e.topic for e in rejected.emitted] == ["approval.requested", "support.reply"]
    told = [m.content for m in rejected.calls[-1].messages if m.role == "tool"]
    assert "ask for photos first" in told[-1]

    approved = await run_step(
        workflow,
        CHAIR,
        answers=CHAIR_TURNS,
        calls={"refund.issue": REFUNDED},
        approvals={"refund": True},
    )
    assert approved.result.refunded_cents == 38900
    assert "support/refund/approval" in approved.steps


async def test_a_crash_after_the_lookup_repeats_no_turn() -> None:
    run = await run_step(
        workflow,
        TEAPOT,
        answers=TEAPOT_TURNS,
        calls={"refund.issue": REFUNDED},
        crash_after="support/lookup_order/tool",
    )
    assert run.result.refunded_cents == 4200
    assert run.model_calls == 3, "no turn paid for twice"


async def test_a_crash_after_the_refund_call_sends_nothing_twice() -> None:
    run = await run_step(
        workflow,
        TEAPOT,
        answers=TEAPOT_TURNS,
        calls={"refund.issue": REFUNDED},
        crash_after="support/refund/call",
    )
    assert run.result.refunded_cents == 4200
    assert run.model_calls == 3
