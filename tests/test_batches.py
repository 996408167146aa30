"""The batch lane (docs/lanes.md), one process: a call's line stored
before its batch exists, gathered, created at the fake model's Batches API
over HTTP with its oncely id in the metadata, recorded, answered, and the
answer the call's, on lane ``batch`` in the ledger (real PostgreSQL). A
batch gathered but not recorded (a crash before or after its creation) is
adopted or created once; failed lines are classified; an expired batch's
lines go once more; a cancelled job's line is never sent. The same for
Anthropic's Message Batches, whose batches keep no metadata: one created
but not recorded is adopted by its size and time, and a foreign batch of
the same size adopted by mistake costs a batch, never a wrong answer. The
process tests are tests/test_lanes_processes.py."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from pydantic import BaseModel

from oncely.errors import PermanentError, ProviderQuota, ResumeLater
from oncely.fakes.llm import FakeLLMServer
from oncely.llm.anthropic_batches import AnthropicBatches
from oncely.llm.anthropic_batches import outcomes as anthropic_outcomes
from oncely.llm.anthropic_messages import AnthropicMessages
from oncely.llm.batches import Batcher, BatchLines, OpenAIBatches, Unrecorded
from oncely.llm.lines import line_id
from oncely.llm.model import Model, ModelRoute
from oncely.llm.openai_compat import OpenAICompatible
from oncely.llm.openai_responses import OpenAIResponses
from oncely.retry import Deadline, RetryPolicy
from oncely.usage.budgets import BudgetLimits, Budgets
from oncely.usage.calls import CallSite
from oncely.usage.ledger import Ledger
from oncely.usage.prices import Prices
from tests.processes import oncely

MODEL = "gpt-fake"
CLAUDE = "claude-fake"
FAST = RetryPolicy(per_call_timeout_s=2.0, max_attempts=2, backoff_base_s=0.001)
M = 1_000_000


@pytest.fixture
async def fake() -> AsyncIterator[FakeLLMServer]:
    async with FakeLLMServer(batch_delay_s=0.05) as server:
        yield server


@pytest.fixture
async def chat(fake: FakeLLMServer) -> AsyncIterator[OpenAICompatible]:
    async with OpenAICompatible.connect(fake.url, "test", MODEL) as adapter:
        yield adapter


@pytest.fixture
async def claude(fake: FakeLLMServer) -> AsyncIterator[AnthropicMessages]:
    async with AnthropicMessages.connect(fake.url, "test", CLAUDE) as adapter:
        yield adapter


@pytest.fixture
def lines(pool: Any) -> BatchLines:
    return BatchLines(pool, poll_s=0.05)


@pytest.fixture
async def api(fake: FakeLLMServer) -> AsyncIterator[OpenAIBatches]:
    api = OpenAIBatches.connect(fake.url, "test")
    yield api
    await api.aclose()


@pytest.fixture
async def claude_api(fake: FakeLLMServer) -> AsyncIterator[AnthropicBatches]:
    api = AnthropicBatches.connect(fake.url, "test")
    yield api
    await api.aclose()


def batcher(lines: BatchLines, api: Any, **kw: Any) -> Batcher:
    dialect = "anthropic" if isinstance(api, AnthropicBatches) else "chat"
    return Batcher(lines, {dialect: api}, gather_s=0, **{"lease_s": 60.0, **kw})


def delivery(chat: Any, lines: BatchLines, job_id: str, ledger: Ledger | None = None) -> Model:
    """A delivery's model for ``job_id`` on the batch lane."""
    return Model(
        chat,
        policy=FAST,
        deadline=Deadline.after(30),
        workflow="lanes",
        model_name=chat.model,
        route=ModelRoute(ledger=ledger, lane="batch", batches=lines),
        site=CallSite("lanes", job_id, "acme"),
    )


async def statuses(pool: Any) -> dict[str, str]:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT custom_id, status FROM batch_lines")
        return dict(await cur.fetchall())


async def until(check: Callable[[], Any], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def settle(b: Batcher, pool: Any, custom_ids: list[str]) -> None:
    """Ticks until every line named has an answer or failed."""

    async def ended() -> bool:
        await b.tick()
        now = await statuses(pool)
        return all(now.get(c) in ("answered", "failed") for c in custom_ids)

    await until(ended, f"lines {custom_ids} to end")


async def ask(model: Model, prompt: str) -> str:
    return await model.complete(prompt, step="triage")


async def waits(model: Model, prompt: str) -> None:
    """The call's line stored (or still out): the call is to resume later."""
    with pytest.raises(ResumeLater):
        await ask(model, prompt)


async def test_a_batch_call_is_stored_gathered_created_once_and_answered_as_the_calls_answer(
    chat, api, lines, fake, pool
) -> None:
    ledger = Ledger(pool, prices=Prices.parse(f"{MODEL}=2/8"))
    jobs = [str(uuid.uuid4()) for _ in range(3)]
    for job in jobs:
        await waits(delivery(chat, lines, job), f"Ticket {job}. Classify it.")
    custom_ids = [line_id(job, "triage", "chat") for job in jobs]
    assert await statuses(pool) == dict.fromkeys(custom_ids, "waiting")
    assert fake.batches.stats()["created"] == 0  # nothing sent yet

    # A look before the batch is done still waits, and stores nothing twice.
    await waits(delivery(chat, lines, jobs[0]), f"Ticket {jobs[0]}. Classify it.")

    await settle(batcher(lines, api), pool, custom_ids)
    stats = fake.batches.stats()
    assert stats["created"] == 1 and stats["lines"] == dict.fromkeys(custom_ids, 1)
    assert fake.stats().total == 3  # each line answered once, no call of its own

    for job in jobs:
        text = await ask(delivery(chat, lines, job, ledger), f"Ticket {job}. Classify it.")
        assert text.startswith(f"Ticket {job}.")
    assert await ledger.flush() == 3
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT lane, dialect, outcome, prompt_tokens, completion_tokens, cost_usd::float8"
            " FROM model_calls"
        )
        rows = await cur.fetchall()
    assert {(r[0], r[1], r[2]) for r in rows} == {("batch", "chat", "ok")}
    for *_, prompt, completion, cost in rows:
        assert cost == pytest.approx((prompt * 1 + completion * 4) / M)  # half price


async def test_the_batch_carries_its_oncely_id_in_its_metadata(chat, api, lines, fake, pool):
    job = str(uuid.uuid4())
    await waits(delivery(chat, lines, job), "Metadata, please.")
    await settle(batcher(lines, api), pool, [line_id(job, "triage", "chat")])
    [row] = await lines.batches()
    assert (row.lines, row.answered, row.failed, row.waiting) == (1, 1, 0, 0)
    lost = Unrecorded(row.batch_id, "chat", [], row.created_at)
    assert await api.find(lost) == [row.provider_id]


def test_a_lines_custom_id_is_job_and_key_or_what_anthropic_takes() -> None:
    """``<job_id>:<key>`` where the provider takes it (OpenAI's batches);
    for Anthropic's ``[a-zA-Z0-9_-]{1,64}``, from the job and the key alone."""
    job = str(uuid.uuid4())
    keys = ("triage", "triage#2", "a key: with/odd chars ✓" * 9)
    assert [line_id(job, key, "chat") for key in keys] == [f"{job}:{key}" for key in keys]
    ids = {line_id(job, key, "anthropic") for key in keys}
    assert len(ids) == 3
    assert all(re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", i) for i in ids)
    # A redelivery's is the same.
    assert line_id(job, "triage", "anthropic") == line_id(job, "triage", "anthropic")


class Crash(Exception):
    """A process killed at that point (the process tests kill it for real)."""


async def crash(lines: BatchLines, api: Any, monkeypatch: Any, at: str) -> None:
    """A batcher killed at ``at`` (``submit`` or ``record``) while it gathers."""

    async def dies(*args: Any) -> None:
        raise Crash

    dying = batcher(lines, api, lease_s=0.2)
    monkeypatch.setattr(dying, at, dies)
    with pytest.raises(Crash):
        await dying.gather()


@pytest.mark.parametrize("dies_at", ["submit", "record"])
async def test_a_batch_lost_by_a_crash_is_created_once_or_adopted_never_created_again(
    chat, api, lines, fake, pool, monkeypatch, dies_at: str
) -> None:
    """Killed before creating the batch (``submit``): its line stays
    gathered and the recovery creates the batch. Killed after (``record``):
    the recovery adopts it, never creating it again."""
    job = str(uuid.uuid4())
    custom_id = line_id(job, "triage", "chat")
    prompt = f"Lost at {dies_at}."
    await waits(delivery(chat, lines, job), prompt)
    await crash(lines, api, monkeypatch, dies_at)
    if dies_at == "submit":
        assert await statuses(pool) == {custom_id: "gathered"}
    assert fake.batches.stats()["created"] == (1 if dies_at == "record" else 0)
    await settle(batcher(lines, api, lease_s=0.2), pool, [custom_id])
    stats = fake.batches.stats()
    assert stats["created"] == 1 and stats["lines"] == {custom_id: 1}
    assert await ask(delivery(chat, lines, job), prompt)


async def test_a_line_that_failed_permanently_fails_the_call(chat, api, lines, fake, pool):
    job = str(uuid.uuid4())
    prompt = "A bad request. [[fake:400]]"
    await waits(delivery(chat, lines, job), prompt)
    await settle(batcher(lines, api), pool, [line_id(job, "triage", "chat")])
    with pytest.raises(PermanentError, match="400"):
        await ask(delivery(chat, lines, job), prompt)
    assert fake.batches.stats()["lines"] == {line_id(job, "triage", "chat"): 1}


async def test_a_line_that_failed_transiently_goes_in_the_next_batch(chat, api, lines, fake, pool):
    job = str(uuid.uuid4())
    custom_id = line_id(job, "triage", "chat")
    prompt = "A server error, once. [[fake:503*1]]"
    await waits(delivery(chat, lines, job), prompt)
    b = batcher(lines, api)
    await settle(b, pool, [custom_id])
    with pytest.raises(ResumeLater):  # back in line
        await ask(delivery(chat, lines, job), prompt)
    assert await statuses(pool) == {custom_id: "waiting"}
    await settle(b, pool, [custom_id])
    assert await ask(delivery(chat, lines, job), prompt)
    stats = fake.batches.stats()
    assert stats["created"] == 2 and stats["lines"] == {custom_id: 2}


async def test_an_expired_batchs_lines_go_once_more_then_fail(chat, api, lines, fake, pool):
    once, always = str(uuid.uuid4()), str(uuid.uuid4())
    prompts = {once: "Expires once. [[fake:expire*1]]", always: "Expires always. [[fake:expire]]"}
    for job, prompt in prompts.items():
        await waits(delivery(chat, lines, job), prompt)
    b = batcher(lines, api)
    ids = [line_id(once, "triage", "chat"), line_id(always, "triage", "chat")]
    await settle(b, pool, ids)
    assert fake.batches.stats()["lines"] == dict.fromkeys(ids, 2)
    assert await statuses(pool) == {ids[0]: "answered", ids[1]: "failed"}
    assert await ask(delivery(chat, lines, once), prompts[once])
    with pytest.raises(PermanentError, match="batch_expired"):
        await ask(delivery(chat, lines, always), prompts[always])


async def test_a_cancelled_jobs_line_is_never_sent(chat, api, lines, fake, pool) -> None:
    cancelled, kept = str(uuid.uuid4()), str(uuid.uuid4())
    for job in (cancelled, kept):
        await waits(delivery(chat, lines, job), f"Job {job}.")
    async with pool.connection() as conn:
        await conn.execute(
            "INSERT INTO jobs (job_id, tenant, kind, payload, status)"
            " VALUES (%s, 'acme', 'lanes', %s, 'cancelled')",
            (cancelled, json.dumps({})),
        )
    await settle(batcher(lines, api), pool, [line_id(kept, "triage", "chat")])
    assert fake.batches.stats()["lines"] == {line_id(kept, "triage", "chat"): 1}
    assert (await statuses(pool))[line_id(cancelled, "triage", "chat")] == "dropped"


async def test_a_structured_calls_reasks_are_lines_of_their_own(chat, api, lines, fake, pool):
    class Verdict(BaseModel):
        label: str

    job = str(uuid.uuid4())
    prompt = "Invalid once. [[fake:badjson*1]]"

    async def structured() -> Verdict:
        return await delivery(chat, lines, job).structured(Verdict, prompt, step="verdict")

    b = batcher(lines, api)
    with pytest.raises(ResumeLater):
        await structured()
    await settle(b, pool, [line_id(job, "verdict", "chat")])
    with pytest.raises(ResumeLater):  # the first answer did not validate: a second ask
        await structured()
    await settle(b, pool, [line_id(job, "verdict#2", "chat")])
    assert isinstance(await structured(), Verdict)
    asks = [line_id(job, "verdict", "chat"), line_id(job, "verdict#2", "chat")]
    assert fake.batches.stats()["lines"] == dict.fromkeys(asks, 1)


async def test_a_call_without_a_job_goes_standard(chat, lines, fake, pool) -> None:
    model = Model(
        chat,
        policy=FAST,
        deadline=Deadline.after(30),
        workflow="lanes",
        model_name=MODEL,
        route=ModelRoute(lane="batch", batches=lines),
    )
    assert await model.complete("A shadow run has no job.")
    assert fake.stats().total == 1 and fake.batches.stats()["created"] == 0


@pytest.mark.slow
async def test_oncely_batches_list_and_show_say_lines_done_failed_and_jobs_waiting(
    chat, api, lines, fake, pool, redis_url, database_url
) -> None:
    done, failed, waiting = (str(uuid.uuid4()) for _ in range(3))
    for job, prompt in ((done, "Fine."), (failed, "Bad. [[fake:400]]")):
        await waits(delivery(chat, lines, job), prompt)
    await settle(
        batcher(lines, api),
        pool,
        [line_id(done, "triage", "chat"), line_id(failed, "triage", "chat")],
    )
    await waits(delivery(chat, lines, waiting), "Still out.")
    await batcher(lines, api).gather()  # out, not answered yet: no poll
    await waits(delivery(chat, lines, str(uuid.uuid4())), "Not gathered yet.")

    env = {"ONCELY_REDIS_URL": redis_url, "ONCELY_DATABASE_URL": database_url, "COLUMNS": "200"}

    def cli(*args: str) -> Any:
        return oncely("batches", *args, env=env)

    listed = await asyncio.to_thread(cli, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    batches = json.loads(listed.stdout)
    shown = [
        (b["status"], b["lines"], b["answered"], b["failed"], b["jobs_waiting"]) for b in batches
    ]
    assert shown == [
        ("out", 1, 0, 0, 1),  # newest first
        ("ended", 2, 1, 1, 0),
    ]
    shown = await asyncio.to_thread(cli, "show", batches[1]["batch_id"])
    assert shown.returncode == 0, shown.stderr
    assert batches[1]["provider_id"] in shown.stdout and "gpt-fake" in shown.stdout
    # Its jobs named.
    assert done in shown.stdout and line_id(done, "triage", "chat") in shown.stdout
    as_json = await asyncio.to_thread(cli, "show", batches[1]["batch_id"], "--json")
    named = {(x["job_id"], x["key"], x["status"]) for x in json.loads(as_json.stdout)["lines"]}
    assert named == {(done, "triage", "answered"), (failed, "triage", "failed")}
    missing = await asyncio.to_thread(cli, "show", str(uuid.uuid4()))
    assert missing.returncode == 3 and "no batch" in missing.stderr
    assert (await asyncio.to_thread(cli, "show", "nope")).returncode == 2


async def test_a_responses_call_goes_in_a_batch_of_the_responses_endpoint(
    api, lines, fake, pool
) -> None:
    class Verdict(BaseModel):
        label: str

    job = str(uuid.uuid4())
    async with OpenAIResponses.connect(fake.url, "test", MODEL) as responses:

        def model() -> Model:
            return delivery(responses, lines, job)  # type: ignore[arg-type]

        with pytest.raises(ResumeLater):
            await model().structured(Verdict, "Responses in a batch.", step="triage")
        b = Batcher(lines, {"responses": api.for_dialect("responses")}, gather_s=0)
        await settle(b, pool, [line_id(job, "triage", "chat")])
        assert isinstance(
            await model().structured(Verdict, "Responses in a batch.", step="triage"), Verdict
        )
    assert fake.stats().dialects == {"responses": 1}
    assert fake.batches.stats()["lines"] == {line_id(job, "triage", "chat"): 1}


async def test_settled_lines_past_their_keep_go_once_their_job_ended(
    chat, api, lines, fake, pool
) -> None:
    ended, running = str(uuid.uuid4()), str(uuid.uuid4())
    for job in (ended, running):
        await waits(delivery(chat, lines, job), f"Job {job}.")
    await settle(
        batcher(lines, api),
        pool,
        [line_id(ended, "triage", "chat"), line_id(running, "triage", "chat")],
    )
    b = batcher(lines, api, keep_s=0.0)
    async with pool.connection() as conn:
        for job, status in ((ended, "done"), (running, "queued")):
            await conn.execute(
                "INSERT INTO jobs (job_id, tenant, kind, payload, status)"
                " VALUES (%s, 'acme', 'lanes', '{}', %s)",
                (job, status),
            )
    assert await b.prune() == 1
    assert await statuses(pool) == {line_id(running, "triage", "chat"): "answered"}


async def test_a_waiting_lines_tokens_stay_held_in_its_tenants_budget_until_answered(
    chat, api, lines, fake, pool, redis
) -> None:
    """Each look holds the line's tokens (the hold renewed once it lapsed:
    a batch may outlast the job's hold from intake); the answer's spend
    releases it."""
    budgets = Budgets(redis, BudgetLimits(daily_tokens=1_000_000, hold_s=0.05))
    ledger = Ledger(pool, budgets=budgets)
    job = str(uuid.uuid4())
    prompt = "Hold my tokens. " * 10
    await waits(delivery(chat, lines, job, ledger), prompt)
    held = await budgets.reserved("acme")
    assert held == budgets.estimate(len(prompt))
    await asyncio.sleep(0.1)  # the hold lapses; the next look holds it again
    await budgets.reserve("acme", str(uuid.uuid4()), 1)  # (which releases lapsed holds)
    assert await budgets.reserved("acme") == 1
    await waits(delivery(chat, lines, job, ledger), prompt)
    assert await budgets.reserved("acme") == 1 + held
    await settle(batcher(lines, api), pool, [line_id(job, "triage", "chat")])
    assert await ask(delivery(chat, lines, job, ledger), prompt)
    assert await ledger.flush() == 1
    assert await budgets.reserved("acme") == 1  # the line's hold released by its spend
    assert (await budgets.spent("acme")).tokens > 0


async def test_an_answer_read_again_after_a_crash_is_in_the_ledger_once(
    chat, api, lines, fake, pool
) -> None:
    """A delivery read its answered line and died before the call's
    checkpoint was stored: the next delivery reads the same answer, which
    the provider billed once, so the ledger holds one row for it."""
    ledger = Ledger(pool, prices=Prices.parse(f"{MODEL}=2/8"))
    job = str(uuid.uuid4())
    await waits(delivery(chat, lines, job), f"Ticket {job}. Classify it.")
    await settle(batcher(lines, api), pool, [line_id(job, "triage", "chat")])
    for _ in range(2):  # the dead delivery, then the next one
        text = await ask(delivery(chat, lines, job, ledger), f"Ticket {job}. Classify it.")
        assert text.startswith(f"Ticket {job}.")
        await ledger.flush()
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT lane, outcome, count(*) FROM model_calls GROUP BY 1, 2")
        assert await cur.fetchall() == [("batch", "ok", 1)]
    assert fake.batches.stats()["lines"] == {line_id(job, "triage", "chat"): 1}


# --- Anthropic's Message Batches ------------------------------------------------------


async def test_an_anthropic_batch_call_is_answered_through_message_batches(
    claude, claude_api, lines, fake, pool
) -> None:
    ledger = Ledger(pool)
    jobs = [str(uuid.uuid4()) for _ in range(3)]
    for job in jobs:
        await waits(delivery(claude, lines, job), f"Ticket {job}. Classify it.")
    custom_ids = [line_id(job, "triage", "anthropic") for job in jobs]
    assert await statuses(pool) == dict.fromkeys(custom_ids, "waiting")
    await settle(batcher(lines, claude_api), pool, custom_ids)
    stats = fake.batches.stats()
    assert stats["created"] == 1 and stats["lines"] == dict.fromkeys(custom_ids, 1)
    assert [s for s in stats["statuses"] if s.startswith("msgbatch_")]  # Message Batches
    assert fake.stats().dialects == {"anthropic": 3}  # each line once, no call of its own

    for job in jobs:
        text = await ask(delivery(claude, lines, job, ledger), f"Ticket {job}. Classify it.")
        assert text.startswith(f"Ticket {job}.")
    assert await ledger.flush() == 3
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT lane, dialect, outcome, model FROM model_calls")
        assert set(await cur.fetchall()) == {("batch", "anthropic", "ok", CLAUDE)}
    [row] = await lines.batches()
    assert (row.dialect, row.answered, row.provider_id) == ("anthropic", 3, row.provider_id)


def test_anthropic_results_become_outcomes_and_the_batchs_status() -> None:
    """Succeeded: answered with its message; errored: the status its type
    stands for and the type, never the message; expired and canceled: left
    unanswered, the batch ``expired`` (once more) or ``cancelled``."""
    secret = "the prompt's own words"
    message = {"content": [{"type": "text", "text": "Hi"}], "stop_reason": "end_turn"}
    error = {"type": "error", "error": {"type": "overloaded_error", "message": secret}}
    results = [
        {"custom_id": "a", "result": {"type": "succeeded", "message": message}},
        {"custom_id": "b", "result": {"type": "errored", "error": error}},
        {"custom_id": "c", "result": {"type": "canceled"}},
        {"custom_id": 5, "result": {"type": "succeeded", "message": message}},  # not an id
    ]
    status, found = anthropic_outcomes(results)
    assert status == "cancelled"
    assert [(o.custom_id, o.status, o.answer, o.error) for o in found] == [
        ("a", "answered", message, None),
        ("b", "failed", None, {"status": 529, "code": "overloaded_error"}),
    ]
    assert secret not in repr(found)
    expired = [*results, {"custom_id": "d", "result": {"type": "expired"}}]
    assert anthropic_outcomes(expired)[0] == "expired"
    assert anthropic_outcomes(results[:2])[0] == "completed"


async def stored_error(pool: Any, custom_id: str) -> Any:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT error FROM batch_lines WHERE custom_id = %s", (custom_id,))
        [(error,)] = await cur.fetchall()
        return error


async def test_anthropic_errored_lines_are_classified_by_their_error_type(
    claude, claude_api, lines, fake, pool
) -> None:
    """400 fails the call; a dry account (``billing_error``) fails it as
    ``ProviderQuota``, as an anthropic call's would; an overloaded (529)
    line goes in the next batch; the stored error is the status and the
    type, never the message."""
    bad, dry, flaky = str(uuid.uuid4()), str(uuid.uuid4()), str(uuid.uuid4())
    prompts = {
        bad: "A bad request. [[fake:400]]",
        dry: "No credit left. [[fake:credit]]",
        flaky: "Overloaded once. [[fake:529*1]]",
    }
    for job, prompt in prompts.items():
        await waits(delivery(claude, lines, job), prompt)
    ids = {job: line_id(job, "triage", "anthropic") for job in prompts}
    b = batcher(lines, claude_api)
    await settle(b, pool, list(ids.values()))
    assert await stored_error(pool, ids[bad]) == {"status": 400, "code": "invalid_request_error"}
    assert await stored_error(pool, ids[flaky]) == {"status": 529, "code": "overloaded_error"}
    assert await stored_error(pool, ids[dry]) == {"status": 402, "code": "billing_error"}
    with pytest.raises(PermanentError, match="400") as refused:
        await ask(delivery(claude, lines, bad), prompts[bad])
    assert not isinstance(refused.value, ProviderQuota)
    with pytest.raises(ProviderQuota):
        await ask(delivery(claude, lines, dry), prompts[dry])
    with pytest.raises(ResumeLater):  # back in line
        await ask(delivery(claude, lines, flaky), prompts[flaky])
    await settle(b, pool, [ids[flaky]])
    assert (await ask(delivery(claude, lines, flaky), prompts[flaky])).startswith("Overloaded")
    assert fake.batches.stats()["lines"] == {ids[bad]: 1, ids[dry]: 1, ids[flaky]: 2}


async def test_an_anthropic_expired_line_goes_once_more_then_fails(
    claude, claude_api, lines, fake, pool
) -> None:
    once, always = str(uuid.uuid4()), str(uuid.uuid4())
    prompts = {once: "Expires once. [[fake:expire*1]]", always: "Expires always. [[fake:expire]]"}
    for job, prompt in prompts.items():
        await waits(delivery(claude, lines, job), prompt)
    ids = [line_id(once, "triage", "anthropic"), line_id(always, "triage", "anthropic")]
    await settle(batcher(lines, claude_api), pool, ids)
    assert fake.batches.stats()["lines"] == dict.fromkeys(ids, 2)
    assert await statuses(pool) == {ids[0]: "answered", ids[1]: "failed"}
    assert await ask(delivery(claude, lines, once), prompts[once])
    with pytest.raises(PermanentError, match="batch_expired"):
        await ask(delivery(claude, lines, always), prompts[always])


@pytest.mark.parametrize("dies_at", ["submit", "record"])
async def test_an_anthropic_batch_lost_by_a_crash_is_adopted_or_created_once(
    claude, claude_api, lines, fake, pool, monkeypatch, dies_at: str
) -> None:
    """Killed after creating the batch (``record``): adopted by its size
    and time, though it keeps no metadata. Killed before (``submit``): none
    of its size at the provider, so it is created."""
    jobs = [str(uuid.uuid4()) for _ in range(2)]
    for job in jobs:
        await waits(delivery(claude, lines, job), f"Lost {job}.")
    await crash(lines, claude_api, monkeypatch, dies_at)
    assert fake.batches.stats()["created"] == (1 if dies_at == "record" else 0)
    ids = [line_id(job, "triage", "anthropic") for job in jobs]
    await settle(batcher(lines, claude_api, lease_s=0.2), pool, ids)
    stats = fake.batches.stats()
    assert stats["created"] == 1 and stats["lines"] == dict.fromkeys(ids, 1)
    for job in jobs:
        assert (await ask(delivery(claude, lines, job), f"Lost {job}.")).startswith(f"Lost {job}.")


async def test_a_foreign_batch_of_the_same_size_adopted_by_mistake_gives_no_wrong_answer(
    claude, claude_api, lines, fake, pool, monkeypatch
) -> None:
    """Killed before creating its batch; meanwhile another client of the
    workspace created a batch of one request: the recovery adopts it (same
    size, same time), its result changes none of oncely's lines, the line
    goes back in line and is answered by its own batch."""
    job = str(uuid.uuid4())
    prompt = "Mine, not theirs."
    await waits(delivery(claude, lines, job), prompt)
    await crash(lines, claude_api, monkeypatch, "submit")
    theirs = {"model": CLAUDE, "max_tokens": 64, "messages": [{"role": "user", "content": "No."}]}
    foreign = await claude_api.create("not-oncely", [("their-request-1", theirs)])

    custom_id = line_id(job, "triage", "anthropic")
    b = batcher(lines, claude_api, lease_s=0.2)
    await settle(b, pool, [custom_id])
    [row] = await lines.batches()
    assert row.provider_id == foreign  # the wrong batch, adopted
    assert await statuses(pool) == {custom_id: "failed"}  # not answered by it
    with pytest.raises(ResumeLater):  # back in line
        await ask(delivery(claude, lines, job), prompt)
    await settle(b, pool, [custom_id])
    assert (await ask(delivery(claude, lines, job), prompt)).startswith("Mine, not theirs.")
    assert fake.batches.stats()["lines"] == {"their-request-1": 1, custom_id: 1}


async def test_a_batch_another_oncely_batch_recorded_is_never_adopted(
    claude, claude_api, lines, fake, pool, monkeypatch
) -> None:
    """Two batches of one line each: the first created and recorded, the
    second killed before its creation. The first's batch has the right
    size and time, but it is recorded: the second is created."""
    first, second = str(uuid.uuid4()), str(uuid.uuid4())
    await waits(delivery(claude, lines, first), "First.")
    await batcher(lines, claude_api).gather()  # created and recorded
    await waits(delivery(claude, lines, second), "Second.")
    await crash(lines, claude_api, monkeypatch, "submit")
    ids = [line_id(first, "triage", "anthropic"), line_id(second, "triage", "anthropic")]
    await settle(batcher(lines, claude_api, lease_s=0.2), pool, ids)
    assert await statuses(pool) == dict.fromkeys(ids, "answered")
    stats = fake.batches.stats()
    assert stats["created"] == 2 and stats["lines"] == dict.fromkeys(ids, 1)
