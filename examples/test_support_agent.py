"""Unit tests of the support agent with oncely.testing: no Redis, no
PostgreSQL, no model. The model's turns are scripted (a turn that calls
tools is ``ToolCalls``), so is the refund service's answer and a person's
decision; each path, and a crash in the middle of the run."""

from __future__ import annotations

import asyncio

from examples.shop_cases import CHAIR, CHAIR_TURNS, REFUNDED, TEAPOT, TEAPOT_TURNS
from examples.support_agent import workflow
from oncely import ApprovalDecision
from oncely.testing import ProviderError, ToolCalls, run_step


async def test_a_small_refund_is_made_at_once_and_the_customer_gets_one_email() -> None:
    run = await run_step(
        workflow,
        TEAPOT,
        answers=TEAPOT_TURNS,
        calls={"refund.issue": REFUNDED},
    )
    assert run.result.refunded_cents == 4200
    assert run.result.tool_calls == ["lookup_order:ok", "refund:ok"]
    assert run.steps == (
        "support/model",
        "support/lookup_order/tool",
        "support/model#2",
        "support/refund/call",
        "support/model#3",
    )
    assert [e.topic for e in run.emitted] == ["support.reply"]


async def test_a_large_refund_waits_for_a_person_and_a_rejection_refunds_nothing() -> None:
    rejected = await run_step(
        workflow, CHAIR, answers=CHAIR_TURNS, approvals={"refund": ApprovalDecision(approved=False)}
    )
    assert rejected.result.refunded_cents == 0
    assert rejected.result.tool_calls == ["lookup_order:ok", "refund:rejected"]
    assert "support/refund/call" not in rejected.steps
    assert [e.topic for e in rejected.emitted] == ["approval.requested", "support.reply"]

    approved = await run_step(
        workflow,
        CHAIR,
        answers=CHAIR_TURNS,
        calls={"refund.issue": REFUNDED},
        approvals={"refund": True},
    )
    assert approved.result.refunded_cents == 38900


async def test_an_unknown_order_and_a_refused_refund_are_told_to_the_model() -> None:
    run = await run_step(
        workflow,
        {"customer": "cy@example.com", "message": "Refund order Z-1 please."},
        answers=[
            ToolCalls(("lookup_order", {"order_id": "Z-1"})),
            ToolCalls(("refund", {"order_id": "A-1001", "cents": 100, "reason": "x"})),
            "I could not find that order.",
        ],
        calls={"refund.issue": ProviderError(422)},
    )
    assert run.result.tool_calls == ["lookup_order:error", "refund:error"]
    told = [m.content for m in run.calls[-1].messages if m.role == "tool"]
    assert "no order 'Z-1'" in told[0] and "refused" in told[1]


async def test_a_crash_after_the_refund_call_repeats_nothing() -> None:
    run = await run_step(
        workflow,
        TEAPOT,
        answers=[
            ToolCalls(("lookup_order", {"order_id": "A-1001"})),
            ToolCalls(("refund", {"order_id": "A-1001", "cents": 4200, "reason": "broken"})),
            "Refunded.",
        ],
        calls={"refund.issue": REFUNDED},
        crash_after="support/refund/call",
    )
    assert run.result.refunded_cents == 4200
    assert run.model_calls == 3, "no turn paid for twice"
    # The crash went through the agent's task group: this task keeps no
    # cancel request from it (it would cancel the next thing awaited).
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    await asyncio.sleep(0)
