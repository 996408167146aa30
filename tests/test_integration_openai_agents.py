"""An OpenAI Agents SDK agent run unchanged inside an oncely step, in
process on real Redis and PostgreSQL, the fake model over HTTP and the fake
receiver: every turn is one model call at the fake, the lookup tool runs
once, the refund is one signed delivery whose answer reaches the model; a
redelivery in the middle repays nothing; ``needs_approval`` waits for an
oncely decision; ``max_turns`` kills the job with its reason."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import agents
import pytest
from agents import Agent, RunContextWrapper, RunHooks, Tool, function_tool
from pydantic import BaseModel

import oncely
from oncely import App, Context, TransientError, Workflow
from oncely.decisions import is_call_id
from oncely.fakes.mail import FakeMailServer
from oncely.integrations import openai_agents
from oncely.outbox.relay import Relay
from oncely.testing import ToolCalls, run_step
from tests.durable import Harness, agent_desk, drain, redeliver_until, relayed, run_once
from tests.helpers import RefundArgs

SECRET = "openai-agents-test-secret"
LOOKUP = '[[fake:tool=lookup_order {"order_id": "A1"}]]'
REFUND = '[[fake:tool=refund {"order_id": "A1", "cents": 1200}]]'
DELETE = '[[fake:tool=delete_account {"customer": "ada"}]]'

agents.set_tracing_disabled(True)

# What the tools really did, across every run of a test.
LOOKUPS: list[str] = []
DELETIONS: list[str] = []
KEYS: list[str] = []


class Ask(BaseModel):
    text: str
    max_turns: int | None = None


class Answer(BaseModel):
    reply: str
    agent: str


@function_tool
def lookup_order(order_id: str) -> dict[str, Any]:
    """Look an order up."""
    LOOKUPS.append(order_id)
    KEYS.append(oncely.tool_key())
    return {"order_id": order_id, "total_cents": 4200}


@function_tool(needs_approval=True)
def delete_account(customer: str) -> str:
    """Delete a customer's account."""
    DELETIONS.append(customer)
    return f"deleted {customer}"


refund = openai_agents.as_tool(
    oncely.call_tool("refund.issue", args=RefundArgs, description="Refund.", name="refund")
)

support = Agent(
    name="support", instructions="You help.", tools=[lookup_order, refund, delete_account]
)


class FailOnceAfterTheLookup(RunHooks[Any]):
    """A transient failure once the lookup ran: the job is redelivered."""

    def __init__(self) -> None:
        self.failed = False

    async def on_tool_end(
        self, context: RunContextWrapper[Any], agent: Agent[Any], tool: Tool, result: str
    ) -> None:
        if tool.name == "lookup_order" and not self.failed:
            self.failed = True
            raise TransientError("the worker went away after the lookup")


def helpdesk(hooks: Callable[[], RunHooks[Any] | None] = lambda: None) -> App:
    async def step(request: Ask, ctx: Context) -> Answer:
        result = await openai_agents.run(
            ctx, support, request.text, max_turns=request.max_turns, hooks=hooks()
        )
        return Answer(reply=str(result.final_output), agent=result.last_agent.name)

    return agent_desk("helpdesk", "/v1/helpdesk", Ask, Answer, step, support)


@pytest.fixture(autouse=True)
def forget_runs() -> None:
    LOOKUPS.clear()
    DELETIONS.clear()
    KEYS.clear()


@pytest.fixture
async def desk(custom, mail) -> AsyncIterator[tuple[Harness, Relay, FakeMailServer]]:
    harness = await custom(helpdesk())
    async with relayed(harness, mail, SECRET) as relay:
        yield harness, relay, mail


async def refunds(mail: FakeMailServer) -> dict[str, int]:
    return {k: n for k, n in (await mail.deliveries())["by_key"].items() if "refund" in k}


async def tool_messages(harness: Harness) -> list[str]:
    """The tool messages of the last request the fake model answered."""
    return [m["content"] for m in harness.fake.model.recent[-1] if m["role"] == "tool"]


async def test_three_turns_three_model_calls_one_lookup_one_signed_refund(desk) -> None:
    harness, relay, mail = desk
    worker = harness.worker("helpdesk")
    job_id = await harness.submit("/v1/helpdesk", {"text": f"Refund A1. {LOOKUP} {REFUND}"})
    await drain(worker)
    # Two turns, the lookup, then the refund call waits for its answer.
    assert await harness.status(job_id) == "waiting"
    assert await harness.outbox(job_id) == ["refund.issue"]
    await relay.run_once()
    await drain(worker)

    view = await harness.get("/v1/helpdesk", job_id)
    assert view["status"] == "done", view
    assert view["result"]["agent"] == "support"
    assert harness.fake.stats().total == 3
    assert LOOKUPS == ["A1"]
    assert [f"{job_id}:support/lookup_order/tool"] == KEYS
    assert await refunds(mail) == {f"refund.issue:{job_id}:support/refund/call": 1}
    [event] = [e for e in await mail.events() if e["type"] == "refund.issue"]
    assert event["headers"]["webhook-id"] and event["headers"]["webhook-signature"]
    lookup, refunded = await tool_messages(harness)
    assert "4200" in lookup
    assert json.loads(refunded)["ok"] is True and json.loads(refunded)["id"] == event["id"]
    assert [(s["key"], s["kind"], s.get("tool")) for s in view["steps"]] == [
        ("support/model", "model", None),
        ("support/lookup_order/tool", "tool", "lookup_order"),
        ("support/model#2", "model", None),
        ("support/refund/call", "call", "refund"),
        ("support/model#3", "model", None),
    ]


async def test_a_redelivery_after_the_lookup_repays_no_turn_and_repeats_no_lookup(
    custom, pool, tmp_path
) -> None:
    hooks = FailOnceAfterTheLookup()
    harness = await custom(helpdesk(lambda: hooks))
    async with (
        FakeMailServer(tmp_path / "mailbox.jsonl") as mail,
        relayed(harness, mail, SECRET) as relay,
    ):
        worker = harness.worker("helpdesk", redelivery_base_s=0.01, redelivery_max_s=0.01)
        job_id = await harness.submit("/v1/helpdesk", {"text": f"Refund A1. {LOOKUP} {REFUND}"})
        await redeliver_until(harness, worker, "helpdesk", lambda: waiting(harness, job_id))
        assert hooks.failed
        # The first delivery paid one turn and ran the lookup; the second paid one turn more.
        assert harness.fake.stats().total == 2
        assert LOOKUPS == ["A1"]
        await relay.run_once()
        await drain(worker)
        assert (await harness.get("/v1/helpdesk", job_id))["status"] == "done"
        assert harness.fake.stats().total == 3
        assert LOOKUPS == ["A1"]
        assert list((await refunds(mail)).values()) == [1]


async def waiting(harness: Harness, job_id: str) -> bool:
    return await harness.status(job_id) == "waiting"


async def decide(harness: Harness, job_id: str, call_id: str, body: dict[str, Any]) -> Any:
    headers = {**harness.auth, "Idempotency-Key": f"decision-{uuid.uuid4()}"}
    return await harness.api.post(
        f"/v1/helpdesk/{job_id}/approvals/{call_id}", json=body, headers=headers
    )


async def asked_to_delete(harness: Harness) -> tuple[Any, str, dict[str, Any]]:
    """A job asking to delete an account, its worker drained once: the
    worker, the job, and the approval the job waits for."""
    worker = harness.worker("helpdesk")
    job_id = await harness.submit("/v1/helpdesk", {"text": f"Delete me. {DELETE}"})
    await drain(worker)
    view = await harness.get("/v1/helpdesk", job_id)
    assert view["status"] == "waiting"
    return worker, job_id, view["waiting"]["approval"]


async def test_needs_approval_waits_for_a_person_and_an_approval_runs_the_tool_once(desk) -> None:
    harness, _, _ = desk
    worker, job_id, approval = await asked_to_delete(harness)
    assert (approval["tool"], approval["arguments"]) == ("delete_account", {"customer": "ada"})
    assert is_call_id(approval["call_id"])
    assert DELETIONS == []
    assert harness.fake.stats().total == 1

    decided = await decide(harness, job_id, approval["call_id"], {"approved": True})
    assert decided.status_code == 202, decided.text
    await drain(worker)
    view = await harness.get("/v1/helpdesk", job_id)
    assert view["status"] == "done", view
    assert DELETIONS == ["ada"]
    assert harness.fake.stats().total == 2
    assert [s["key"] for s in view["steps"]] == [
        "support/model",
        "support/delete_account/approval",
        "support/delete_account/tool",
        "support/model#2",
    ]


async def test_a_rejection_runs_nothing_and_the_model_hears_why(desk) -> None:
    harness, _, _ = desk
    worker, job_id, approval = await asked_to_delete(harness)
    call = approval["call_id"]
    body = {"approved": False, "reason": "accounts are closed by the owner"}
    assert (await decide(harness, job_id, call, body)).status_code == 202
    await drain(worker)
    assert (await harness.get("/v1/helpdesk", job_id))["status"] == "done"
    assert DELETIONS == []
    [told] = await tool_messages(harness)
    assert json.loads(told) == {"rejected": True, "reason": "accounts are closed by the owner"}


async def test_max_turns_on_a_tool_calling_agent_kills_the_job_with_its_reason(desk) -> None:
    harness, _, _ = desk
    body = {"text": f"Look twice. {LOOKUP} {LOOKUP}", "max_turns": 1}
    job_id, view = await run_once(harness, "helpdesk", body)
    assert (view["status"], view["error"]) == ("dead", "agent-limit: max_turns")
    [(error,)] = await harness.rows("SELECT error FROM jobs WHERE job_id = %s", job_id)
    assert error.startswith("agent-limit: ") and "max_turns (1 turns" in error
    assert harness.fake.stats().total == 1
    assert LOOKUPS == ["A1"]


async def test_edited_arguments_of_an_approval_are_what_the_tool_runs_with(desk) -> None:
    harness, _, _ = desk
    worker, job_id, approval = await asked_to_delete(harness)
    call = approval["call_id"]
    body = {"approved": True, "arguments": {"customer": "ada-test"}}
    assert (await decide(harness, job_id, call, body)).status_code == 202
    await drain(worker)
    assert (await harness.get("/v1/helpdesk", job_id))["status"] == "done"
    assert DELETIONS == ["ada-test"]
    [told] = await tool_messages(harness)
    assert told == "deleted ada-test"


async def test_edited_arguments_that_fail_the_tools_schema_are_refused_422(desk) -> None:
    """The run kept the SDK tool's JSON schema with the wait: edits that fail
    it are refused by the API, nothing decided, the job still waiting."""
    harness, _, _ = desk
    worker, job_id, approval = await asked_to_delete(harness)
    call = approval["call_id"]
    refused = await decide(harness, job_id, call, {"approved": True, "arguments": {"customer": 7}})
    assert refused.status_code == 422, refused.text
    [error] = refused.json()["errors"]
    assert error["loc"] == ["body", "arguments", "customer"]
    assert (await harness.get("/v1/helpdesk", job_id))["status"] == "waiting"
    body = {"approved": True, "arguments": {"customer": "ada-test"}}
    assert (await decide(harness, job_id, call, body)).status_code == 202
    await drain(worker)
    assert DELETIONS == ["ada-test"]


class Verdict(BaseModel):
    order_id: str
    refund: bool


billing = Agent(
    name="billing", instructions="You settle bills.", tools=[lookup_order], output_type=Verdict
)
triage = Agent(name="triage", instructions="You route.", handoffs=[billing])


async def test_a_handoff_runs_the_next_agent_in_the_same_run_with_its_output_type(custom) -> None:
    async def step(request: Ask, ctx: Context) -> Answer:
        result = await openai_agents.run(ctx, triage, request.text)
        assert isinstance(result.final_output, Verdict)
        return Answer(reply=result.final_output.order_id, agent=result.last_agent.name)

    harness = await custom(
        App([Workflow(name="bills", route="/v1/bills", request=Ask, result=Answer, step=step)])
    )
    text = f"My bill. [[fake:tool=transfer_to_billing {{}}]] {LOOKUP}"
    _, view = await run_once(harness, "bills", {"text": text})
    assert view["status"] == "done", view
    assert view["result"]["agent"] == "billing"
    assert LOOKUPS == ["A1"]
    assert harness.fake.stats().total == 3
    assert [s["key"] for s in view["steps"]] == [
        "triage/model",
        "triage/model#2",
        "triage/lookup_order/tool",
        "triage/model#3",
    ]
    # The second agent was told its own instructions; the agents themselves are unchanged.
    assert harness.fake.model.recent[-1][0] == {"role": "system", "content": "You settle bills."}
    assert triage.handoffs == [billing] and billing.tools == [lookup_order]


async def test_parallel_tool_calls_each_keep_their_own_scope_and_answer(desk) -> None:
    harness, _, _ = desk
    both = '[[fake:tool=lookup_order {"order_id": "B2"}]] [[fake:tools=parallel]]'
    job_id, view = await run_once(harness, "helpdesk", {"text": f"Two orders. {LOOKUP} {both}"})
    assert view["status"] == "done", view
    assert sorted(LOOKUPS) == ["A1", "B2"]
    assert sorted(KEYS) == [
        f"{job_id}:support/lookup_order#2/tool",
        f"{job_id}:support/lookup_order/tool",
    ]
    told = {
        m["tool_call_id"]: m["content"]
        for m in harness.fake.model.recent[-1]
        if m["role"] == "tool"
    }
    assert "A1" in told["call_1"] and "B2" in told["call_2"]


async def test_max_tokens_kills_the_job_before_the_turn_past_it(custom) -> None:
    async def step(request: Ask, ctx: Context) -> Answer:
        await openai_agents.run(ctx, support, request.text, max_tokens=1)
        raise AssertionError("the run went past its tokens")

    harness = await custom(
        App([Workflow(name="tokens", route="/v1/tokens", request=Ask, result=Answer, step=step)])
    )
    job_id = await harness.submit("/v1/tokens", {"text": f"Look. {LOOKUP}"})
    await drain(harness.worker("tokens"))
    view = await harness.get("/v1/tokens", job_id)
    assert (view["status"], view["error"]) == ("dead", "agent-limit: max_tokens")
    [(error,)] = await harness.rows("SELECT error FROM jobs WHERE job_id = %s", job_id)
    assert "max_tokens (1 turns" in error
    assert LOOKUPS == ["A1"]
    assert harness.fake.stats().total == 1


STOCK: list[str] = []


@oncely.tool
def stock_left(sku: str) -> dict[str, Any]:
    """How many of an item are left."""
    STOCK.append(sku)
    return {"sku": sku, "left": 3}


shop = Agent(
    name="shop",
    instructions="You sell.",
    tools=[openai_agents.as_tool(stock_left)],
    output_type=Verdict,
)


async def shop_step(request: Ask, ctx: Context) -> Answer:
    result = await openai_agents.run(ctx, shop, request.text)
    return Answer(reply=result.final_output.model_dump_json(), agent=result.last_agent.name)


async def test_an_oncely_function_tool_and_an_output_type_replay_after_a_crash() -> None:
    STOCK.clear()
    workflow = Workflow(name="shop", route="/v1/shop", request=Ask, result=Answer, step=shop_step)
    run = await run_step(
        workflow,
        {"text": "Is T1 in stock?"},
        answers=[
            ToolCalls(("stock_left", {"sku": 7}), ("stock_left", {"sku": "T1"})),
            {"order_id": "T1", "refund": False},
        ],
        crash_after="shop/stock_left#2/tool",
    )
    assert json.loads(run.result.reply) == {"order_id": "T1", "refund": False}
    assert run.model_calls == 2
    assert STOCK == ["T1"]
    bad, good = [m.content for m in run.calls[-1].messages if m.role == "tool"]
    assert "invalid arguments" in bad and json.loads(good) == {"sku": "T1", "left": 3}
    assert run.calls[-1].schema is not None


async def test_a_parallel_turn_with_an_approval_runs_the_approved_tool_once(desk) -> None:
    """The SDK cancels the turn's other calls when one waits: as with
    oncely.Agent, they are done again on resume unless their value was
    stored, under the same ``tool_key`` (at least once; once for an API that
    dedupes on it)."""
    harness, _, _ = desk
    worker = harness.worker("helpdesk")
    text = f"Both. {LOOKUP} {DELETE} [[fake:tools=parallel]]"
    job_id = await harness.submit("/v1/helpdesk", {"text": text})
    await drain(worker)
    view = await harness.get("/v1/helpdesk", job_id)
    assert view["status"] == "waiting", view
    assert DELETIONS == []
    call = view["waiting"]["approval"]["call_id"]
    assert (await decide(harness, job_id, call, {"approved": True})).status_code == 202
    await drain(worker)
    view = await harness.get("/v1/helpdesk", job_id)
    assert view["status"] == "done", view
    assert DELETIONS == ["ada"]
    assert set(LOOKUPS) == {"A1"}
    assert set(KEYS) == {f"{job_id}:support/lookup_order/tool"}
    assert harness.fake.stats().total == 2


HANDED: list[str] = []
counter = Agent(name="counter", instructions="You count.", tools=[lookup_order])
front = Agent(
    name="front",
    instructions="You greet.",
    handoffs=[agents.handoff(counter, on_handoff=lambda _: HANDED.append("counter"))],
)
# Handoffs may go round in a circle.
counter.handoffs = [front]


async def front_step(request: Ask, ctx: Context) -> Answer:
    result = await openai_agents.run(ctx, front, request.text)
    return Answer(reply=str(result.final_output), agent=result.last_agent.name)


async def test_a_handoff_object_hands_over_to_an_agent_whose_tools_are_checkpoints() -> None:
    HANDED.clear()
    workflow = Workflow(
        name="front", route="/v1/front", request=Ask, result=Answer, step=front_step
    )
    run = await run_step(
        workflow,
        {"text": "Where is A1?"},
        answers=[
            ToolCalls(("transfer_to_counter", {})),
            ToolCalls(("lookup_order", {"order_id": "A1"})),
            "Shipped.",
        ],
    )
    assert (run.result.agent, run.result.reply) == ("counter", "Shipped.")
    assert run.steps == ("front/model", "front/model#2", "front/lookup_order/tool", "front/model#3")
    assert LOOKUPS == ["A1"] and HANDED == ["counter"]
    assert counter.tools == [lookup_order] and counter.handoffs == [front]


ASKED: list[str] = []


@function_tool
def ask_twice(question: str) -> str:
    """Ask again."""
    ASKED.append(question)
    return "asked"


async def test_a_run_copies_an_agent_once_and_again_after_any_change_to_it_or_its_handoffs() -> (
    None
):
    """Runs share the agent's copy (its tools as checkpoints) until the
    agent, a tool or a handoff target changes: then the next run sees the
    change, and the user's own objects stay as they were."""
    LOOKUPS.clear()
    ASKED.clear()
    desk = Agent(name="desk", instructions="You help.", tools=[lookup_order])
    back = Agent(name="back", instructions="You count.")
    desk.handoffs = [back]
    back.handoffs = [desk]

    async def step(request: Ask, ctx: Context) -> Answer:
        result = await openai_agents.run(ctx, desk, request.text)
        return Answer(reply=str(result.final_output), agent=result.last_agent.name)

    workflow = Workflow(name="desk", route="/v1/desk", request=Ask, result=Answer, step=step)
    first = openai_agents._CLONES.of(desk)
    assert openai_agents._CLONES.of(desk) is first, "an unchanged agent is copied once"
    turns = [ToolCalls(("transfer_to_back", {})), "Counted."]

    back.instructions = "You count twice."
    run = await run_step(workflow, {"text": "Count."}, answers=turns)
    assert run.calls[-1].messages[0].content == "You count twice.", "a target's change is seen"
    assert openai_agents._CLONES.of(desk) is not first

    desk.tools.append(ask_twice)  # in place
    run = await run_step(
        workflow, {"text": "Ask."}, answers=[ToolCalls(("ask_twice", {"question": "q"})), "Done."]
    )
    assert run.steps == ("desk/model", "desk/ask_twice/tool", "desk/model#2")
    assert ASKED == ["q"]

    lookup_order.description = "Look an order up, by id."
    try:
        told = {t.name: t.description for t in openai_agents._CLONES.of(desk).tools}
    finally:
        lookup_order.description = "Look an order up."
    assert told["lookup_order"] == "Look an order up, by id.", "a tool's change is seen"
    assert desk.tools == [lookup_order, ask_twice] and back.handoffs == [desk]


def test_the_sdks_input_items_become_chat_messages_with_calls_on_their_assistant_turn() -> None:
    items: list[Any] = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Where is A1?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {
            "type": "message",
            "role": "assistant",
            "id": "m1",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Looking.", "annotations": []}],
        },
        {"type": "function_call", "call_id": "c1", "name": "lookup_order", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "lookup_order", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "shipped"},
        {"type": "function_call_output", "call_id": "c2", "output": "lost"},
    ]
    messages = openai_agents.chat_messages("You help.", items)
    assert [m["role"] for m in messages] == [
        "system",
        "system",
        "user",
        "assistant",
        "tool",
        "tool",
    ]
    assert messages[2]["content"] == "Where is A1?"
    assert messages[3]["content"] == "Looking."
    assert [c["id"] for c in messages[3]["tool_calls"]] == ["c1", "c2"]
    assert [m["tool_call_id"] for m in messages[4:]] == ["c1", "c2"]
    image = {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}
    with pytest.raises(oncely.PermanentError, match="input_image"):
        openai_agents.chat_messages(None, [image])  # type: ignore[list-item]
