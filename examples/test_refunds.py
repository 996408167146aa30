"""Unit tests of the refunds workflow with oncely.testing: no Redis, no
PostgreSQL, no model; each path of the step, and a crash in the middle."""

from __future__ import annotations

from examples.refunds import Approval, refunds
from oncely.testing import ProviderError, run_step

REFUND = {"order_id": "A-1001", "amount_cents": 1999, "reason": "The mug arrived broken."}


async def test_a_clear_case_is_decided_by_the_model_at_once() -> None:
    run = await run_step(refunds, REFUND, answers=[{"decision": "approve", "note": "damaged"}])
    assert run.result.decision == "approve" and run.result.decided_by == "model"
    assert run.steps == ("model",)
    assert [e.topic for e in run.emitted] == ["refund.decided"]
    assert "A-1001" in run.calls[0].prompt


async def test_an_unclear_case_waits_for_a_person_who_decides() -> None:
    run = await run_step(
        refunds,
        REFUND,
        answers=[{"decision": "escalate", "note": "unclear"}],
        events={"approval": Approval(approved=False, by="ada", note="outside policy")},
    )
    assert (run.result.decision, run.result.decided_by) == ("deny", "person")
    assert run.steps == ("model", "approval")
    assert [e.topic for e in run.emitted] == ["refund.approval_requested", "refund.decided"]


async def test_nobody_answering_in_48_hours_denies_it() -> None:
    run = await run_step(refunds, REFUND, answers=[{"decision": "escalate", "note": "unclear"}])
    assert (run.result.decision, run.result.decided_by) == ("deny", "timeout")


async def test_a_provider_outage_is_retried_and_a_crash_after_the_wait_repeats_nothing() -> None:
    run = await run_step(
        refunds,
        REFUND,
        answers=[ProviderError(503), {"decision": "escalate", "note": "unclear"}],
        events={"approval": Approval(approved=True, by="ada")},
        crash_after="approval",
    )
    assert run.result.decided_by == "person"
    assert run.model_calls == 2  # the failed call and the answer, none on the replay
    assert run.replayed == 2
