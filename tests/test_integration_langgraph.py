"""LangGraph graphs inside a step, in process, on real Redis and PostgreSQL,
the fake model over HTTP and the fake receiver: each chat_model() request a
model checkpoint, each as_tool tool a tool checkpoint, an oncely call tool a
signed call sent once by the relay, approvals and limits as oncely.Agent's
(docs/framework-langgraph.md)."""

from __future__ import annotations

import json
import uuid
import warnings
from collections.abc import AsyncIterator
from typing import Annotated, Any, TypedDict

import pytest
from langchain_core.messages import AnyMessage, HumanMessage
from langchain_core.tools import tool as langchain_tool
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode, tools_condition
from langgraph.prebuilt import create_react_agent as deprecated_react_agent
from langgraph.types import interrupt
from langgraph.warnings import LangGraphDeprecatedSinceV10
from pydantic import BaseModel

import oncely
from oncely import App, Context, TransientError, Workflow
from oncely.fakes.mail import FakeMailServer
from oncely.integrations import langgraph as lg
from oncely.outbox.relay import Relay
from oncely.testing import ToolCalls, run_step
from tests.durable import Harness, agent_desk, drain, redeliver_until, relayed
from tests.helpers import RefundArgs

SECRET = "langgraph-test-secret"
LOOKUP = '[[fake:tool=lookup_order {"order_id": "A1"}]]'
REFUND = '[[fake:tool=refund {"order_id": "A1", "cents": 1200}]]'
BIG_REFUND = '[[fake:tool=refund_big {"order_id": "A1", "cents": 9000}]]'

# Every run of the lookup's body, with its stable key.
LOOKUPS: list[str] = []
# Job ids whose step has already failed once after the lookup (crash test).
BROKEN: list[str] = []


class Ask(BaseModel):
    text: str


class Answer(BaseModel):
    reply: str
    messages: int


def lookup_order(order_id: str) -> dict[str, Any]:
    """Look an order up by its id."""
    LOOKUPS.append(oncely.tool_key())
    return {"order_id": order_id, "total_cents": 4200}


@langchain_tool
def refund_big(order_id: str, cents: int) -> str:
    """Refund a large amount (a person decides)."""
    LOOKUPS.append(f"refund_big:{order_id}:{cents}")
    return f"refunded {cents} on {order_id}"


refund = oncely.call_tool(
    "refund.issue", args=RefundArgs, description="Refund part of an order.", name="refund"
)


def create_react_agent(*args: Any, **kwargs: Any) -> Any:
    """LangGraph's prebuilt agent, still the one without the ``langchain``
    package (LangGraph 1.0 points to ``langchain.agents.create_agent``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LangGraphDeprecatedSinceV10)
        return deprecated_react_agent(*args, **kwargs)


TOOLS = [lg.as_tool(lookup_order), lg.as_tool(refund), lg.as_tool(refund_big, approval=True)]

REACT = create_react_agent(lg.chat_model(), TOOLS, prompt="You help customers.", name="support")


def crash_once_after_the_lookup(state: dict[str, Any]) -> dict[str, Any]:
    """A node between checkpoints that fails the delivery once, after the
    lookup answered (a worker lost mid-run, as far as the job can tell)."""
    if LOOKUPS and not BROKEN:
        BROKEN.append("crashed")
        raise TransientError("the worker died after the lookup")
    return {"llm_input_messages": state["messages"]}


CRASHY = create_react_agent(
    lg.chat_model(),
    TOOLS,
    prompt="You help customers.",
    name="support",
    pre_model_hook=crash_once_after_the_lookup,
)


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def hand_built() -> Any:
    """The same agent as a StateGraph with a ToolNode, written by hand."""
    model = lg.chat_model().bind_tools(TOOLS)

    async def agent(state: State) -> dict[str, Any]:
        return {"messages": [await model.ainvoke(state["messages"])]}

    graph = StateGraph(State)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(TOOLS))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    graph.add_edge("agent", END)
    return graph.compile(name="desk")


HAND = hand_built()


def desk_app(graph: Any, name: str, **limits: Any) -> App:
    async def step(request: Ask, ctx: Context) -> Answer:
        state = await lg.run(ctx, graph, {"messages": [HumanMessage(request.text)]}, **limits)
        messages = state["messages"]
        return Answer(reply=str(messages[-1].content), messages=len(messages))

    return agent_desk(name, f"/v1/{name}", Ask, Answer, step, graph)


@pytest.fixture(autouse=True)
def _forget() -> None:
    LOOKUPS.clear()
    BROKEN.clear()


RELAYS: list[Any] = []


@pytest.fixture
async def mail(tmp_path) -> AsyncIterator[FakeMailServer]:
    async with FakeMailServer(tmp_path / "mailbox.jsonl") as server:
        yield server
        while RELAYS:
            await RELAYS.pop().__aexit__(None, None, None)


async def start(custom, pool, mail: FakeMailServer, app: App) -> tuple[Harness, Relay]:
    harness = await custom(app)
    relaying = relayed(harness, mail, SECRET)
    RELAYS.append(relaying)
    return harness, await relaying.__aenter__()


def model_calls(harness: Harness, job_text: str) -> int:
    """Requests the fake model got whose first user message is ``job_text``."""
    return sum(
        1
        for messages in harness.fake.model.recent
        if next(m["content"] for m in messages if m["role"] == "user") == job_text
    )


async def waiting_job(harness: Harness, name: str, text: str) -> tuple[Any, str]:
    """A job of ``text`` on ``/v1/<name>``, its worker drained once, the
    job then waiting: the worker and the job's id."""
    worker = harness.worker(name)
    job_id = await harness.submit(f"/v1/{name}", {"text": text})
    await drain(worker)
    assert await harness.status(job_id) == "waiting"
    return worker, job_id


async def refunds(mail: FakeMailServer) -> dict[str, int]:
    by_key = (await mail.deliveries())["by_key"]
    return {k: n for k, n in by_key.items() if k.startswith("refund.issue:")}


@pytest.mark.parametrize(("graph", "name"), [(REACT, "support"), (HAND, "desk")])
async def test_lookup_then_refund_then_the_answer_each_once(custom, pool, mail, graph, name):
    harness, relay = await start(custom, pool, mail, desk_app(graph, name))
    text = f"Where is A1? Refund it. {LOOKUP} {REFUND}"
    # The refund call waits for its answer, holding no worker.
    worker, job_id = await waiting_job(harness, name, text)
    await relay.run_once()
    await relay.run_once()
    await drain(worker)

    view = await harness.get(f"/v1/{name}", job_id)
    assert view["status"] == "done", view
    assert model_calls(harness, text) == 3
    assert [f"{job_id}:{name}/lookup_order/tool"] == LOOKUPS
    assert await refunds(mail) == {f"refund.issue:{job_id}:{name}/refund/call": 1}
    assert [(s["key"], s.get("tool")) for s in view["steps"]] == [
        (f"{name}/model", None),
        (f"{name}/lookup_order/tool", "lookup_order"),
        (f"{name}/model#2", None),
        (f"{name}/refund/call", "refund"),
        (f"{name}/model#3", None),
    ]
    # The receiver's answer reached the model, paired with the call's id.
    last = harness.fake.model.recent[-1]
    told = [m for m in last if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in told] == ["call_1", "call_2"]
    assert json.loads(told[0]["content"]) == {"order_id": "A1", "total_cents": 4200}
    assert json.loads(told[1]["content"])["ok"] is True
    assert last[0] == {"role": "system", "content": "You help customers."} or name == "desk"
    assert view["result"]["messages"] == 6


async def test_a_crash_after_the_lookup_pays_no_turn_again_nor_looks_up_again(
    custom, pool, mail
) -> None:
    harness, _ = await start(custom, pool, mail, desk_app(CRASHY, "support"))
    worker = harness.worker("support", redelivery_base_s=0.01, redelivery_max_s=0.01)
    text = f"Where is A1? {uuid.uuid4()} {LOOKUP}"
    job_id = await harness.submit("/v1/support", {"text": text})

    async def done() -> bool:
        return await harness.status(job_id) == "done"

    await redeliver_until(harness, worker, "support", done)
    assert len(BROKEN) == 1
    # Two deliveries; the lookup ran once, each turn was paid for once.
    deliveries = await harness.rows(
        "SELECT outcome FROM job_deliveries WHERE job_id = %s ORDER BY id", job_id
    )
    assert [d[0] for d in deliveries] == ["retry", "done"]
    assert [f"{job_id}:support/lookup_order/tool"] == LOOKUPS
    assert model_calls(harness, text) == 2


async def test_parallel_calls_each_run_once_in_scopes_of_their_own(custom, pool, mail) -> None:
    """One turn calls the lookup and the approval tool together: the job
    waits for the decision, then each call answers once, under its own key.
    A lookup that had not answered when the job began to wait runs again on
    resume (at least once, as with oncely.Agent), under the same key."""
    harness, _ = await start(custom, pool, mail, desk_app(HAND, "desk"))
    text = f"Both. [[fake:tools=parallel]] {LOOKUP} {BIG_REFUND}"
    worker, job_id = await waiting_job(harness, "desk", text)
    assert await decide(harness, "/v1/desk", job_id, {"approved": True}) == "approved"
    await drain(worker)
    view = await harness.get("/v1/desk", job_id)
    assert view["status"] == "done", view
    assert sorted(s["key"] for s in view["steps"]) == [
        "desk/lookup_order/tool",
        "desk/model",
        "desk/model#2",
        "desk/refund_big/approval",
        "desk/refund_big/tool",
    ]
    assert set(LOOKUPS) == {f"{job_id}:desk/lookup_order/tool", "refund_big:A1:9000"}
    assert LOOKUPS.count("refund_big:A1:9000") == 1
    assert model_calls(harness, text) == 2
    told = [m["tool_call_id"] for m in harness.fake.model.recent[-1] if m["role"] == "tool"]
    assert told == ["call_1", "call_2"]


async def decide(harness: Harness, route: str, job_id: str, body: dict[str, Any]) -> str:
    """A person's decision on the call the job waits for, by the API route."""
    view = await harness.get(route, job_id)
    call_id = view["waiting"]["approval"]["call_id"]
    headers = {**harness.auth, "Idempotency-Key": f"decision-{uuid.uuid4()}"}
    r = await harness.api.post(f"{route}/{job_id}/approvals/{call_id}", json=body, headers=headers)
    assert r.status_code == 202, r.text
    return str(r.json()["status"])


@pytest.mark.parametrize(("graph", "name"), [(REACT, "support"), (HAND, "desk")])
async def test_an_approval_tool_waits_for_a_person_then_runs_once(custom, pool, mail, graph, name):
    harness, _ = await start(custom, pool, mail, desk_app(graph, name))
    text = f"Refund A1 in full. {BIG_REFUND}"
    worker, job_id = await waiting_job(harness, name, text)
    view = await harness.get(f"/v1/{name}", job_id)
    assert view["status"] == "waiting"
    assert view["waiting"]["approval"]["tool"] == "refund_big"
    assert view["waiting"]["approval"]["arguments"] == {"order_id": "A1", "cents": 9000}
    assert LOOKUPS == [], "nothing runs before the decision"
    assert await harness.outbox(job_id) == ["approval.requested"]

    assert await decide(harness, f"/v1/{name}", job_id, {"approved": True}) == "approved"
    await drain(worker)
    view = await harness.get(f"/v1/{name}", job_id)
    assert view["status"] == "done", view
    assert LOOKUPS == ["refund_big:A1:9000"]
    assert model_calls(harness, text) == 2
    assert [s["key"] for s in view["steps"]] == [
        f"{name}/model",
        f"{name}/refund_big/approval",
        f"{name}/refund_big/tool",
        f"{name}/model#2",
    ]
    told = [m for m in harness.fake.model.recent[-1] if m["role"] == "tool"]
    assert told[0]["content"] == "refunded 9000 on A1"


async def test_edits_that_fail_the_tools_schema_are_refused_422(custom, pool, mail) -> None:
    harness, _ = await start(custom, pool, mail, desk_app(REACT, "support"))
    worker = harness.worker("support")
    job_id = await harness.submit("/v1/support", {"text": f"Refund A1 in full. {BIG_REFUND}"})
    await drain(worker)
    call_id = (await harness.get("/v1/support", job_id))["waiting"]["approval"]["call_id"]
    headers = {**harness.auth, "Idempotency-Key": f"decision-{uuid.uuid4()}"}
    body = {"approved": True, "arguments": {"order_id": "A1", "cents": "a lot"}}
    r = await harness.api.post(
        f"/v1/support/{job_id}/approvals/{call_id}", json=body, headers=headers
    )
    assert r.status_code == 422, r.text
    assert r.json()["errors"][0]["loc"] == ["body", "arguments", "cents"]
    assert (await harness.get("/v1/support", job_id))["status"] == "waiting"
    assert LOOKUPS == []


async def test_a_rejected_tool_never_runs_and_the_model_hears_why(custom, pool, mail) -> None:
    harness, _ = await start(custom, pool, mail, desk_app(REACT, "support"))
    worker = harness.worker("support")
    text = f"Refund A1 in full. {BIG_REFUND}"
    job_id = await harness.submit("/v1/support", {"text": text})
    await drain(worker)
    body = {"approved": False, "reason": "over the limit"}
    assert await decide(harness, "/v1/support", job_id, body) == "rejected"
    await drain(worker)
    assert (await harness.get("/v1/support", job_id))["status"] == "done"
    assert LOOKUPS == []
    told = [m for m in harness.fake.model.recent[-1] if m["role"] == "tool"]
    assert json.loads(told[0]["content"]) == {"rejected": True, "reason": "over the limit"}
    assert model_calls(harness, text) == 2


@pytest.mark.parametrize(
    ("graph", "name", "limits", "reason"),
    [
        (REACT, "support", {"max_turns": 1}, "max_turns"),
        # LangGraph's own limit (create_react_agent ends politely before it).
        (HAND, "desk", {"config": {"recursion_limit": 2}}, "recursion_limit"),
    ],
)
async def test_a_run_past_a_limit_is_dead_with_its_reason(
    custom, pool, mail, graph, name, limits, reason
):
    harness, _ = await start(custom, pool, mail, desk_app(graph, name, **limits))
    text = f"Loop. {LOOKUP} {LOOKUP}"
    job_id = await harness.submit(f"/v1/{name}", {"text": text})
    await drain(harness.worker(name))
    view = await harness.get(f"/v1/{name}", job_id)
    assert (view["status"], view["error"]) == ("dead", f"agent-limit: {reason}")
    [(error,)] = await harness.rows("SELECT error FROM jobs WHERE job_id = %s", job_id)
    assert error.startswith("agent-limit: ") and f"{reason} (1 turns" in error
    assert model_calls(harness, text) == 1


class Review(BaseModel):
    approved: bool
    by: str


def reviewed_graph() -> Any:
    """A model node, then a node that asks a person with interrupt()."""
    model = lg.chat_model()
    REVIEWS.clear()

    async def draft(state: State) -> dict[str, Any]:
        return {"messages": [await model.ainvoke(state["messages"])]}

    def review(state: State) -> dict[str, Any]:
        REVIEWS.append("asked")
        answer = interrupt({"draft": state["messages"][-1].content})
        REVIEWS.append(f"answered by {answer['by']}")
        return {"messages": [HumanMessage(f"approved={answer['approved']} by {answer['by']}")]}

    graph = StateGraph(State)
    graph.add_node("draft", draft)
    graph.add_node("review", review)
    graph.add_edge(START, "draft")
    graph.add_edge("draft", "review")
    graph.add_edge("review", END)
    return graph.compile(name="reviewed")


REVIEWS: list[str] = []


async def test_interrupt_waits_for_the_event_a_person_sends_then_resumes(custom) -> None:
    graph = reviewed_graph()

    async def step(request: Ask, ctx: Context) -> Answer:
        state = await lg.run(
            ctx, graph, {"messages": [HumanMessage(request.text)]}, interrupts="review"
        )
        messages = state["messages"]
        return Answer(reply=str(messages[-1].content), messages=len(messages))

    workflow = Workflow(
        name="reviewed",
        route="/v1/reviewed",
        request=Ask,
        result=Answer,
        step=step,
        events={"review": Review},
        agents=[graph],
    )
    harness = await custom(App([workflow]))
    worker = harness.worker("reviewed")
    text = f"Draft a reply. {uuid.uuid4()}"
    job_id = await harness.submit("/v1/reviewed", {"text": text})
    await drain(worker)
    view = await harness.get("/v1/reviewed", job_id)
    assert (view["status"], view["waiting"]["event"]) == ("waiting", "review")
    assert [s["key"] for s in view["steps"]] == ["reviewed/model", "reviewed/interrupt/review"]

    sent = await harness.send_event(
        "/v1/reviewed", job_id, "review", {"approved": True, "by": "ada"}
    )
    assert sent.status_code == 202, sent.text
    await drain(worker)
    view = await harness.get("/v1/reviewed", job_id)
    assert view["status"] == "done", view
    assert view["result"] == {"reply": "approved=True by ada", "messages": 3}
    # The draft was paid for once; the review node ran again to its
    # interrupt on the replay, and once more to resume (as LangGraph does).
    assert model_calls(harness, text) == 1
    assert REVIEWS == ["asked", "asked", "asked", "answered by ada"]


# -- without servers (oncely.testing) ------------------------------------------------


class Verdict(BaseModel):
    refund: bool
    cents: int


def one_step(name: str, step: Any, **extra: Any) -> Workflow[Any, Any]:
    return Workflow(name=name, route=f"/v1/{name}", request=Ask, result=Answer, step=step, **extra)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
async def test_structured_output_as_a_response_schema_or_a_forced_tool(method) -> None:
    async def step(request: Ask, ctx: Context) -> Answer:
        model = lg.chat_model().with_structured_output(Verdict, method=method)

        async def judge(state: State) -> dict[str, Any]:
            verdict = await model.ainvoke(state["messages"])
            assert isinstance(verdict, Verdict)
            return {"messages": [HumanMessage(verdict.model_dump_json())]}

        graph = StateGraph(State)
        graph.add_node("judge", judge)
        graph.add_edge(START, "judge")
        state = await lg.run(
            ctx, graph.compile(name="judge"), {"messages": [("user", request.text)]}
        )
        return Answer(reply=str(state["messages"][-1].content), messages=2)

    verdict = {"refund": True, "cents": 1200}
    answer = ToolCalls(("Verdict", verdict)) if method == "function_calling" else verdict
    run = await run_step(one_step("judging", step), {"text": "Refund?"}, answers=[answer])
    assert json.loads(run.result.reply) == verdict
    assert run.steps == ("judge/model",)
    # A response schema, or the schema as the one tool the model must call.
    [call] = run.calls
    assert call.schema == ("Verdict" if method == "json_schema" else None)


async def test_create_react_agent_with_a_response_format() -> None:
    agent = create_react_agent(
        lg.chat_model(), [lg.as_tool(lookup_order)], response_format=Verdict, name="judge"
    )

    async def step(request: Ask, ctx: Context) -> Answer:
        state = await lg.run(ctx, agent, {"messages": [("user", request.text)]})
        return Answer(reply=state["structured_response"].model_dump_json(), messages=0)

    run = await run_step(
        one_step("judging", step),
        {"text": "Refund A1?"},
        answers=[
            ToolCalls(("lookup_order", {"order_id": "A1"})),
            "Yes, in full.",
            {"refund": True, "cents": 4200},
        ],
    )
    assert Verdict.model_validate_json(run.result.reply) == Verdict(refund=True, cents=4200)
    assert run.steps == (
        "judge/model",
        "judge/lookup_order/tool",
        "judge/model#2",
        "judge/model#3",
    )


@oncely.tool
def note(text: str, ctx: oncely.ToolContext) -> dict[str, str]:
    """Write a note on the order."""
    return {"noted": text, "key": ctx.key}


async def test_an_oncely_function_tool_keeps_its_schema_and_its_key() -> None:
    agent = create_react_agent(lg.chat_model(), [lg.as_tool(note)], name="noter")

    async def step(request: Ask, ctx: Context) -> Answer:
        state = await lg.run(ctx, agent, {"messages": [("user", request.text)]})
        told = [m.content for m in state["messages"] if m.type == "tool"]
        return Answer(reply=json.dumps(told), messages=len(state["messages"]))

    run = await run_step(
        one_step("noting", step),
        {"text": "Note it."},
        answers=[ToolCalls(("note", {"words": "x"})), ToolCalls(("note", {"text": "ok"})), "Done."],
        job_id="00000000-0000-0000-0000-000000000001",
    )
    bad, good = [json.loads(m) for m in json.loads(run.result.reply)]
    assert "invalid arguments" in bad["error"], "Tool.invoke told the model, as oncely.Agent does"
    assert good == {"noted": "ok", "key": "00000000-0000-0000-0000-000000000001:noter/note#2/tool"}
    assert run.steps == ("noter/model", "noter/model#2", "noter/note#2/tool", "noter/model#3")


async def test_a_graph_with_a_checkpointer_or_an_unanswered_interrupt_is_refused() -> None:
    from langgraph.checkpoint.memory import InMemorySaver

    graph = StateGraph(State)
    graph.add_node("ask", lambda state: {"messages": [HumanMessage(str(interrupt("ok?")))]})
    graph.add_edge(START, "ask")

    async def saved(request: Ask, ctx: Context) -> Answer:
        await lg.run(ctx, graph.compile(checkpointer=InMemorySaver()), {"messages": []})
        raise AssertionError("ran")

    with pytest.raises(ValueError, match="compiled with a checkpointer"):
        await run_step(one_step("saved", saved), {"text": "x"})

    async def unanswered(request: Ask, ctx: Context) -> Answer:
        await lg.run(ctx, graph.compile(), {"messages": []})
        raise AssertionError("ran")

    with pytest.raises(oncely.PermanentError, match="interrupts="):
        await run_step(one_step("asking", unanswered), {"text": "x"})
