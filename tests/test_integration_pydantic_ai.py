"""A Pydantic AI agent, unchanged, in an oncely step, in process on real Redis
and PostgreSQL, the fake model over HTTP and the fake receiver: each request
is a model checkpoint paid for once, each tool a tool checkpoint run once, a
call tool's call one signed delivery, ``requires_approval`` an oncely
approval, and the limits (oncely's and Pydantic AI's own) end the job
(docs/framework-pydantic-ai.md)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterable, AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_ai import Agent, ApprovalRequired, NativeOutput, RunContext, UsageLimits
from pydantic_ai.messages import TextContent
from pydantic_ai.toolsets import FunctionToolset

import oncely
from oncely import (
    App,
    ApprovalDecision,
    Context,
    PermanentError,
    TransientError,
    Workflow,
    webhook,
)
from oncely.fakes.mail import FakeMailServer
from oncely.integrations import pydantic_ai as oncely_pai
from oncely.outbox.relay import Relay
from oncely.testing import ToolCalls, run_step
from tests.durable import (
    Harness,
    agent_desk,
    drain,
    pending,
    redeliver_until,
    relayed,
    streamed,
)
from tests.helpers import RefundArgs, Refunded

SECRET = "pydantic-ai-test-secret"
LOOKUP = '[[fake:tool=lookup_order {"order_id": "A1"}]]'
REFUND = '[[fake:tool=refund {"order_id": "A1", "cents": 4200}]]'
CANCEL = '[[fake:tool=cancel_order {"order_id": "A1"}]]'


class Ask(BaseModel):
    text: str
    max_turns: int | None = None
    request_limit: int | None = None


class Answer(BaseModel):
    reply: str


# What the tools did, by job: a tool's run counted where it happens.
LOOKUPS: list[str] = []
CANCELLED: list[str] = []
# The jobs whose second request failed once, before it was sent.
FAILED_ONCE: set[str] = set()

support = Agent(
    name="support",
    instructions="You are the support desk.",
    tools=[
        oncely_pai.as_tool(
            oncely.call_tool(
                "refund.issue",
                args=RefundArgs,
                name="refund",
                description="Refund an order, in cents.",
            )
        )
    ],
)


@support.tool_plain
def lookup_order(order_id: str) -> dict[str, Any]:
    """Look an order up by its id."""
    LOOKUPS.append(oncely.tool_key())
    return {"order_id": order_id, "total_cents": 4200}


@support.tool_plain(requires_approval=True)
def cancel_order(order_id: str) -> str:
    """Cancel an order."""
    CANCELLED.append(oncely.tool_key())
    return f"cancelled {order_id}"


@support.instructions
def flaky_instructions(ctx: Any) -> str:
    """Fails once, for a job that asks for it, as the second request is built:
    after the lookup ran, before the turn that follows it was paid for."""
    text = str(ctx.prompt)
    if "[[break-once]]" in text and text not in FAILED_ONCE and len(ctx.messages) > 1:
        FAILED_ONCE.add(text)
        raise TransientError("the instructions could not be read")
    return "Be brief."


async def step(request: Ask, ctx: Context) -> Answer:
    limits = UsageLimits(request_limit=request.request_limit) if request.request_limit else None
    result = await oncely_pai.run(
        ctx, support, request.text, max_turns=request.max_turns, usage_limits=limits
    )
    return Answer(reply=str(result.output))


ROUTE = "/v1/pai-support"
APP = agent_desk("pai_support", ROUTE, Ask, Answer, step, support)


@pytest.fixture
async def desk(custom, mail) -> AsyncIterator[tuple[Harness, Relay, FakeMailServer]]:
    harness = await custom(APP)
    async with relayed(harness, mail, SECRET) as relay:
        yield harness, relay, mail


def marked(text: str) -> tuple[str, str]:
    """A job's text with a mark of its own, to count its model calls."""
    mark = f"job-{uuid.uuid4().hex[:12]}"
    return mark, f"{mark} {text}"


def keys_of(job_id: str, found: list[str]) -> list[str]:
    return [k for k in found if k.startswith(f"{job_id}:")]


async def decide(harness: Harness, job_id: str, call_id: str, body: dict[str, Any]) -> Any:
    headers = {
        **harness.auth,
        "Idempotency-Key": f"decision-{uuid.uuid4()}",
        "Content-Type": "application/json",
    }
    return await harness.api.post(
        f"{ROUTE}/{job_id}/approvals/{call_id}", content=json.dumps(body), headers=headers
    )


async def asked(harness: Harness, words: str, **options: Any) -> tuple[Any, str, str]:
    """A job of ``words`` (marked), its worker (of ``options``) drained
    once: the worker, the job and its mark."""
    worker = harness.worker("pai_support", **options)
    mark, text = marked(words)
    job_id = await harness.submit(ROUTE, {"text": text})
    await drain(worker)
    return worker, job_id, mark


async def test_three_turns_three_requests_one_lookup_one_signed_refund(desk) -> None:
    harness, relay, mail = desk
    # Turn 1 asks for the lookup, turn 2 for the refund: the job waits for its answer.
    worker, job_id, mark = await asked(harness, f"My teapot A1 broke. {LOOKUP} {REFUND}")
    assert await harness.status(job_id) == "waiting"
    assert await harness.outbox(job_id) == ["refund.issue"]
    await relay.run_once()
    await relay.run_once()
    await drain(worker)

    view = await harness.get(ROUTE, job_id)
    assert view["status"] == "done", view
    assert harness.calls(mark) == 3, "one request a turn, none paid for again on the resume"
    assert keys_of(job_id, LOOKUPS) == [f"{job_id}:support/lookup_order/tool"]
    assert [(s["key"], s["tool"]) for s in view["steps"]] == [
        ("support/model", None),
        ("support/lookup_order/tool", "lookup_order"),
        ("support/model#2", None),
        ("support/refund/call", "refund"),
        ("support/model#3", None),
    ]
    refunds = [k for k in (await mail.deliveries())["by_key"] if k.startswith("refund.issue")]
    assert refunds == [f"refund.issue:{job_id}:support/refund/call"]
    [event] = [e for e in await mail.events() if e["type"] == "refund.issue"]
    assert event["headers"]["webhook-id"] == refunds[0]
    assert event["headers"]["webhook-signature"]
    assert event["data"] == {"order_id": "A1", "cents": 4200}
    # The refund's answer reached the model, as the last request's tool message.
    told = harness.fake.model.recent[-1]
    answers = [m["content"] for m in told if m["role"] == "tool"]
    assert '"total_cents":4200' in answers[0]
    assert json.loads(answers[1])["ok"] is True
    assert told[0] == {"role": "system", "content": "You are the support desk.\n\nBe brief."}


async def test_a_failure_after_the_lookup_resumes_paying_and_running_nothing_twice(desk) -> None:
    harness, _, _ = desk
    worker = harness.worker("pai_support", redelivery_base_s=0.01, redelivery_max_s=0.01)
    mark, text = marked(f"[[break-once]] Where is A1? {LOOKUP}")
    job_id = await harness.submit(ROUTE, {"text": text})

    async def done() -> bool:
        return await harness.status(job_id) == "done"

    await redeliver_until(harness, worker, "pai_support", done)
    assert text in FAILED_ONCE
    deliveries = await harness.rows(
        "SELECT outcome FROM job_deliveries WHERE job_id = %s ORDER BY id", job_id
    )
    assert [d[0] for d in deliveries] == ["retry", "done"]
    assert harness.calls(mark) == 2, "the answered turn was not paid for again"
    assert keys_of(job_id, LOOKUPS) == [f"{job_id}:support/lookup_order/tool"]
    assert await harness.keys(job_id) == [
        "support/model",
        "support/lookup_order/tool",
        "support/model#2",
    ]


async def test_requires_approval_waits_for_a_person_and_runs_once_approved(desk) -> None:
    harness, _, _ = desk
    worker, job_id, mark = await asked(harness, f"Cancel A1. {CANCEL}", concurrency=1)

    view = await harness.get(ROUTE, job_id)
    assert view["status"] == "waiting"
    waiting = view["waiting"]["approval"]
    assert (waiting["tool"], waiting["arguments"]) == ("cancel_order", {"order_id": "A1"})
    assert [(s["key"], s["status"]) for s in view["steps"]] == [
        ("support/model", "done"),
        ("support/cancel_order/approval", "waiting"),
    ]
    assert keys_of(job_id, CANCELLED) == [], "nothing ran before the decision"
    assert await harness.outbox(job_id) == ["approval.requested"]
    assert await pending(harness, "pai_support") == 0, "the wait holds no worker"

    approved = await decide(harness, job_id, waiting["call_id"], {"approved": True})
    assert approved.status_code == 202, approved.text
    await drain(worker)
    view = await harness.get(ROUTE, job_id)
    assert view["status"] == "done", view
    assert keys_of(job_id, CANCELLED) == [f"{job_id}:support/cancel_order/tool"]
    assert harness.calls(mark) == 2
    told = harness.fake.model.recent[-1]
    assert [m["content"] for m in told if m["role"] == "tool"] == ["cancelled A1"]


async def test_a_rejection_runs_nothing_and_the_model_hears_why(desk) -> None:
    harness, _, _ = desk
    worker, job_id, _ = await asked(harness, f"Cancel A1. {CANCEL}")
    call = (await harness.get(ROUTE, job_id))["waiting"]["approval"]["call_id"]

    rejected = await decide(harness, job_id, call, {"approved": False, "reason": "shipped already"})
    assert rejected.json()["status"] == "rejected"
    await drain(worker)
    assert (await harness.get(ROUTE, job_id))["status"] == "done"
    assert keys_of(job_id, CANCELLED) == []
    told = harness.fake.model.recent[-1]
    [said] = [json.loads(m["content"]) for m in told if m["role"] == "tool"]
    assert said == {"rejected": True, "reason": "shipped already"}


async def test_edits_that_fail_the_tools_schema_are_refused_422(desk) -> None:
    harness, _, _ = desk
    _, job_id, _ = await asked(harness, f"Cancel A1. {CANCEL}")
    call = (await harness.get(ROUTE, job_id))["waiting"]["approval"]["call_id"]
    refused = await decide(harness, job_id, call, {"approved": True, "arguments": {}})
    assert refused.status_code == 422, refused.text
    assert "order_id" in refused.json()["errors"][0]["msg"]
    assert (await harness.get(ROUTE, job_id))["status"] == "waiting", "nothing decided"
    assert keys_of(job_id, CANCELLED) == []


@pytest.mark.parametrize(
    ("limit", "reason"),
    [({"max_turns": 1}, "max_turns"), ({"request_limit": 1}, "usage_limits")],
)
async def test_past_a_limit_the_job_is_dead_with_agent_limit(desk, limit, reason) -> None:
    harness, _, _ = desk
    mark, text = marked(f"Where is A1? {LOOKUP}")
    job_id = await harness.submit(ROUTE, {"text": text, **limit})
    await drain(harness.worker("pai_support"))

    view = await harness.get(ROUTE, job_id)
    assert (view["status"], view["error"]) == ("dead", f"agent-limit: {reason}")
    [(error,)] = await harness.rows("SELECT error FROM jobs WHERE job_id = %s", job_id)
    assert error.startswith("agent-limit: ") and f"{reason} (1 turns" in error
    assert harness.calls(mark) == 1
    assert keys_of(job_id, LOOKUPS) == [f"{job_id}:support/lookup_order/tool"]


# -- the rest of Pydantic AI's surface, through oncely.testing (no servers) ----


class Verdict(BaseModel):
    refund: bool
    note: str


def one_agent_workflow(agent: Agent[Any, Any], **run_kwargs: Any) -> Workflow[Any, Any]:
    async def decide(request: Ask, ctx: Context) -> Answer:
        result = await oncely_pai.run(ctx, agent, request.text, **run_kwargs)
        output = result.output
        return Answer(reply=output.model_dump_json() if isinstance(output, BaseModel) else output)

    return Workflow(
        name="pai_one", route="/v1/pai-one", request=Ask, result=Answer, step=decide, agents=[agent]
    )


async def test_structured_output_by_an_output_tool_round_trips() -> None:
    agent = Agent(name="judge", output_type=Verdict)
    run = await run_step(
        one_agent_workflow(agent),
        {"text": "Refund?"},
        answers=[ToolCalls(("final_result", {"refund": True, "note": "broken"}))],
    )
    assert Verdict.model_validate_json(run.result.reply) == Verdict(refund=True, note="broken")
    assert run.steps == ("judge/model",), "an output tool is no tool checkpoint"


async def test_native_structured_output_asks_for_the_schema() -> None:
    agent = Agent(name="judge", output_type=NativeOutput(Verdict))
    run = await run_step(
        one_agent_workflow(agent),
        {"text": "Refund?"},
        answers=[{"refund": False, "note": "too old"}],
    )
    assert Verdict.model_validate_json(run.result.reply) == Verdict(refund=False, note="too old")
    assert run.calls[0].schema == "Verdict"


async def test_a_toolset_given_to_the_run_and_parallel_calls_are_checkpoints_each() -> None:
    ran: list[str] = []
    extra = FunctionToolset[Any]()

    @extra.tool_plain
    def stock(sku: str) -> int:
        """Units in stock."""
        ran.append(oncely.tool_key())
        return 3

    agent = Agent(name="shop")
    run = await run_step(
        one_agent_workflow(agent, toolsets=[extra]),
        {"text": "Stock?"},
        answers=[ToolCalls(("stock", {"sku": "a"}), ("stock", {"sku": "b"})), "3 and 3."],
        crash_after="shop/stock#2/tool",
    )
    assert run.result.reply == "3 and 3."
    assert run.steps == ("shop/model", "shop/stock/tool", "shop/stock#2/tool", "shop/model#2")
    assert sorted(k.split(":", 1)[1] for k in ran) == ["shop/stock#2/tool", "shop/stock/tool"]
    assert run.model_calls == 2
    # Counted per tool, as oncely.Agent's calls are: twice, then the replay's.
    from prometheus_client import REGISTRY

    labels = {"workflow": "pai_one", "tool": "stock", "status": "ok"}
    assert (REGISTRY.get_sample_value("oncely_tool_calls_total", labels) or 0) >= 2


async def test_a_tool_outside_a_run_of_oncely_says_where_it_answers() -> None:
    from pydantic_ai.models.test import TestModel

    with pytest.raises(RuntimeError, match=r"oncely.integrations.pydantic_ai.run"):
        await support.run("Refund", model=TestModel(call_tools=["refund"]))


async def test_a_tool_that_defers_itself_ends_the_job_saying_what_to_do_instead() -> None:
    agent = Agent(name="shop")

    @agent.tool
    def refund_all(ctx: RunContext[Any]) -> str:
        """Refund everything."""
        if not ctx.tool_call_approved:
            raise ApprovalRequired()
        return "refunded"

    with pytest.raises(PermanentError, match="declare it with requires_approval=True"):
        await run_step(
            one_agent_workflow(agent), {"text": "Refund."}, answers=[ToolCalls(("refund_all", {}))]
        )


async def test_a_prompt_of_text_items_reaches_the_model_as_text() -> None:
    agent = Agent(name="shop", instructions="Be brief.")

    async def step(request: Ask, ctx: Context) -> Answer:
        prompt = [TextContent(request.text, metadata={"from": "app"}), "Thanks."]
        result = await oncely_pai.run(ctx, agent, prompt)
        return Answer(reply=result.output)

    workflow = Workflow(
        name="pai_items", route="/v1/pai-items", request=Ask, result=Answer, step=step
    )
    run = await run_step(workflow, {"text": "Where is A1?"}, answers=["On its way."])
    assert run.result.reply == "On its way."
    assert [(m.role, m.content) for m in run.calls[0].messages] == [
        ("system", "Be brief."),
        ("user", "Where is A1?\nThanks."),
    ]


async def test_an_event_stream_handler_sees_each_answered_turn() -> None:
    agent = Agent(name="shop")
    seen: list[str] = []

    @agent.tool_plain
    def stock(sku: str) -> int:
        """Units in stock."""
        return 3

    async def handler(ctx: RunContext[Any], events: AsyncIterable[Any]) -> None:
        seen.extend([type(event).__name__ async for event in events])

    run = await run_step(
        one_agent_workflow(agent, event_stream_handler=handler),
        {"text": "Stock?"},
        answers=[ToolCalls(("stock", {"sku": "a"})), "3 in stock."],
    )
    assert run.result.reply == "3 in stock."
    assert run.steps == ("shop/model", "shop/stock/tool", "shop/model#2")
    assert {"PartStartEvent", "FunctionToolCallEvent", "FunctionToolResultEvent"} <= set(seen)


async def test_an_agent_with_pydantic_ai_durable_execution_on_is_refused() -> None:
    from pydantic_ai.durable_exec import BaseDurabilityCapability

    class Durable(BaseDurabilityCapability[Any]):
        """An engine's capability, as Temporal's, DBOS's and Prefect's are."""

        def in_durable_context(self) -> bool:
            return False

        def get_durable_operation_backend(self) -> Any:
            raise NotImplementedError

    # Only its type matters: built bare, as no engine is installed here.
    durable = object.__new__(Durable)
    agent = SimpleNamespace(
        name="support", root_capability=SimpleNamespace(apply=lambda v: v(durable))
    )
    with pytest.raises(ValueError, match=r"durable execution on \(Durable\)"):
        await oncely_pai.run(None, agent, "Hello")  # type: ignore[arg-type]


@pytest.mark.parametrize("ids", ["repeat", "none"])
async def test_a_provider_repeating_or_leaving_out_tool_call_ids_pairs_results_rightly(
    desk, ids
) -> None:
    harness, _, _ = desk
    second = '[[fake:tool=lookup_order {"order_id": "B2"}]]'
    mark, text = marked(f"Where are A1 and B2? {LOOKUP} {second} [[fake:tool_ids={ids}]]")
    job_id = await harness.submit(ROUTE, {"text": text})
    await drain(harness.worker("pai_support"))

    view = await harness.get(ROUTE, job_id)
    assert view["status"] == "done", view
    assert harness.calls(mark) == 3
    assert keys_of(job_id, LOOKUPS) == [
        f"{job_id}:support/lookup_order/tool",
        f"{job_id}:support/lookup_order#2/tool",
    ]
    told = harness.fake.model.recent[-1]
    answers = [json.loads(m["content"])["order_id"] for m in told if m["role"] == "tool"]
    assert answers == ["A1", "B2"]


async def test_a_person_s_edits_run_the_tool_or_are_told_to_the_model_when_invalid() -> None:
    agent = Agent(name="shop")
    cancelled: list[str] = []

    @agent.tool_plain(requires_approval=True)
    def cancel_order(order_id: str) -> str:
        """Cancel an order."""
        cancelled.append(order_id)
        return f"cancelled {order_id}"

    script = [ToolCalls(("cancel_order", {"order_id": "A1"})), "Done."]
    edited = ApprovalDecision(approved=True, arguments={"order_id": "B2"})
    run = await run_step(
        one_agent_workflow(agent),
        {"text": "Cancel."},
        answers=script,
        approvals={"cancel_order": edited},
    )
    assert cancelled == ["B2"]
    assert [m.content for m in run.calls[-1].messages if m.role == "tool"] == ["cancelled B2"]

    invalid = ApprovalDecision(approved=True, arguments={"order_id": 5})
    run = await run_step(
        one_agent_workflow(agent),
        {"text": "Cancel."},
        answers=script,
        approvals={"cancel_order": invalid},
    )
    assert cancelled == ["B2"], "invalid edits run nothing"
    [told] = [m.content for m in run.calls[-1].messages if m.role == "tool"]
    assert "the approved arguments are invalid" in told


async def test_the_durability_form_runs_the_agent_with_the_steps_context() -> None:
    """``OncelyAgent(agent).run(...)`` inside a step, as Pydantic AI's
    durable agents are run: the same checkpoints as ``run(ctx, agent, ...)``,
    found through ``oncely.current_context()``; outside a step it says where."""
    agent = Agent(name="desk", instructions="Be brief.")
    durable = oncely_pai.OncelyAgent(agent, max_turns=3)

    async def answer(request: Ask, ctx: Context) -> Answer:
        result = await durable.run(request.text)
        return Answer(reply=result.output)

    workflow = Workflow(name="pai_d", route="/v1/pai-d", request=Ask, result=Answer, step=answer)
    run = await run_step(workflow, {"text": "Hello?"}, answers=["Hello."], crash_after="desk/model")
    assert run.result.reply == "Hello."
    assert run.steps == ("desk/model",)
    with pytest.raises(RuntimeError, match="only known while a step runs"):
        await durable.run("outside")


async def test_each_turn_of_a_streaming_workflow_streams_its_tokens(custom) -> None:
    """``Workflow(stream=True)``: every model request Pydantic AI makes sends
    its text as token events under its own step, and what a client keeps is
    the stored answer."""
    streaming = App(
        [
            Workflow(
                name="pai_stream",
                route="/v1/pai-stream",
                request=Ask,
                result=Answer,
                step=step,
                effects=[webhook("refund.issue", returns=Refunded), webhook("approval.requested")],
                agents=[support],
                stream=True,
            )
        ]
    )
    harness = await custom(streaming)
    _, text = marked(f"Where is A1? {LOOKUP}")
    view, tokens = await streamed(harness, "pai_stream", "/v1/pai-stream", text)
    assert tokens.get("support/model#2") == view["result"]["reply"]
