"""The built-in triage workflow on a real worker, the real model adapter and
the fake model's structured output; and the summaries email renderer."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from oncely.bootstrap import step_config
from oncely.builtin.summaries import SUMMARY_READY, render_email
from oncely.builtin.triage import triage
from oncely.errors import PermanentError
from oncely.jobs.handler import WorkflowHandler
from oncely.jobs.records import JobSpec
from oncely.outbox.wakeup import OutboxWakeUp
from tests.helpers import count, drain, job_status, make_worker, pending, rows


@pytest.fixture
async def triage_handler(pool, jobs, worker_settings, summary_job):
    # summary_job's model client is reused: one adapter serves every workflow.
    return WorkflowHandler(
        triage, jobs, summary_job.llm, step_config(worker_settings), OutboxWakeUp(pool)
    )


@pytest.fixture
async def triage_stream(jobs):
    stream = jobs.streams["triage"]
    await stream.ensure_group()
    return stream


@pytest.fixture
def triaged(pool, jobs, triage_stream, triage_handler) -> Callable[..., Awaitable[str]]:
    """Accept a ticket as job ``00000000-0000-4000-8000-<n>`` and run a triage
    worker until idle: the job's id."""

    async def run(subject: str, body: str, n: int) -> str:
        job_id = f"00000000-0000-4000-8000-{n:012}"
        await jobs.accept(JobSpec(job_id, "acme", "triage", {"subject": subject, "body": body}))
        await drain(make_worker(triage_stream, triage_handler, pool))
        return job_id

    return run


async def test_a_ticket_is_triaged_from_its_text_with_one_webhook_row(
    pool, jobs, triage_stream, triaged, fake_llm
):
    job_id = await triaged(
        "URGENT: refund please", "I was charged twice; my billing page shows both.", 1
    )
    assert await job_status(pool, job_id) == "done"
    [(result, usage)] = await rows(
        pool, "SELECT result, usage FROM results WHERE job_id = %s", job_id
    )
    assert result["category"] == "billing"
    assert result["priority"] == "urgent"
    assert result["reply"]
    assert usage["model_calls"] == 1 and usage["prompt_tokens"] > 0
    [(topic, key, payload)] = await rows(pool, "SELECT topic, dedupe_key, payload FROM outbox")
    assert (topic, key) == ("ticket.triaged", f"ticket_triaged:{job_id}")
    assert payload == {"job_id": job_id, **result}
    [prompt] = fake_llm.stats().prompts
    assert prompt.count == 1
    assert await pending(triage_stream) == 0


async def test_one_invalid_answer_is_asked_again_and_the_job_ends_done(
    pool, jobs, triage_stream, triaged, fake_llm
):
    job_id = await triaged("Login broken", "Account locked. [[fake:badjson*1]]", 2)
    assert await job_status(pool, job_id) == "done"
    assert fake_llm.stats(contains="badjson").prompts[0].count == 2
    [(usage,)] = await rows(pool, "SELECT usage FROM results WHERE job_id = %s", job_id)
    assert usage["model_calls"] == 2
    [(category,)] = await rows(pool, "SELECT result->>'category' FROM results")
    assert category == "account"
    assert await count(pool, "SELECT count(*) FROM outbox") == 1


async def test_answers_that_never_validate_end_dead_with_the_validation_error(
    pool, jobs, triage_stream, triaged, fake_llm
):
    job_id = await triaged("Nonsense", "Always garbage. [[fake:badjson*9]]", 3)
    assert await job_status(pool, job_id) == "dead"
    [(error,)] = await rows(pool, "SELECT error FROM jobs WHERE job_id = %s", job_id)
    assert "permanent" in error and "Triage" in error
    # The first answer and the two re-asks of ONCELY_LLM_INVALID_OUTPUT_RETRIES.
    assert fake_llm.stats(contains="garbage").prompts[0].count == 3
    [letter] = await jobs.streams["triage"].dead_letters()
    assert letter.job_id == job_id and letter.reason == "permanent"
    assert await count(pool, "SELECT count(*) FROM results") == 0
    assert await count(pool, "SELECT count(*) FROM outbox") == 0


def test_summary_ready_renders_to_the_recipient():
    payload = {"job_id": "job-1", "to": "ada@example.com", "summary": "Short."}
    email = render_email(payload)
    assert email.to == "ada@example.com"
    assert "job-1" in email.subject
    assert email.text.startswith("Short.")


@pytest.mark.parametrize(
    "payload",
    [
        {"job_id": "job-1", "summary": "Short."},
        {"job_id": "job-1", "to": "ada@example.com", "summary": None},
    ],
)
def test_unrenderable_summary_rows_are_permanent(payload):
    with pytest.raises(PermanentError, match=SUMMARY_READY):
        render_email(payload)
