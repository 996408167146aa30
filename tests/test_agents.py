"""Agents with tools, through ``oncely.testing`` (no servers): the loop's
turns and tool calls as checkpoints, errors the model can recover from, run
limits, approvals, and replays after a crash at any agent checkpoint. The
same through real processes: tests/test_agents_processes.py."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

import oncely
from oncely import (
    Agent,
    AgentLimitReached,
    ApprovalDecision,
    Context,
    PermanentError,
    ToolContext,
    Workflow,
)
from oncely.testing import ProviderError, ReplayError, ToolCalls, run_step
from tests.helpers import RefundArgs, Refunded

LOOKUPS: list[dict[str, Any]] = []


@oncely.tool
def lookup_order(order_id: str, ctx: ToolContext) -> dict[str, Any]:
    """Look an order up by its id."""
    LOOKUPS.append({"order_id": order_id, "key": ctx.key})
    return {"order_id": order_id, "total_cents": 4200}


refund = oncely.call_tool(
    "refund.issue",
    args=RefundArgs,
    description="Refund part of an order.",
    name="refund",
    approval=True,
)
refund_now = oncely.call_tool(
    "refund.issue", args=RefundArgs, description="Refund.", name="refund_now"
)


class Ask(BaseModel):
    text: str


class Answer(BaseModel):
    reply: str
    turns: int
    tools: list[str]


def agent_workflow(agent: Agent) -> Workflow[Any, Any]:
    async def step(request: Ask, ctx: Context) -> Answer:
        run = await agent.run(ctx, request.text)
        return Answer(
            reply=str(run.output),
            turns=run.turns,
            tools=[f"{c.tool}:{c.status}" for c in run.tool_calls],
        )

    return Workflow(
        name="support",
        route="/v1/support",
        request=Ask,
        result=Answer,
        step=step,
        effects=[
            oncely.webhook("refund.issue", returns=Refunded),
            oncely.webhook("approval.requested"),
        ],
        agents=[agent],
    )


SUPPORT = Agent("support", "You help customers.", [lookup_order, refund, refund_now])
WORKFLOW = agent_workflow(SUPPORT)


@pytest.fixture(autouse=True)
def _forget_lookups() -> None:
    LOOKUPS.clear()


async def look_up_and_refund(text: str, reply: str, **options: Any) -> Any:
    """``run_step`` of ``WORKFLOW`` on ``text``, the model asking for the
    lookup, then the refund (answered ok), then replying ``reply``."""
    return await run_step(
        WORKFLOW,
        {"text": text},
        answers=[
            ToolCalls(("lookup_order", {"order_id": "A1"})),
            ToolCalls(("refund_now", {"order_id": "A1", "cents": 1200})),
            reply,
        ],
        calls={"refund.issue": {"ok": True, "id": "evt_1"}},
        **options,
    )


async def test_a_function_tool_and_a_call_tool_then_the_answer() -> None:
    run = await look_up_and_refund("Where is order A1? Refund it.", "Refunded 12.00.")
    assert run.result.reply == "Refunded 12.00."
    assert run.result.turns == 3
    assert run.result.tools == ["lookup_order:ok", "refund_now:ok"]
    assert run.steps == (
        "support/model",
        "support/lookup_order/tool",
        "support/model#2",
        "support/refund_now/call",
        "support/model#3",
    )
    assert [{"order_id": "A1", "key": LOOKUPS[0]["key"]}] == LOOKUPS
    assert LOOKUPS[0]["key"].endswith(":support/lookup_order/tool")
    # The model saw each tool's result after its call.
    last = run.calls[-1].messages
    assert [m.role for m in last] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert '"total_cents":4200' in last[3].content
    assert last[3].tool_call_id == "call_1"
    assert '"id":"evt_1"' in last[5].content


async def test_parallel_tool_calls_run_together_each_in_its_own_scope() -> None:
    run = await run_step(
        WORKFLOW,
        {"text": "Look both up."},
        answers=[
            ToolCalls(("lookup_order", {"order_id": "A1"}), ("lookup_order", {"order_id": "B2"})),
            "Both found.",
        ],
    )
    assert run.steps == (
        "support/model",
        "support/lookup_order/tool",
        "support/lookup_order#2/tool",
        "support/model#2",
    )
    assert sorted(c["order_id"] for c in LOOKUPS) == ["A1", "B2"]
    assert len({c["key"] for c in LOOKUPS}) == 2


async def test_errors_the_model_can_recover_from_are_results_not_failures() -> None:
    run = await run_step(
        WORKFLOW,
        {"text": "Try things."},
        answers=[
            ToolCalls(("no_such_tool", {})),
            ToolCalls(("lookup_order", "{not json")),
            ToolCalls(("lookup_order", {"order": "A1"})),
            ToolCalls(("refund_now", {"order_id": "A1", "cents": 5})),
            "I could not do it.",
        ],
        calls={"refund.issue": ProviderError(400)},
    )
    assert run.result.tools == [
        "no_such_tool:error",
        "lookup_order:error",
        "lookup_order:error",
        "refund_now:error",
    ]
    assert LOOKUPS == [], "a call with bad arguments never runs the tool"
    told = [m.content for m in run.calls[-1].messages if m.role == "tool"]
    assert "unknown tool 'no_such_tool'" in told[0]
    # A name the model made up is never a metric label.
    from prometheus_client import REGISTRY

    labels = {s.labels.get("tool") for metric in REGISTRY.collect() for s in metric.samples}
    assert "no_such_tool" not in labels and "unknown-tool" in labels
    assert "not a JSON object" in told[1]
    assert "invalid arguments" in told[2]
    assert "the call failed (refused)" in told[3]


async def limit_reached(
    agent: Agent, text: str, answers: list[Any], **options: Any
) -> AgentLimitReached:
    """What ``run_step`` of ``agent`` on ``text`` raises, ``answers`` scripted."""
    with pytest.raises(AgentLimitReached) as raised:
        await run_step(agent_workflow(agent), {"text": text}, answers=answers, **options)
    return raised.value


async def test_a_run_past_max_turns_raises_with_its_reason() -> None:
    agent = Agent("looper", "Loop.", [lookup_order], max_turns=2)
    limit = await limit_reached(
        agent, "Loop.", [ToolCalls(("lookup_order", {"order_id": "A1"}))] * 2
    )
    assert limit.reason == "max_turns"
    assert limit.run.turns == 2
    assert str(limit).startswith("max_turns (2 turns")
    assert limit.dead_reason == "agent-limit"


async def test_max_tokens_stops_before_the_turn_that_would_pass_it() -> None:
    agent = Agent("frugal", "Be brief.", [lookup_order], max_tokens=5)
    limit = await limit_reached(
        agent,
        "A question long enough to spend more than five tokens at once.",
        [ToolCalls(("lookup_order", {"order_id": "A1"})), "never asked"],
    )
    assert limit.reason == "max_tokens"
    assert limit.run.turns == 1


async def test_max_cost_usd_stops_before_the_turn_that_would_pass_it() -> None:
    agent = Agent("costly", "Be brief.", [lookup_order], max_cost_usd=0.005)
    script = [ToolCalls(("lookup_order", {"order_id": "A1"})), "Shipped."]
    # Unpriced, the cost is unknown: the limit never stops the run.
    unpriced = await run_step(agent_workflow(agent), {"text": "Where is A1?"}, answers=script)
    assert unpriced.usage.get("cost_usd") is None and unpriced.model_calls == 2
    # At a dollar a thousand tokens, the first turn spends past half a cent.
    limit = await limit_reached(agent, "Where is A1?", script, prices="test-model=1000/1000")
    assert limit.reason == "max_cost_usd"
    assert limit.run.turns == 1
    assert limit.run.usage["cost_usd"] >= 0.005
    assert limit.dead_reason == "agent-limit"


async def test_an_approved_refund_is_called_and_a_rejected_one_is_not() -> None:
    script = [ToolCalls(("refund", {"order_id": "A1", "cents": 1200})), "done"]
    approved = await run_step(
        WORKFLOW,
        {"text": "Refund A1."},
        answers=script,
        calls={"refund.issue": {"ok": True, "id": "evt_9"}},
        approvals={
            "refund": ApprovalDecision(approved=True, arguments={"order_id": "A1", "cents": 1000})
        },
    )
    assert approved.result.tools == ["refund:ok"]
    assert approved.steps[1:3] == ("support/refund/approval", "support/refund/call")
    requested = [e for e in approved.emitted if e.topic == "approval.requested"]
    assert requested[0].payload["tool"] == "refund"
    assert requested[0].payload["arguments"] == {"order_id": "A1", "cents": 1200}

    rejected = await run_step(
        WORKFLOW, {"text": "Refund A1."}, answers=script, approvals={"refund": False}
    )
    assert rejected.result.tools == ["refund:rejected"]
    assert "support/refund/call" not in rejected.steps
    told = [m.content for m in rejected.calls[-1].messages if m.role == "tool"]
    assert '"rejected":true' in told[0]

    timed_out = await run_step(WORKFLOW, {"text": "Refund A1."}, answers=script)
    assert timed_out.result.tools == ["refund:rejected"], "no decision: on_approval_timeout"


@pytest.mark.parametrize(
    "key",
    ["support/model", "support/lookup_order/tool", "support/model#2", "support/refund_now/call"],
)
async def test_a_crash_at_any_agent_checkpoint_replays_paying_nothing_twice(key: str) -> None:
    run = await look_up_and_refund("Where is A1? Refund it.", "Refunded.", crash_after=key)
    assert run.result.reply == "Refunded."
    assert len(LOOKUPS) == 1, "a stored tool call never runs again"
    assert run.model_calls == 3


async def test_structured_output_that_fails_validation_is_asked_again() -> None:
    class Verdict(BaseModel):
        category: str

    agent = Agent("judge", "Judge.", [], output=Verdict)

    async def step(request: Ask, ctx: Context) -> Answer:
        run = await agent.run(ctx, request.text)
        return Answer(reply=run.output.category, turns=run.turns, tools=[])

    workflow = Workflow(name="judging", route="/v1/judging", request=Ask, result=Answer, step=step)
    run = await run_step(workflow, {"text": "x"}, answers=['{"nope": 1}', {"category": "bug"}])
    assert run.result.reply == "bug" and run.result.turns == 2
    assert run.calls[-1].schema == "Verdict"


def test_tool_names_and_shapes_are_checked_at_declaration() -> None:
    with pytest.raises(ValueError, match="tool name"):
        oncely.tool(name="Bad Name")(lambda: None)
    with pytest.raises(ValueError, match="share a name"):
        Agent("a", "x", [lookup_order, lookup_order])
    default = oncely.call_tool("refund.issue", args=RefundArgs, description="Refund.")
    assert default.name == "refund_issue"


_ = ReplayError


async def test_an_approval_its_workflow_cannot_receive_is_refused_at_the_wait() -> None:
    """An agent whose workflow does not declare it has no approvals route:
    a tool that asks for a decision fails loudly, not after 48 silent hours."""

    async def step(request: Ask, ctx: Context) -> Answer:
        run = await SUPPORT.run(ctx, request.text)
        return Answer(reply=str(run.output), turns=run.turns, tools=[])

    undeclared = Workflow(
        name="support",
        route="/v1/support",
        request=Ask,
        result=Answer,
        step=step,
        effects=[oncely.webhook("refund.issue", returns=Refunded)],
    )
    assert not undeclared.approvals
    script = [ToolCalls(("refund", {"order_id": "A1", "cents": 100})), "done"]
    with pytest.raises(PermanentError, match="no approvals route"):
        await run_step(undeclared, {"text": "refund"}, answers=script)
