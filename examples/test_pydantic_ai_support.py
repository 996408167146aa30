"""Unit tests of the Pydantic AI support agent with oncely.testing: no Redis,
no PostgreSQL, no model. Pydantic AI's requests are answered by the scripted
model (a turn that calls tools is ``ToolCalls``), so is the refund service
and a person's decision; each path, and a crash in the middle of the run."""

from __future__ import annotations

from examples.pydantic_ai_support import support, workflow
from examples.shop_cases import CHAIR, CHAIR_TURNS, REFUNDED, TEAPOT, TEAPOT_TURNS
from oncely import ApprovalDecision
from oncely.testing import ToolCalls, run_step


async def test_a_small_refund_is_made_at_once_and_the_customer_gets_one_email() -> None:
    run = await run_step(
        workflow,
        TEAPOT,
        answers=TEAPOT_TURNS,
        calls={"refund.issue": REFUNDED},
    )
    assert run.result.reply == "Sorry about the teapot: we refunded 42.00."
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
    # Pydantic AI's history reached the model: instructions, message, tool results.
    told = run.calls[-1].messages
    assert [m.role for m in told] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert told[0].content.startswith("You are the support desk")


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
    assert "support/refund/approval" in approved.steps


async def test_an_unknown_order_is_retried_by_pydantic_ai_and_the_model_is_told() -> None:
    run = await run_step(
        workflow,
        {"customer": "cy@example.com", "message": "Refund order Z-1 please."},
        answers=[
            ToolCalls(("lookup_order", {"order_id": "Z-1"})),
            ToolCalls(("lookup_order", {"order_id": "A-1001"})),
            "Found it: the teapot.",
        ],
    )
    assert run.result.tool_calls == ["lookup_order:retried", "lookup_order:ok"]
    assert "support/lookup_order#2/tool" in run.steps
    told = [m.content for m in run.calls[1].messages if m.role == "tool"]
    assert "no order 'Z-1'" in told[0]


async def test_a_crash_after_the_lookup_runs_nothing_and_pays_nothing_twice() -> None:
    run = await run_step(
        workflow,
        TEAPOT,
        answers=[
            ToolCalls(("lookup_order", {"order_id": "A-1001"})),
            ToolCalls(("refund", {"order_id": "A-1001", "cents": 4200, "reason": "broken"})),
            "Refunded.",
        ],
        calls={"refund.issue": REFUNDED},
        crash_after="support/lookup_order/tool",
    )
    assert run.result.refunded_cents == 4200
    assert run.model_calls == 3, "no turn paid for twice"


async def test_the_same_agent_runs_outside_oncely_unchanged() -> None:
    from pydantic_ai.models.test import TestModel

    result = await support.run("Hello", model=TestModel(call_tools=[]))
    assert isinstance(result.output, str)
    assert support.model is None, "oncely's model was for its runs only"
