"""The chaos soak, small (``python -m bench.chaos``): about 200 requests over both
workflows, sent 1–3 times each, while a worker or relay is SIGKILLed every
2 s, Redis is restarted empty mid-run and the fake model and provider fail
at random; afterwards every invariant holds: nothing lost, one effect per
done job, scripted 422s and dead jobs as scripted, replays identical, and
every excess model call explained by a kill. And the runner's checks, on
made-up evidence, catching each broken invariant."""

from __future__ import annotations

import collections
import dataclasses
import json
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from bench import chaos

from oncely.builtin.summaries import render_email
from oncely.senders.webhook import sign
from tests.processes import ROOT

REQUESTS = 200
SOAK = [
    "--requests", str(REQUESTS), "--rate", "10", "--kill-every", "2",
    "--scenarios", "redis-restart", "--seed", "7",
    "--drain-timeout", "120", "--accept-timeout", "120",
]  # fmt: skip
# Inside pytest's 300 s: the runner gets SIGTERM first, so it stops its
# servers and processes before the test fails.
RUN_TIMEOUT_S = 270


def run_soak(tmp_path: Path) -> tuple[int, dict[str, Any], str]:
    report = tmp_path / "report.json"
    args = [sys.executable, "-m", "bench.chaos", *SOAK, "--dir", str(tmp_path / "run")]
    with (tmp_path / "chaos.log").open("wb") as log:
        runner = subprocess.Popen(
            [*args, "--out", str(report)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log
        )
        try:
            runner.wait(RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            runner.send_signal(signal.SIGTERM)
            runner.wait(25)
    progress = (tmp_path / "chaos.log").read_text(errors="replace")[-4000:]
    assert report.exists(), f"no report (exit {runner.returncode}):\n{progress}"
    return runner.returncode, json.loads(report.read_text()), progress


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.standalone_redis("bench/chaos.py deploys on private single servers")
def test_small_soak_with_kills_and_redis_restarted_empty_keeps_every_invariant(tmp_path):
    code, report, progress = run_soak(tmp_path)

    assert report["violations"] == [], progress
    assert code == 0
    assert report["accepted"] == REQUESTS
    assert (report["lost"], report["duplicate_effects"]) == (0, 0)
    assert report["done"] + report["dead"] == REQUESTS
    assert report["dead"] == report["dead_scripted"] > 0, "dead exactly as scripted"
    assert report["effects"] == report["done"], "one effect per done job"
    assert report["reused_key_422"] > 0 and report["replays"] > 0
    assert report["kills"]["total"] >= 5
    [scenario] = report["scenarios"]
    assert scenario["name"] == "redis-restart" and scenario["detail"].startswith("restarted empty")
    assert report["provider_faults"] and report["model"]["random_faults"], "faults were met"
    assert report["model"]["excess_explained_by"].get("unexplained", 0) == 0


# --- the checks themselves, on made-up evidence: a soak that cannot fail proves nothing


T0 = 1_700_000_000.0
JOB_IDS = [str(uuid.UUID(int=n + 1)) for n in range(3)]


def request(i: int, workflow: str, doomed: bool = False) -> Any:
    if workflow == "summaries":
        body = {"text": f"req-{i:06d} seed-0. Once.", "notify": f"user{i}@example.com"}
    else:
        body = {"subject": f"req-{i:06d} seed-0: Charged twice", "body": "Billing."}
    key = f"chaos-0-{workflow}-{i:06d}"
    return chaos.Planned(i, "acme", workflow, key, body, None, doomed, "sequential", 1, 0.0)


def accepted(planned: Any, job_id: str, times: int = 2) -> Any:
    body = json.dumps({"job_id": job_id, "status": "queued"}).encode()
    answers = [chaos.Answer(202, body, replayed=n > 0, attempts=1) for n in range(times)]
    return chaos.Outcome(planned, answers)


def email_line(job_id: str, to: str, summary: str) -> dict[str, Any]:
    email = render_email({"job_id": job_id, "to": to, "summary": summary})
    fields = {"to": email.to, "subject": email.subject, "text": email.text}
    return {"kind": "email", "idempotency_key": f"summary_ready:{job_id}", **fields}


def event_line(job_id: str, result: dict[str, str]) -> dict[str, Any]:
    body = json.dumps({"type": "ticket.triaged", "data": {"job_id": job_id, **result}})
    key = f"ticket_triaged:{job_id}"
    headers = {
        "webhook-id": key,
        "webhook-timestamp": str(int(T0)),
        "webhook-signature": sign(chaos.WEBHOOK_SECRET, key, int(T0), body.encode()),
    }
    data = {"job_id": job_id, **result}
    return {"kind": "event", "idempotency_key": key, "data": data, "headers": headers, "body": body}


def clean_run() -> tuple[list[Any], Any]:
    """A summary done, a ticket done and a scripted failure dead, as they should be."""
    summary, ticket, doomed = (
        request(0, "summaries"),
        request(1, "triage"),
        request(2, "triage", True),
    )
    outcomes = [accepted(p, j) for p, j in zip((summary, ticket, doomed), JOB_IDS, strict=True)]
    triaged = {"category": "billing", "priority": "normal", "reply": "On it."}
    fates = zip(JOB_IDS, (summary, ticket, doomed), ("done", "done", "dead"), strict=True)
    rows = {
        job_id: chaos.JobRow(job_id, "acme", p.workflow, status, None, p.body, T0, T0 + 1)
        for job_id, p, status in fates
    }
    evidence = chaos.Evidence(
        jobs=rows,
        results={JOB_IDS[0]: {"summary": "Once."}, JOB_IDS[1]: triaged},
        usage={JOB_IDS[0]: {"model_calls": 1}, JOB_IDS[1]: {"model_calls": 1}},
        outbox=[
            chaos.OutboxRow(JOB_IDS[0], f"summary_ready:{JOB_IDS[0]}", True, False, 1),
            chaos.OutboxRow(JOB_IDS[1], f"ticket_triaged:{JOB_IDS[1]}", True, False, 1),
        ],
        effects=[
            email_line(JOB_IDS[0], "user0@example.com", "Once."),
            event_line(JOB_IDS[1], triaged),
        ],
        deliveries={"requests": 2, "effects": 2, "by_key": {}},
        calls={"total": 3},
        prompts={
            0: chaos.PromptRecord(1, 1, (5001,), {}, {}),
            1: chaos.PromptRecord(1, 1, (5002,), {}, {}),
            2: chaos.PromptRecord(1, 0, (), {"400": 1}, {"400": (5003,)}),
        },
        log_events=collections.Counter(),
    )
    return outcomes, evidence


def check(outcomes: list[Any], evidence: Any, kills: tuple[Any, ...] = ()) -> dict[str, Any]:
    options = chaos.parse_options([])
    return chaos.report(options, outcomes, evidence, list(kills), [], [], {}, (True, {}))


def kinds(report: dict[str, Any]) -> set[str]:
    return {v["kind"] for v in report["violations"]}


def test_the_checks_pass_a_run_where_everything_is_as_it_should_be() -> None:
    report = check(*clean_run())

    assert report["violations"] == []
    assert (report["accepted"], report["done"], report["dead_scripted"]) == (3, 2, 1)
    assert report["replays"] == 3


def lose_a_job(outcomes: list[Any], e: Any) -> None:
    e.jobs[JOB_IDS[0]] = dataclasses.replace(e.jobs[JOB_IDS[0]], status="queued")


def duplicate_an_effect(outcomes: list[Any], e: Any) -> None:
    e.effects.append(e.effects[0])


def let_a_doomed_job_finish(outcomes: list[Any], e: Any) -> None:
    e.jobs[JOB_IDS[2]] = dataclasses.replace(e.jobs[JOB_IDS[2]], status="done")


def change_a_replay(outcomes: list[Any], e: Any) -> None:
    outcomes[0].answers[1].body = b'{"job_id": "another"}'


def accept_a_reused_key(outcomes: list[Any], e: Any) -> None:
    outcomes[0].reuse = chaos.Answer(202, outcomes[0].answers[0].body)


def pay_twice(outcomes: list[Any], e: Any) -> None:
    e.prompts[0] = chaos.PromptRecord(2, 2, (5001, 5003), {}, {})


def send_another_summary(outcomes: list[Any], e: Any) -> None:
    e.effects[0] = email_line(JOB_IDS[0], "user0@example.com", "Twice.")


def email_a_stranger(outcomes: list[Any], e: Any) -> None:
    e.effects.append(email_line(str(uuid.UUID(int=99)), "x@example.com", "Who?"))


@pytest.mark.parametrize(
    ("defect", "violation"),
    [
        (lose_a_job, "lost"),
        (duplicate_an_effect, "duplicate_effects"),
        (let_a_doomed_job_finish, "scripted_failure_not_dead"),
        (change_a_replay, "replay_not_identical"),
        (accept_a_reused_key, "reused_key_not_422"),
        (pay_twice, "excess_model_calls_unexplained"),
        (send_another_summary, "effect_differs_from_result"),
        (email_a_stranger, "effect_of_no_accepted_job"),
    ],
)
def test_the_checks_catch_each_broken_invariant(defect: Any, violation: str) -> None:
    outcomes, evidence = clean_run()
    defect(outcomes, evidence)

    report = check(outcomes, evidence)

    assert violation in kinds(report)
    assert report["ok"] is False


def test_an_extra_model_call_paid_by_a_worker_killed_mid_job_is_explained() -> None:
    outcomes, evidence = clean_run()
    pay_twice(outcomes, evidence)
    killed = chaos.Kill(T0 + 0.5, 1.0, "worker", "worker1.1", 42, model_ports=(5001,))
    after = chaos.Kill(T0 + 5, 6.0, "worker", "worker2.1", 43, model_ports=(5003,))

    explained = check(outcomes, evidence, (killed,))
    too_late = check(outcomes, evidence, (after,))

    assert explained["violations"] == []
    assert explained["model"]["excess_explained_by"]["worker_kill"] == 1
    assert explained["model"]["worker_kills_explaining_excess"] == 1
    assert kinds(too_late) == {"excess_model_calls_unexplained"}, "killed after the job was done"


def test_an_extra_call_after_the_storing_delivery_timed_out_on_a_billed_answer_is_explained():
    """Three attempts in the delivery that stored the result, one a 503: one
    billed answer came too late for it."""
    outcomes, evidence = clean_run()
    faults, ports = {"503": 1, "slow": 1}, {"503": (5004,), "slow": (5004,)}
    evidence.prompts[0] = chaos.PromptRecord(3, 2, (5004, 5005), faults, ports)
    evidence.usage[JOB_IDS[0]] = {"model_calls": 3}

    report = check(outcomes, evidence)

    assert report["violations"] == []
    assert report["model"]["excess_explained_by"]["client_timeout"] == 1


def test_a_fault_met_by_a_killed_worker_does_not_hide_a_timeout_in_the_storing_delivery():
    """The killed worker met a 503 and paid for nothing; the storing delivery
    made two attempts for one answer: a billed answer came too late."""
    outcomes, evidence = clean_run()
    evidence.prompts[0] = chaos.PromptRecord(3, 2, (5005, 5006), {"503": 1}, {"503": (5001,)})
    evidence.usage[JOB_IDS[0]] = {"model_calls": 2}
    killed = chaos.Kill(T0 + 0.5, 1.0, "worker", "worker1.1", 42, model_ports=(5001,))

    report = check(outcomes, evidence, (killed,))

    assert report["violations"] == []
    assert report["model"]["excess_explained_by"]["client_timeout"] == 1
