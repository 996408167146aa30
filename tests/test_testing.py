"""oncely.testing: a step run with a scripted model and no servers, its
retries and fallbacks, waits and sleeps fast-forwarded, and the replay after
a crash that catches a step that is not deterministic."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest
from pydantic import BaseModel

import oncely
from oncely.errors import PermanentError, TransientError
from oncely.testing import ProviderError, ReplayError, run_step


class Ask(BaseModel):
    text: str


class Answer(BaseModel):
    text: str
    extra: Any = None


def workflow(step: Any, **options: Any) -> oncely.Workflow[Ask, Answer]:
    return oncely.Workflow(
        name="unit", route="/v1/unit", request=Ask, result=Answer, step=step, **options
    )


async def echo(request: Ask, ctx: oncely.Context) -> Answer:
    return Answer(text=await ctx.model.complete(request.text))


async def test_a_step_runs_against_scripted_answers_with_no_server() -> None:
    run = await run_step(workflow(echo), {"text": "hello"}, answers=["hi"])
    assert run.result == Answer(text="hi")
    assert (run.steps, run.model_calls) == (("model",), 1)
    assert run.calls[0].prompt == "hello" and run.calls[0].step == "model"


async def test_provider_errors_are_retried_and_fall_back_and_a_400_is_not() -> None:
    run = await run_step(
        workflow(echo),
        {"text": "q"},
        answers=[ProviderError(503), TimeoutError(), "fine"],
    )
    assert (run.result.text, run.model_calls) == ("fine", 3)

    # Four attempts on the primary, then the workflow's fallback.
    fallback = workflow(echo, fallbacks=["backup"])
    run = await run_step(fallback, {"text": "q"}, answers=[ProviderError(429)] * 4 + ["saved"])
    assert run.result.text == "saved"
    assert [c.model for c in run.calls] == ["test-model"] * 4 + ["backup"]
    assert run.usage["model"] == "backup"

    with pytest.raises(PermanentError):
        await run_step(fallback, {"text": "q"}, answers=[ProviderError(400), "never"])
    with pytest.raises(TransientError):
        await run_step(workflow(echo), {"text": "q"}, answers=[ProviderError(503)] * 4)


async def test_structured_answers_and_re_asks() -> None:
    class Verdict(BaseModel):
        label: str

    async def classify(request: Ask, ctx: oncely.Context) -> Answer:
        verdict = await ctx.model.structured(Verdict, request.text)
        return Answer(text=verdict.label)

    run = await run_step(
        workflow(classify), {"text": "q"}, answers=[{"wrong": 1}, Verdict(label="bug")]
    )
    assert run.result.text == "bug" and run.model_calls == 2
    assert run.calls[0].schema == "Verdict"


async def test_too_few_answers_fail_the_test_with_a_clear_message() -> None:
    with pytest.raises(AssertionError, match="model call 1 but only 0 answers"):
        await run_step(workflow(echo), {"text": "q"})


async def test_waits_get_the_event_given_or_time_out_and_sleeps_take_no_time() -> None:
    class Approval(BaseModel):
        ok: bool

    async def approve(request: Ask, ctx: oncely.Context) -> Answer:
        await ctx.sleep(3600)
        approval = await ctx.wait_for_event("approval", Approval, timeout=86400)
        ctx.emit("unit.decided", {"ok": approval is not None and approval.ok})
        return Answer(text="yes" if approval and approval.ok else "no")

    flow = workflow(
        approve, events={"approval": Approval}, effects=[oncely.webhook("unit.decided")]
    )
    # An hour's sleep and a day's wait: a run that waited would meet the test's timeout.
    run = await run_step(flow, {"text": "q"}, events={"approval": Approval(ok=True)})
    assert run.result.text == "yes"
    assert run.steps == ("sleep", "approval")
    assert [(e.topic, e.payload) for e in run.emitted] == [("unit.decided", {"ok": True})]
    assert (await run_step(flow, {"text": "q"})).result.text == "no"


async def test_a_crash_after_a_checkpoint_replays_it_without_paying_again() -> None:
    side_calls: list[str] = []

    def lookup(text: str) -> dict[str, str]:
        side_calls.append(text)
        return {"found": text.upper()}

    async def two_steps(request: Ask, ctx: oncely.Context) -> Answer:
        draft = await ctx.model.complete(request.text)
        found = await ctx.step("lookup", lookup, draft)
        ctx.emit("unit.done", {"found": found["found"]})
        final = await ctx.model.complete(f"{draft} {found['found']}")
        return Answer(text=final)

    flow = workflow(two_steps, effects=[oncely.webhook("unit.done")])
    for key in ("model", "lookup", "model#2"):
        side_calls.clear()
        run = await run_step(flow, {"text": "q"}, answers=["draft", "final"], crash_after=key)
        assert run.result.text == "final"
        assert run.steps == ("model", "lookup", "model#2")
        # Each call and the side step once in all: the replay got them stored.
        assert run.model_calls == 2, key
        assert side_calls == ["draft"], key
        assert run.replayed >= 1


async def test_a_step_that_is_not_deterministic_fails_its_replay() -> None:
    async def coin(request: Ask, ctx: oncely.Context) -> Answer:
        # A key made of something other than the request and stored values.
        first = await ctx.model.complete(request.text, step=f"ask-{uuid.uuid4().hex[:8]}")
        return Answer(text=await ctx.model.complete(first))

    with pytest.raises(ReplayError, match="another key"):
        await run_step(workflow(coin), {"text": "q"}, answers=["a", "b"], crash_after="model")


async def test_a_call_asked_with_another_payload_on_replay_says_so() -> None:
    async def quote(request: Ask, ctx: oncely.Context) -> Answer:
        # The payload carries the clock: the replay sends another question.
        answer = await ctx.call("quote.request", {"text": request.text, "at": time.time_ns()})
        return Answer(text=str(answer))

    flow = workflow(quote, effects=[oncely.webhook("quote.request", returns=True)])
    with pytest.raises(ReplayError, match="another payload for the same call"):
        await run_step(
            flow, {"text": "q"}, calls={"quote.request": {"ok": True}}, crash_after="quote.request"
        )


async def test_an_emit_that_changes_on_replay_fails_it() -> None:
    async def stamped(request: Ask, ctx: oncely.Context) -> Answer:
        ctx.emit("unit.done", {"at": time.time_ns()})
        answer = await ctx.model.complete(request.text)
        return Answer(text=await ctx.model.complete(answer))

    flow = workflow(stamped, effects=[oncely.webhook("unit.done")])
    with pytest.raises(ReplayError, match="emitted"):
        await run_step(flow, {"text": "q"}, answers=["a", "b"], crash_after="model")


async def test_crashing_after_a_key_the_step_never_reaches_says_which_it_reached() -> None:
    with pytest.raises(
        ReplayError, match=r"never reached checkpoint 'lookup'; it reached 'model'$"
    ):
        await run_step(workflow(echo), {"text": "q"}, answers=["a"], crash_after="lookup")


async def test_a_key_in_a_branch_is_named_with_its_scope_and_only_a_few_keys_are_listed() -> None:
    async def many(request: Ask, ctx: oncely.Context) -> Answer:
        async def item(i: int) -> str:
            return await ctx.step(f"item-{i}", lambda: f"done {i}")

        done = await asyncio.gather(*(item(i) for i in range(600)))
        return Answer(text=done[-1])

    with pytest.raises(ReplayError) as raised:
        await run_step(workflow(many), {"text": "q"}, crash_after="item-500")
    message = str(raised.value)
    assert message.startswith(
        "the step never reached checkpoint 'item-500'; it reached '[1]/item-0',"
    )
    assert "and 595 more; did you mean '[501]/item-500'?" in message
    assert len(message) < 300
    # The scoped key it suggests is one a crash can come after.
    run = await run_step(workflow(many), {"text": "q"}, crash_after="[501]/item-500")
    assert run.result.text == "done 599"


async def test_current_context_is_the_running_steps_own_and_unknown_outside() -> None:
    """Code a step calls without handing it ``ctx`` finds it."""
    seen: list[str] = []

    def deep_inside() -> str:
        return oncely.current_context().job_id

    async def step(request: Ask, ctx: oncely.Context) -> Answer:
        seen.append(deep_inside())
        return Answer(text=ctx.job_id)

    run = await run_step(workflow(step), {"text": "x"})
    assert seen == [run.result.text]
    with pytest.raises(RuntimeError, match="only known while a step runs"):
        oncely.current_context()
