"""At most once (docs/at-most-once.md), through ``oncely.testing``: an
effect's intent stored before it runs; a crash between the intent and the
result never sends it again on its own; reconcile or a person decides."""

from __future__ import annotations

from typing import Any

import pytest

import oncely
from oncely.errors import NotSent, PermanentError
from oncely.testing import ToolCalls, run_step
from tests.durable import drain, redeliver_until
from tests.test_testing import Answer, Ask, workflow


class Bank:
    """A payment API that does not dedupe: every call is a transfer."""

    def __init__(self, *, fail: BaseException | None = None) -> None:
        self.sent: list[tuple[int, str | None]] = []
        self.fail = fail

    def transfer(self, cents: int) -> dict[str, Any]:
        self.sent.append((cents, oncely.tool_key()))
        if self.fail is not None:
            raise self.fail
        return {"transfer": len(self.sent), "cents": cents}


def paying(bank: Bank, **options: Any) -> Any:
    async def step(request: Ask, ctx: oncely.Context) -> Answer:
        paid = await ctx.step("pay", bank.transfer, 500, at_most_once=True, **options)
        return Answer(text="paid", extra=paid)

    return step


async def test_an_uncrashed_call_runs_once_with_its_intent_stored_first() -> None:
    bank = Bank()
    run = await run_step(workflow(paying(bank)), {"text": "x"})
    assert run.result.extra == {"transfer": 1, "cents": 500}
    assert run.steps == ("pay", "pay/intent")
    [(cents, key)] = bank.sent
    assert cents == 500 and key is not None and key.endswith(":pay")


@pytest.mark.parametrize(
    ("decision", "sent", "result"),
    [
        ({"result": {"transfer": 1, "cents": 500}}, 1, {"transfer": 1, "cents": 500}),
        ("resend", 2, {"transfer": 2, "cents": 500}),
    ],
)
async def test_a_crash_mid_call_asks_a_person_and_never_resends_on_its_own(
    decision: Any, sent: int, result: Any
) -> None:
    bank = Bank()
    run = await run_step(
        workflow(paying(bank)),
        {"text": "x"},
        crash_after="pay/intent",
        uncertain={"pay": decision},
    )
    # The call ran once before the crash; the person's word decides the rest.
    assert len(bank.sent) == sent
    assert run.result.extra == result
    assert "pay/uncertain" in run.steps
    assert len({key for _, key in bank.sent}) == 1, "one stable key across attempts"


async def test_failed_tells_the_step_and_sends_nothing_more() -> None:
    bank = Bank()

    async def step(request: Ask, ctx: oncely.Context) -> Answer:
        try:
            await ctx.step("pay", bank.transfer, 500, at_most_once=True)
        except PermanentError as exc:
            return Answer(text=str(exc))
        return Answer(text="paid")

    run = await run_step(
        workflow(step),
        {"text": "x"},
        crash_after="pay/intent",
        uncertain={"pay": {"failed": "the bank says no such transfer"}},
    )
    assert run.result.text == "pay: the bank says no such transfer"
    assert len(bank.sent) == 1


async def test_without_a_scripted_decision_the_test_says_what_is_missing() -> None:
    with pytest.raises(AssertionError, match="no decision was scripted in uncertain="):
        await run_step(workflow(paying(Bank())), {"text": "x"}, crash_after="pay/intent")


async def test_reconcile_decides_without_a_person() -> None:
    bank = Bank()
    asked: list[tuple[Any, str]] = []

    def found(arguments: Any, key: str) -> Any:
        asked.append((arguments, key))
        return {"transfer": "found", "cents": arguments["cents"]}

    run = await run_step(
        workflow(paying(bank, reconcile=found)), {"text": "x"}, crash_after="pay/intent"
    )
    assert run.result.extra == {"transfer": "found", "cents": 500}
    assert len(bank.sent) == 1
    [(arguments, key)] = asked
    assert arguments == {"cents": 500} and key == bank.sent[0][1]
    assert "pay/reconcile" in run.steps and "pay/uncertain" not in run.steps

    # NOT_DONE: the call did not happen, so it runs again, once.
    bank = Bank()
    run = await run_step(
        workflow(paying(bank, reconcile=lambda a, k: oncely.NOT_DONE)),
        {"text": "x"},
        crash_after="pay/intent",
    )
    assert len(bank.sent) == 2 and run.result.extra == {"transfer": 2, "cents": 500}
    assert run.steps.count("pay/intent") == 1 and "pay/intent#2" in run.steps


async def test_a_reconcile_that_cannot_tell_leaves_it_to_a_person() -> None:
    def broken(arguments: Any, key: str) -> Any:
        raise PermanentError("the bank's search is down")

    run = await run_step(
        workflow(paying(Bank(), reconcile=broken)),
        {"text": "x"},
        crash_after="pay/intent",
        uncertain={"pay": {"result": {"transfer": "by hand"}}},
    )
    assert run.result.extra == {"transfer": "by hand"}


async def test_a_failure_other_than_permanent_leaves_the_outcome_unknown() -> None:
    """A timeout may have sent it: not retried, asked about at once."""
    bank = Bank(fail=TimeoutError("read timed out"))
    run = await run_step(
        workflow(paying(bank)), {"text": "x"}, uncertain={"pay": {"result": {"ok": True}}}
    )
    assert len(bank.sent) == 1 and run.result.extra == {"ok": True}

    bank = Bank(fail=PermanentError("card declined"))
    with pytest.raises(PermanentError, match="card declined"):
        await run_step(workflow(paying(bank)), {"text": "x"})
    assert len(bank.sent) == 1


async def test_an_agents_at_most_once_tool() -> None:
    bank = Bank()

    @oncely.tool(at_most_once=True)
    def refund(cents: int) -> dict[str, Any]:
        """Refund the customer."""
        return bank.transfer(cents)

    agent = oncely.Agent(name="support", instructions="help", tools=[refund])

    async def step(request: Ask, ctx: oncely.Context) -> Answer:
        run = await agent.run(ctx, request.text)
        return Answer(text=run.output)

    answers = [ToolCalls(("refund", {"cents": 700})), "refunded"]
    run = await run_step(
        workflow(step, agents=[agent]),
        {"text": "refund me"},
        answers=answers,
        crash_after="support/refund/tool/intent",
        uncertain={"refund": "resend"},
    )
    assert run.result.text == "refunded"
    assert [c for c, _ in bank.sent] == [700, 700], "sent, crashed, resent by a person's word"
    assert "support/refund/tool/uncertain" in run.steps


def test_reconcile_without_at_most_once_is_refused() -> None:
    with pytest.raises(ValueError, match="at_most_once"):

        @oncely.tool(reconcile=lambda a, k: None)
        def refund(cents: int) -> None:
            """Refund."""


# -- through a real worker (Redis, PostgreSQL) ---------------------------------------


async def test_a_call_that_surely_never_left_is_sent_again_later_nobody_asked(custom) -> None:
    """Its server refused the connection (NotSent): known not done, so the
    job is retried like an outage and the transfer sent on a later delivery,
    once; no person asked."""
    bank = Bank(fail=NotSent("the bank refused the connection"))

    async def step(request: Ask, ctx: oncely.Context) -> Answer:
        # The bank raises NotSent while it is away.
        paid = await ctx.step("pay", bank.transfer, 500, at_most_once=True)
        return Answer(text="paid", extra=paid)

    harness = await custom(oncely.App([workflow(step)]))
    job_id = await harness.submit("/v1/unit", {"text": "x"})
    worker = harness.worker("unit", redelivery_base_s=0.01, redelivery_max_s=0.05)
    await drain(worker)
    assert await harness.status(job_id) == "queued", "retried later, not waiting for a person"
    bank.fail = None

    async def done() -> bool:
        return await harness.status(job_id) == "done"

    await redeliver_until(harness, worker, "unit", done)
    view = await harness.get("/v1/unit", job_id)
    assert view["result"]["extra"] == {"transfer": 2, "cents": 500}
    assert len(bank.sent) == 2, "the refused attempt, then the one that went"
    assert sorted(s["key"] for s in view["steps"]) == [
        "pay", "pay/intent", "pay/intent#2", "pay/reconcile"
    ]  # fmt: skip
