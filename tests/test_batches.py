"""The batch lane (docs/lanes.md), one process: a call's line stored
before its batch exists, gathered, created at the fake model's Batches API
over HTTP with its oncely id in the metadata, recorded, answered, and the
answer the call's, on lane ``batch`` in the ledger (real PostgreSQL). A
batch gathered but not recorded (a crash before or after its creation) is
adopted or created once; failed lines are classified; an expired batch's
lines go once more; a cancelled job's line is never sent. The process
tests are tests/test_lanes_processes.py."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from pydantic import BaseModel

from oncely.errors import PermanentError, ResumeLater
from oncely.fakes.llm import FakeLLMServer
from oncely.llm.batches import Batcher, BatchLines, OpenAIBatches
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
async def api(fake: FakeLLMServer) -> AsyncIterator[OpenAIBatches]:
    api = OpenAIBatches.connect(fake.url, "test")
    yield api
    await api.aclose()


@pytest.fixture
def lines(pool: Any) -> BatchLines:
    return BatchLines(pool, poll_s=0.05)


def batcher(lines: BatchLines, api: OpenAIBatches, **kw: Any) -> Batcher:
    return Batcher(lines, {"chat": api}, gather_s=0, **{"lease_s": 60.0, **kw})


def delivery(chat: OpenAICompatible, lines: BatchLines, job_id: str, ledger: Ledger | None = None):
    """A delivery's model for ``job_id`` on the batch lane."""
    return Model(
        chat,
        policy=FAST,
        deadline=Deadline.after(30),
        workflow="lanes",
        model_name=MODEL,
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


async def test_a_batch_call_is_stored_gathered_created_once_and_answered_as_the_calls_answer(
    chat, api, lines, fake, pool
) -> None:
    ledger = Ledger(pool, prices=Prices.parse(f"{MODEL}=2/8"))
    jobs = [str(uuid.uuid4()) for _ in range(3)]
    for job in jobs:
        with pytest.raises(ResumeLater):
            await ask(delivery(chat, lines, job), f"Ticket {job}. Classify it.")
    custom_ids = [f"{job}:triage" for job in jobs]
    assert await statuses(pool) == dict.fromkeys(custom_ids, "waiting")
    assert fake.batches.stats()["created"] == 0  # nothing sent yet

    # A look before the batch is done still waits, and stores nothing twice.
    with pytest.raises(ResumeLater):
        await ask(delivery(chat, lines, jobs[0]), f"Ticket {jobs[0]}. Classify it.")

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
    with pytest.raises(ResumeLater):
        await ask(delivery(chat, lines, job), "Metadata, please.")
    await settle(batcher(lines, api), pool, [f"{job}:triage"])
    [row] = await lines.batches()
    assert (row.lines, row.answered, row.failed, row.waiting) == (1, 1, 0, 0)
    assert await api.find(row.batch_id) == row.provider_id


class Crash(Exception):
    """A process killed at that point (the process tests kill it for real)."""


async def test_a_batch_gathered_but_never_created_is_created_once_by_the_recovery(
    chat, api, lines, fake, pool, monkeypatch
) -> None:
    job = str(uuid.uuid4())
    with pytest.raises(ResumeLater):
        await ask(delivery(chat, lines, job), "Lost before its batch.")

    async def dies(*args: Any) -> str:
        raise Crash

    dying = batcher(lines, api, lease_s=0.2)
    monkeypatch.setattr(dying, "submit", dies)
    with pytest.raises(Crash):
        await dying.gather()
    assert await statuses(pool) == {f"{job}:triage": "gathered"}
    await settle(batcher(lines, api, lease_s=0.2), pool, [f"{job}:triage"])
    stats = fake.batches.stats()
    assert stats["created"] == 1 and stats["lines"] == {f"{job}:triage": 1}


async def test_a_batch_created_but_not_recorded_is_adopted_never_created_again(
    chat, api, lines, fake, pool, monkeypatch
) -> None:
    job = str(uuid.uuid4())
    with pytest.raises(ResumeLater):
        await ask(delivery(chat, lines, job), "Lost after its batch.")

    async def dies(*args: Any) -> None:
        raise Crash

    dying = batcher(lines, api, lease_s=0.2)
    monkeypatch.setattr(dying, "record", dies)
    with pytest.raises(Crash):
        await dying.gather()
    assert fake.batches.stats()["created"] == 1
    await settle(batcher(lines, api, lease_s=0.2), pool, [f"{job}:triage"])
    stats = fake.batches.stats()
    assert stats["created"] == 1 and stats["lines"] == {f"{job}:triage": 1}
    assert await ask(delivery(chat, lines, job), "Lost after its batch.")


async def test_a_line_that_failed_permanently_fails_the_call(chat, api, lines, fake, pool):
    job = str(uuid.uuid4())
    prompt = "A bad request. [[fake:400]]"
    with pytest.raises(ResumeLater):
        await ask(delivery(chat, lines, job), prompt)
    await settle(batcher(lines, api), pool, [f"{job}:triage"])
    with pytest.raises(PermanentError, match="400"):
        await ask(delivery(chat, lines, job), prompt)
    assert fake.batches.stats()["lines"] == {f"{job}:triage": 1}


async def test_a_line_that_failed_transiently_goes_in_the_next_batch(chat, api, lines, fake, pool):
    job = str(uuid.uuid4())
    custom_id = f"{job}:triage"
    prompt = "A server error, once. [[fake:503*1]]"
    with pytest.raises(ResumeLater):
        await ask(delivery(chat, lines, job), prompt)
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
        with pytest.raises(ResumeLater):
            await ask(delivery(chat, lines, job), prompt)
    b = batcher(lines, api)
    ids = [f"{once}:triage", f"{always}:triage"]
    await settle(b, pool, ids)
    assert fake.batches.stats()["lines"] == dict.fromkeys(ids, 2)
    assert await statuses(pool) == {ids[0]: "answered", ids[1]: "failed"}
    assert await ask(delivery(chat, lines, once), prompts[once])
    with pytest.raises(PermanentError, match="batch_expired"):
        await ask(delivery(chat, lines, always), prompts[always])


async def test_a_cancelled_jobs_line_is_never_sent(chat, api, lines, fake, pool) -> None:
    cancelled, kept = str(uuid.uuid4()), str(uuid.uuid4())
    for job in (cancelled, kept):
        with pytest.raises(ResumeLater):
            await ask(delivery(chat, lines, job), f"Job {job}.")
    async with pool.connection() as conn:
        await conn.execute(
            "INSERT INTO jobs (job_id, tenant, kind, payload, status)"
            " VALUES (%s, 'acme', 'lanes', %s, 'cancelled')",
            (cancelled, json.dumps({})),
        )
    await settle(batcher(lines, api), pool, [f"{kept}:triage"])
    assert fake.batches.stats()["lines"] == {f"{kept}:triage": 1}
    assert (await statuses(pool))[f"{cancelled}:triage"] == "dropped"


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
    await settle(b, pool, [f"{job}:verdict"])
    with pytest.raises(ResumeLater):  # the first answer did not validate: a second ask
        await structured()
    await settle(b, pool, [f"{job}:verdict#2"])
    assert isinstance(await structured(), Verdict)
    assert fake.batches.stats()["lines"] == {f"{job}:verdict": 1, f"{job}:verdict#2": 1}


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
        with pytest.raises(ResumeLater):
            await ask(delivery(chat, lines, job), prompt)
    await settle(batcher(lines, api), pool, [f"{done}:triage", f"{failed}:triage"])
    with pytest.raises(ResumeLater):
        await ask(delivery(chat, lines, waiting), "Still out.")
    await batcher(lines, api).gather()  # out, not answered yet: no poll
    with pytest.raises(ResumeLater):
        await ask(delivery(chat, lines, str(uuid.uuid4())), "Not gathered yet.")

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
        await settle(b, pool, [f"{job}:triage"])
        assert isinstance(
            await model().structured(Verdict, "Responses in a batch.", step="triage"), Verdict
        )
    assert fake.stats().dialects == {"responses": 1}
    assert fake.batches.stats()["lines"] == {f"{job}:triage": 1}


async def test_settled_lines_past_their_keep_go_once_their_job_ended(
    chat, api, lines, fake, pool
) -> None:
    ended, running = str(uuid.uuid4()), str(uuid.uuid4())
    for job in (ended, running):
        with pytest.raises(ResumeLater):
            await ask(delivery(chat, lines, job), f"Job {job}.")
    await settle(batcher(lines, api), pool, [f"{ended}:triage", f"{running}:triage"])
    b = batcher(lines, api, keep_s=0.0)
    async with pool.connection() as conn:
        for job, status in ((ended, "done"), (running, "queued")):
            await conn.execute(
                "INSERT INTO jobs (job_id, tenant, kind, payload, status)"
                " VALUES (%s, 'acme', 'lanes', '{}', %s)",
                (job, status),
            )
    assert await b.prune() == 1
    assert await statuses(pool) == {f"{running}:triage": "answered"}


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
    with pytest.raises(ResumeLater):
        await ask(delivery(chat, lines, job, ledger), prompt)
    held = await budgets.reserved("acme")
    assert held == budgets.estimate(len(prompt))
    await asyncio.sleep(0.1)  # the hold lapses; the next look holds it again
    await budgets.reserve("acme", str(uuid.uuid4()), 1)  # (which releases lapsed holds)
    assert await budgets.reserved("acme") == 1
    with pytest.raises(ResumeLater):
        await ask(delivery(chat, lines, job, ledger), prompt)
    assert await budgets.reserved("acme") == 1 + held
    await settle(batcher(lines, api), pool, [f"{job}:triage"])
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
    with pytest.raises(ResumeLater):
        await ask(delivery(chat, lines, job), f"Ticket {job}. Classify it.")
    await settle(batcher(lines, api), pool, [f"{job}:triage"])
    for _ in range(2):  # the dead delivery, then the next one
        text = await ask(delivery(chat, lines, job, ledger), f"Ticket {job}. Classify it.")
        assert text.startswith(f"Ticket {job}.")
        await ledger.flush()
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT lane, outcome, count(*) FROM model_calls GROUP BY 1, 2")
        assert await cur.fetchall() == [("batch", "ok", 1)]
    assert fake.batches.stats()["lines"] == {f"{job}:triage": 1}
