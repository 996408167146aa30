"""The fleet's cooldown with its defaults, through real worker processes on
the fake model (docs/model-routing.md, "The cooldown"): ordinary transient
faults stall nothing, one tenant's failing prompts cool nothing for the
others, and after an outage of the only model its jobs resume at the
cooldown's end. None of these tests sets a cooldown of its own."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from oncely.fakes.llm import FakeLLMServer
from oncely.fakes.mail import FakeMailServer
from oncely.queue.stream import Stream
from tests.helpers import all_done, submit
from tests.processes import deployment_env, running, start, tail, wait_for
from tests.test_routing_processes import BACKUP, PRIMARY, models_of, rows

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

COOLING = "every model of the route is cooling down"


@pytest.fixture
def stream(redis) -> Stream:
    from oncely.builtin import app

    return Stream(redis, app["summaries"].keys)


def events(*logs: Path, name: str) -> list[dict[str, Any]]:
    """The JSON log events called ``name`` in the process logs."""
    found = []
    for log in logs:
        for line in log.read_text().splitlines():
            if line.startswith("{") and (event := json.loads(line)).get("event") == name:
                found.append(event)
    return found


async def job_seconds(pool, ids: list[str]) -> list[float]:
    """How long each job took from acceptance to done."""
    found = await rows(
        pool,
        "SELECT extract(epoch FROM updated_at - created_at) FROM jobs"
        " WHERE job_id = ANY(%s::uuid[]) ORDER BY 1",
        ids,
    )
    return [float(r[0]) for r in found]


async def test_429s_that_slip_past_the_fleet_limiter_cool_nothing(
    redis_url, database_url, pool, stream, tmp_path
):
    """Three workers share a provider that refuses a third of the jobs' first
    calls with 429 (as calls that slip past the fleet limiter are): ten
    distinct jobs rate-limited, and none of it cools the model. Every job is
    done, none deferred as cooling down."""
    async with FakeLLMServer() as model, FakeMailServer(tmp_path / "mail.jsonl") as mail:
        env = deployment_env(redis_url, database_url, model, mail, ONCELY_LLM_RPM="120")
        logs = [tmp_path / f"worker{i}.log" for i in range(3)]
        workers = [start(["worker"], env, log) for log in logs]
        with running(*workers):
            texts = [
                f"Paced job {i}. {'[[fake:429*1]]' if i % 3 == 0 else 'It runs.'}"
                for i in range(30)
            ]
            ids = [await submit(pool, stream, text) for text in texts]
            await wait_for(lambda: all_done(pool, ids), within_s=300, what="every job done")
        assert model.stats().total == 30 + 10
    assert events(*logs, name="model.cooling_down") == []
    deferred = events(*logs, name="job.deferred")
    assert not [e for e in deferred if COOLING in e.get("error", "")]
    print(
        f"30 jobs, 10 rate-limited once, 3 workers: last job done after "
        f"{max(await job_seconds(pool, ids)):.1f} s"
    )


async def test_one_job_whose_first_five_calls_fail_is_done_in_its_redeliveries(
    redis_url, database_url, pool, stream, tmp_path
):
    async with FakeLLMServer() as model, FakeMailServer(tmp_path / "mail.jsonl") as mail:
        env = deployment_env(redis_url, database_url, model, mail)
        log = tmp_path / "worker.log"
        with running(start(["worker"], env, log)):
            job = await submit(pool, stream, "Unlucky at first. [[fake:503*5]] Then fine.")
            await wait_for(lambda: all_done(pool, [job]), within_s=180, what="the job done")
        assert model.stats().total == 6
    assert events(log, name="model.cooling_down") == [], tail(log)
    deliveries = await rows(
        pool, "SELECT outcome FROM job_deliveries WHERE job_id = %s ORDER BY id", job
    )
    assert [d[0] for d in deliveries] == ["retry", "done"]
    print(f"one job, five 503s: done after {(await job_seconds(pool, [job]))[0]:.1f} s")


async def test_after_an_outage_of_the_only_model_jobs_resume_at_the_cooldowns_end(
    redis_url, database_url, redis, pool, stream, tmp_path
):
    """The only model goes down: its tenant's jobs trip the cooldown and
    wait for its end, holding nothing, on no growing backoff; the provider
    returns, the probe finds it, and every job is done."""
    async with FakeLLMServer() as model, FakeMailServer(tmp_path / "mail.jsonl") as mail:
        env = deployment_env(redis_url, database_url, model, mail, ONCELY_LLM_TIMEOUT_S="2")
        log = tmp_path / "worker.log"
        model.model.outage = "503"
        with running(start(["worker"], env, log)):
            ids = [await submit(pool, stream, f"Outage job {i}. Waits.") for i in range(8)]

            async def tripped() -> bool:
                return bool(events(log, name="model.cooling_down"))

            await wait_for(tripped, within_s=120, what="the cooldown")
            calls_in_outage = model.stats().total
            model.model.outage = None
            back = time.time()
            await wait_for(lambda: all_done(pool, ids), within_s=240, what="every job done")
        stats = model.stats()
    # The outage cost a handful of calls per job that tripped it, not one
    # round of attempts per job and redelivery.
    assert calls_in_outage <= 5 * 4 + 4, calls_in_outage
    assert stats.total - calls_in_outage == 8, "each job answered once after the outage"
    cooling = [e for e in events(log, name="job.deferred") if COOLING in e.get("error", "")]
    assert cooling, "jobs waited for the cooldown's end"
    # Waiting for a cooldown is no failure: the job's backoff does not grow,
    # and it comes back at the cooldown's end (60 s at most, plus a tenth).
    assert all(e["failures"] <= 1 and e["retry_in_s"] <= 66 for e in cooling), cooling
    done_at = await rows(
        pool,
        "SELECT max(extract(epoch FROM updated_at)) FROM jobs WHERE job_id = ANY(%s::uuid[])",
        ids,
    )
    print(
        f"outage of the only model: {calls_in_outage} calls during it; every job done "
        f"{float(done_at[0][0]) - back:.1f} s after the provider returned"
    )


async def test_one_tenants_failing_prompts_cool_nothing_for_another_tenant(
    redis_url, database_url, pool, stream, tmp_path
):
    """An attacker's jobs fail on every model (503s and hangs) while a
    victim's jobs run beside them: every victim job is answered by the
    primary with one call, never deferred, never moved to the fallback."""
    async with FakeLLMServer() as model, FakeMailServer(tmp_path / "mail.jsonl") as mail:
        env = deployment_env(
            redis_url,
            database_url,
            model,
            mail,
            ONCELY_LLM_FALLBACKS=BACKUP,
            ONCELY_LLM_TIMEOUT_S="2",
        )
        log = tmp_path / "worker.log"
        with running(start(["worker"], env, log)):

            async def started() -> bool:
                return bool(events(log, name="worker.started"))

            await wait_for(started, what="the worker")
            victims: list[str] = []
            for i in range(10):
                fault = "[[fake:503]]" if i % 2 else "[[fake:hang]]"
                await submit(pool, stream, f"Attack {i}. {fault}", tenant="mallory")
                victims.append(await submit(pool, stream, f"Victim {i}. Fine.", tenant="globex"))

            async def attacker_cooled() -> bool:
                return any(
                    e.get("scope") == "tenant" for e in events(log, name="model.cooling_down")
                )

            await wait_for(attacker_cooled, within_s=180, what="the attacker's own cooldown")
            victims += [
                await submit(pool, stream, f"Victim after {i}. Fine.", tenant="globex")
                for i in range(10)
            ]
            await wait_for(lambda: all_done(pool, victims), within_s=120, what="the victims done")
    assert await models_of(pool, victims) == {PRIMARY}
    calls = await rows(
        pool,
        "SELECT count(*) FROM model_calls WHERE tenant = 'globex' AND job_id = ANY(%s::uuid[])",
        victims,
    )
    assert calls[0][0] == len(victims), "one call per victim job"
    histories = await rows(
        pool,
        "SELECT count(*) FROM job_deliveries WHERE job_id = ANY(%s::uuid[]) AND outcome <> 'done'",
        victims,
    )
    assert histories[0][0] == 0, "no victim job deferred"
    assert not [e for e in events(log, name="model.cooling_down") if e.get("scope") == "fleet"]
    seconds = await job_seconds(pool, victims)
    print(
        f"victims beside an attacker: p50 {seconds[len(seconds) // 2]:.2f} s, "
        f"max {seconds[-1]:.2f} s"
    )
