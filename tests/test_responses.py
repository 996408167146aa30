"""The ``responses:`` dialect (docs/providers.md) against the fake model over
HTTP: what a call sends and reads, and background calls: the response id
kept as an intent checkpoint before the wait, re-attached to by a run that
finds it (no second create), cancelled at the provider with its job.

The whole adapter suite runs for this dialect too (tests/test_llm_adapter.py),
and real worker processes are killed and cancelled mid-thought in
tests/test_responses_processes.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from pydantic import BaseModel

from oncely.bootstrap import connect_llm, step_config
from oncely.errors import ProviderQuota, Refused, TransientError
from oncely.fakes.llm import FakeLLMServer
from oncely.jobs.handler import WorkflowHandler
from oncely.journal import Checkpoint, Journal, Wait, Writes
from oncely.llm.base import Background, Message, ToolSpec
from oncely.llm.model import Model, ModelRoute
from oncely.llm.openai_responses import OpenAIResponses
from oncely.outbox.wakeup import OutboxWakeUp
from oncely.queue.worker import Worker, WorkerConfig
from oncely.retry import RetryPolicy
from tests.durable import drain
from tests.helpers import delivery_model

MODEL = "gpt-fake"
POLICY = RetryPolicy(per_call_timeout_s=20.0, max_attempts=2, backoff_base_s=0.01)


@pytest.fixture
async def llm(fake_llm: FakeLLMServer) -> AsyncIterator[OpenAIResponses]:
    async with OpenAIResponses.connect(fake_llm.url, "test", MODEL) as adapter:
        yield adapter


class Kept:
    """A journal store that keeps what is written, as PostgreSQL would."""

    def __init__(self) -> None:
        self.checkpoints: list[Checkpoint] = []

    async def write(self, writes: Writes) -> None:
        self.checkpoints += [c.stored() for c in writes.checkpoints]

    async def wait(self, writes: Writes, wait: Wait) -> Checkpoint | None:
        raise AssertionError("no waits here")


def model(llm: OpenAIResponses, journal: Journal, background_s: float = 1.0) -> Model:
    route = ModelRoute(background_s=background_s)
    return delivery_model(llm, MODEL, "responses", POLICY, route, journal=journal)


async def test_a_call_reads_text_usage_and_reasoning_tokens(llm, fake_llm) -> None:
    answer = await llm.complete([Message("user", "Think hard. Then answer.")], 5, reasoning="high")
    assert answer.text == "Think hard. Then answer."
    assert answer.reasoning_tokens == 32 and answer.completion_tokens > 32
    assert fake_llm.stats().dialects == {"responses": 1}
    sent = fake_llm.model.recent[-1]
    assert sent == [{"role": "user", "content": "Think hard. Then answer."}]


async def test_parallel_tool_calls_and_a_streamed_answer(llm) -> None:
    prompt = '[[fake:tool=a {"x": 1}]] [[fake:tool=b]] [[fake:tools=parallel]]'
    tools = [ToolSpec("a", "", {"type": "object"}), ToolSpec("b", "", {"type": "object"})]
    turn = await llm.complete([Message("user", prompt)], 5, tools=tools, tool_choice="auto")
    assert [(c.id, c.name, c.arguments) for c in turn.tool_calls] == [
        ("call_1", "a", '{"x": 1}'),
        ("call_2", "b", "{}"),
    ]
    pieces: list[str] = []
    streamed = await llm.complete([Message("user", "One. Two.")], 5, on_text=pieces.append)
    assert "".join(pieces) == streamed.text == "One. Two."


async def test_structured_output_through_the_model(llm, fake_llm) -> None:
    class Label(BaseModel):
        label: str

    found = await model(llm, Journal()).structured(Label, "Label this.", reasoning="low")
    assert found == Label(label="Label this.")


@pytest.mark.parametrize(
    ("directive", "error"),
    [("refusal", Refused), ("credit", ProviderQuota), ("503", TransientError)],
)
async def test_refusals_dry_accounts_and_outages_translate(llm, directive, error) -> None:
    with pytest.raises(error):
        await llm.complete([Message("user", f"No. [[fake:{directive}]]")], 5)


async def test_a_background_call_keeps_its_id_and_a_rerun_reattaches(llm, fake_llm) -> None:
    store = Kept()
    prompt = "Think a while. [[fake:sleep=0.5]]"
    first = model(llm, Journal((), store))
    assert await first.complete(prompt) == "Think a while."
    intents = [c for c in store.checkpoints if c.kind == "intent"]
    assert [c.key for c in intents] == ["model/response"]
    kept: Any = intents[0].value
    assert kept["model"] == MODEL and kept["id"].startswith("resp_fake_")
    # A run that crashed after the intent: only the intent is stored.
    rerun = model(llm, Journal(intents, Kept()))
    assert await rerun.complete(prompt) == "Think a while."
    stats = fake_llm.stats()
    assert stats.background["created"] == 1
    assert stats.dialects == {"responses": 1}
    assert stats.background["retrieved"] >= 2


async def test_a_streamed_background_call_is_reattached_after_its_last_piece(llm, fake_llm) -> None:
    """Streamed in background mode: the id kept before any text, each piece
    numbered; streamed again from the stored id after the third piece,
    only the rest comes, and nothing is created again."""
    kept: list[str] = []
    pieces: list[str] = []
    numbers: list[int] = []

    async def keep(response_id: str) -> None:
        assert pieces == [], "the id is kept before any text"
        kept.append(response_id)

    asked = [Message("user", "Streamed in the background. Piece by piece, then done.")]
    first = Background(None, keep, seen=numbers.append)
    answer = await llm.complete(asked, 5, on_text=pieces.append, background=first)
    assert "".join(pieces) == answer.text == asked[0].content
    assert len(kept) == 1 and len(numbers) == len(pieces) > 3
    assert numbers == sorted(set(numbers))
    rest: list[str] = []
    again = Background(kept[0], keep, after=numbers[2])
    answer = await llm.complete(asked, 5, on_text=rest.append, background=again)
    assert "".join(pieces[:3]) + "".join(rest) == answer.text
    stats = fake_llm.stats()
    assert (stats.background["created"], stats.dialects) == (1, {"responses": 1})
    assert fake_llm.model.resumed_after == [numbers[2]]
    assert kept == [kept[0]]  # re-attached: nothing new to keep
    sent = fake_llm.model.recent[-1]
    assert sent == [{"role": "user", "content": asked[0].content}]


@pytest.mark.parametrize("cancels", [True, False], ids=["job cancelled", "shutdown"])
async def test_a_streamed_background_call_cancelled_mid_stream(llm, fake_llm, cancels) -> None:
    """Cancelled while its words stream: cancelled at the provider when the
    job was, left running for the next delivery on a shutdown."""
    pieces: list[str] = []

    async def keep(response_id: str) -> None:
        pass

    streaming = Background(None, keep, lambda: cancels)
    asked = [Message("user", "[[fake:typing=0.2]] A long answer that types slowly. It ends.")]
    call = asyncio.create_task(llm.complete(asked, 5, on_text=pieces.append, background=streaming))
    while len(pieces) < 2:
        await asyncio.sleep(0.01)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    stats = fake_llm.stats()
    assert (stats.background["created"], stats.background["cancelled"]) == (1, int(cancels))


async def test_a_streamed_background_response_gone_at_the_provider_is_transient(llm) -> None:
    async def keep(response_id: str) -> None:
        raise AssertionError("nothing to keep")

    gone = Background("resp_fake_gone", keep, after=3)
    with pytest.raises(TransientError, match="not found"):
        await llm.complete([Message("user", "Gone.")], 5, on_text=print, background=gone)


async def test_a_short_timeout_sends_no_background_call(llm, fake_llm) -> None:
    await model(llm, Journal((), Kept()), background_s=0).complete("Quick.")
    assert fake_llm.stats().background["created"] == 0


async def test_a_cancelled_job_cancels_its_background_response(llm, fake_llm) -> None:
    cancelled = False
    m = model(llm, Journal((), Kept()))
    m.cancelled_when(lambda: cancelled)
    call = asyncio.create_task(m.complete("Think forever. [[fake:hang]]"))
    # Polled once: the call holds the response's id (created alone, its
    # answer may still be on its way, and a cancel then has no id to send).
    while fake_llm.stats().background["retrieved"] == 0:
        await asyncio.sleep(0.01)
    cancelled = True
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert fake_llm.stats().background["cancelled"] == 1


@pytest.mark.parametrize("streamed", [False, True], ids=["polled", "streamed"])
@pytest.mark.parametrize("cancels", [True, False], ids=["job cancelled", "shutdown"])
async def test_a_call_cancelled_while_its_create_is_out_keeps_or_cancels_the_response(
    llm, fake_llm, streamed, cancels
) -> None:
    """The provider has the response once the create is out: a call cancelled
    before the create's answer waits for its id, keeps it (a next delivery
    re-attaches, nothing created twice) and, when the job was cancelled,
    cancels it at the provider; never a response running that no one knows."""
    kept: list[str] = []

    async def keep(response_id: str) -> None:
        kept.append(response_id)

    asked = [Message("user", "Think forever. [[fake:late=0.5]] [[fake:hang]]")]
    on_text = print if streamed else None
    out = Background(None, keep, lambda: cancels)
    call = asyncio.create_task(llm.complete(asked, 5, on_text=on_text, background=out))
    while fake_llm.stats().background["created"] == 0:
        await asyncio.sleep(0.01)
    call.cancel()  # the create's answer is half a second away
    with pytest.raises(asyncio.CancelledError):
        await call
    stats = fake_llm.stats()
    assert (stats.background["created"], stats.background["cancelled"]) == (1, int(cancels))
    assert len(kept) == 1 and kept[0].startswith("resp_fake_")
    if not cancels:  # the next delivery re-attaches to it
        again = Background(kept[0], keep, lambda: True)
        rerun = asyncio.create_task(llm.complete(asked, 5, on_text=on_text, background=again))
        while (
            fake_llm.stats().background["retrieved"] + fake_llm.stats().background["streamed"] == 0
        ):
            await asyncio.sleep(0.01)
        rerun.cancel()
        with pytest.raises(asyncio.CancelledError):
            await rerun
        assert fake_llm.stats().background["created"] == 1


async def test_a_cancelled_job_whose_id_cannot_be_kept_still_cancels_its_response(
    llm, fake_llm
) -> None:
    """The job cancelled while the create was out, and its journal refusing
    the write: the response is cancelled at the provider all the same."""

    async def fenced(response_id: str) -> None:
        raise TransientError("the job's lease is gone")

    asked = [Message("user", "Fenced. [[fake:late=0.5]] [[fake:hang]]")]
    out = Background(None, fenced, lambda: True)
    call = asyncio.create_task(llm.complete(asked, 5, background=out))
    while fake_llm.stats().background["created"] == 0:
        await asyncio.sleep(0.01)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert fake_llm.stats().background["cancelled"] == 1


async def test_a_shutdown_leaves_the_background_response_running(llm, fake_llm) -> None:
    call = asyncio.create_task(model(llm, Journal((), Kept())).complete("Long. [[fake:hang]]"))
    while fake_llm.stats().background["created"] == 0:
        await asyncio.sleep(0.01)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert fake_llm.stats().background["cancelled"] == 0


# --- what background mode costs ---------------------------------------------------------


@pytest.mark.parametrize("hold_s", [0, 2], ids=["quick", "thinking 2 s"])
async def test_background_mode_costs_one_statement_and_the_polls_per_call(
    harness, fake_llm, monkeypatch, hold_s
) -> None:
    """The ``chain`` workflow (three model calls, the last one held
    ``hold_s``) run twice through a worker, in background mode and not: per
    call, background mode adds one PostgreSQL statement (the intent that
    keeps the response id) and the provider's polls (GET by id). The numbers
    are docs/providers.md's (Background calls)."""
    statements: list[str] = []
    execute = psycopg.AsyncCursor.execute

    async def counted(cursor: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        statements.append(str(query if isinstance(query, str) else query.as_string(cursor)))
        return await execute(cursor, query, *args, **kwargs)

    settings = harness.settings.model_copy(
        update={"llm_model": MODEL, "llm_provider": "responses", "llm_timeout_s": 10.0,
                "job_budget_s": 30.0}
    )  # fmt: skip
    measured = {}
    async with connect_llm(settings) as llm:  # type: ignore[attr-defined]
        for background_s in (0.0, 1.0):
            handler = WorkflowHandler(
                harness.app["chain"],
                harness.jobs,
                llm,
                step_config(settings),
                OutboxWakeUp(harness.pool),
                checkpoints=harness.checkpoints,
                route=ModelRoute(background_s=background_s),
            )
            worker = Worker(
                harness.jobs.streams["chain"],
                handler,
                WorkerConfig(block_ms=10, claim_idle_ms=60_000),
                workflow="chain",
                on_dead=harness.mark_dead,
                on_failed=harness.jobs.record_deliveries,
            )
            hold = f"[[fake:sleep={hold_s}]]" if hold_s else ""
            body = {"text": f"sku-{background_s} overhead.", "hold": hold}
            job_id = await harness.submit("/v1/chain", body)
            before = fake_llm.stats()
            statements.clear()
            monkeypatch.setattr(psycopg.AsyncCursor, "execute", counted)
            started = time.monotonic()
            await drain(worker)
            took = time.monotonic() - started
            monkeypatch.setattr(psycopg.AsyncCursor, "execute", execute)
            assert await harness.status(job_id) == "done"
            after = fake_llm.stats()
            measured[background_s] = {
                "statements": len(statements),
                "creates": after.dialects["responses"] - before.dialects.get("responses", 0),
                "polls": after.background["retrieved"] - before.background["retrieved"],
                "seconds": round(took, 2),
                "intents": len(await harness.rows(
                    "SELECT 1 FROM checkpoints WHERE job_id = %s AND kind = 'intent'", job_id
                )),
            }  # fmt: skip
    print(f"background overhead, final call held {hold_s} s:", measured)
    plain, background = measured[0.0], measured[1.0]
    assert (plain["creates"], background["creates"]) == (3, 3)
    assert (plain["polls"], plain["intents"], background["intents"]) == (0, 0, 3)
    # One statement more per call: its intent.
    assert background["statements"] - plain["statements"] == 3
    assert background["polls"] >= 3


@pytest.mark.parametrize("streamed", [False, True], ids=["polled", "streamed"])
async def test_a_response_whose_id_cannot_be_kept_is_cancelled_at_the_provider(
    llm, fake_llm, streamed
) -> None:
    """The id kept nowhere (PostgreSQL away, the lease lost): no delivery
    could re-attach to the response, so it is cancelled, not left running
    to be paid for while the retry creates another."""

    async def fenced(response_id: str) -> None:
        raise TransientError("PostgreSQL did not answer")

    asked = [Message("user", "Long. [[fake:hang]]")]
    out = Background(None, fenced, lambda: False)
    with pytest.raises(TransientError):
        await llm.complete(asked, 5, on_text=print if streamed else None, background=out)
    assert fake_llm.stats().background["cancelled"] == 1


@pytest.mark.parametrize("streamed", [False, True], ids=["polled", "streamed"])
async def test_a_second_cancellation_does_not_cut_the_wait_for_the_id_short(
    llm, fake_llm, streamed
) -> None:
    """An attempt's timeout, then the job's cancel (or the drain's): the
    wait for the create's answer goes on, so the id is kept and the
    response cancelled all the same."""
    kept: list[str] = []

    async def keep(response_id: str) -> None:
        kept.append(response_id)

    asked = [Message("user", "Long. [[fake:late=0.5]] [[fake:hang]]")]
    out = Background(None, keep, lambda: True)
    call = asyncio.create_task(
        llm.complete(asked, 5, on_text=print if streamed else None, background=out)
    )
    while fake_llm.stats().background["created"] == 0:
        await asyncio.sleep(0.01)
    call.cancel()
    await asyncio.sleep(0.05)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert len(kept) == 1 and fake_llm.stats().background["cancelled"] == 1
