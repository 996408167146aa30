"""The chaos soak, small (``python -m bench.chaos``): 200 requests over the
soak app's three workflows (the two built-in ones and ``reviews``, multi-step:
a model call, a side step, a webhook, a wait for an event, maybe a sleep,
another model call, another webhook), sent 1–3 times each, the reviews'
events sent before their wait, while they wait, twice, in conflict, after
the end or never, while a worker or relay is SIGKILLed every 2 s, Redis is
restarted empty mid-run and the fake model and provider fail at random;
afterwards every invariant holds: nothing lost, each effect once, scripted
422s and dead jobs as scripted, replays identical, no checkpointed model
call or side step run again, and every excess call explained. And the
runner's checks, on made-up evidence, catching each broken invariant. The
same soak with the support agent written in Pydantic AI keeps them too."""

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
from bench import chaos, chaos_app

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


def run_soak(tmp_path: Path, *extra: str) -> tuple[int, dict[str, Any], str]:
    report = tmp_path / "report.json"
    args = [sys.executable, "-m", "bench.chaos", *SOAK, *extra, "--dir", str(tmp_path / "run")]
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
@pytest.mark.soak
@pytest.mark.timeout(300)
@pytest.mark.standalone_redis("bench.chaos deploys on private single servers")
@pytest.mark.parametrize("llm_client", ["openai", "lean"])
def test_small_soak_with_kills_and_redis_restarted_empty_keeps_every_invariant(
    tmp_path, llm_client
):
    code, report, progress = run_soak(tmp_path, "--llm-client", llm_client)

    assert report["config"]["llm_client"] == llm_client
    started = [
        line
        for log in (tmp_path / "run").rglob("worker*.log")
        for line in log.read_text(errors="replace").splitlines()
        if '"model.client"' in line
    ]
    assert started and all(f'"client": "{llm_client}"' in line for line in started)
    assert report["violations"] == [], progress
    assert code == 0
    assert report["accepted"] == REQUESTS
    assert (report["lost"], report["duplicate_effects"]) == (0, 0)
    assert report["done"] + report["dead"] == REQUESTS
    assert report["dead"] == report["dead_scripted"] > 0, "dead exactly as scripted"
    assert report["effects"] == report["effects_expected"], "each effect of the rows, once"
    assert report["reused_key_422"] > 0 and report["replays"] > 0
    assert report["kills"]["total"] >= 5
    [scenario] = report["scenarios"]
    assert scenario["name"] == "redis-restart" and scenario["detail"].startswith("restarted empty")
    assert report["provider_faults"] and report["model"]["random_faults"], "faults were met"
    assert report["model"]["excess_explained_by"].get("unexplained", 0) == 0
    steps = report["multi_step"]
    assert steps["accepted"] > 0 and steps["lost"] == 0
    assert steps["done"] + steps["dead"] == steps["accepted"]
    assert steps["dead"] == steps["dead_scripted"]
    assert steps["waited"] > 0 and steps["timed_out"] > 0 and steps["sleeps"] > 0
    assert steps["events"]["received_before_the_wait"] > 0
    assert steps["events"]["received_while_waiting"] > 0
    answers = steps["events"]["answers"]
    assert answers["first 202"] > 0 and answers["after 409"] > 0, answers
    assert steps["model_calls"]["checkpoints"] == 2 * steps["done"] + steps["dead"]
    assert steps["model_calls"]["excess_explained_by"].get("unexplained", 0) == 0
    assert steps["side_steps"]["checkpoints"] == steps["accepted"]
    assert steps["side_steps"]["extra_explained_by"].get("unexplained", 0) == 0
    agents = report["agents"]
    assert agents["done"] > 0 and agents["turns_stored"] >= 2 * agents["done"]
    assert agents["refunds_received"] == agents["refund_calls_answered"] > 0
    assert agents["excess_explained_by"].get("unexplained", 0) == 0
    probe = report["relay_kill_mid_call"]
    assert "skipped" not in probe, probe
    assert probe["resumed_s"] < 15, f"{probe}: about 5 s at most; 15 s for a loaded machine"
    assert probe["sends"] >= 2, "held, killed mid-send, sent again"


@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.timeout(300)
@pytest.mark.standalone_redis("bench.chaos deploys on private single servers")
def test_small_soak_with_the_support_agent_in_pydantic_ai_keeps_every_invariant(tmp_path):
    """The same soak over ``bench.chaos_app:frameworks``: the support agent
    is Pydantic AI's (examples/pydantic_ai_support.py), checked as oncely's
    own: each stored turn paid once unless a kill explains it, one refund
    per answered call, one reply."""
    code, report, progress = run_soak(tmp_path, "--app", "bench.chaos_app:frameworks")

    assert report["violations"] == [], progress
    assert code == 0
    assert (report["accepted"], report["lost"], report["duplicate_effects"]) == (REQUESTS, 0, 0)
    assert report["effects"] == report["effects_expected"]
    assert report["kills"]["total"] >= 5
    agents = report["agents"]
    assert agents["workflow"] == "pai_support"
    assert agents["done"] > 0 and agents["turns_stored"] >= 2 * agents["done"]
    assert agents["refunds_received"] == agents["refund_calls_answered"] > 0
    assert agents["replies"] == agents["done"]
    assert agents["excess_explained_by"].get("unexplained", 0) == 0


# --- the checks themselves, on made-up evidence: a soak that cannot fail proves nothing


T0 = 1_700_000_000.0
JOB_IDS = [str(uuid.UUID(int=n + 1)) for n in range(5)]
# The reviews of the clean run: one waits for its event and sleeps, then is
# done; one never gets its event and is scripted to fail in its last call.
REVIEW, DOOMED_REVIEW = JOB_IDS[3], JOB_IDS[4]


def request(i: int, workflow: str, doomed: bool = False, event: str | None = None) -> Any:
    if workflow == "summaries":
        body: dict[str, Any] = {
            "text": f"req-{i:06d} seed-0. Once.",
            "notify": f"user{i}@example.com",
        }
    elif workflow == "triage":
        body = {"subject": f"req-{i:06d} seed-0: Charged twice", "body": "Billing."}
    else:
        body = {
            "text": f"req-{i:06d} seed-0. Review me.",
            "wait_s": 2.0 if event == "never" else 60.0,
            "sleep_s": 0.0 if doomed else 2.0,
            "fate": "[[fake:400]]" if doomed else "",
        }
    key = f"chaos-0-{workflow}-{i:06d}"
    return chaos.Planned(
        i, "acme", workflow, key, body, None, doomed, "sequential", 1, 0.0, event=event
    )


def accepted(planned: Any, job_id: str, times: int = 2) -> Any:
    body = json.dumps({"job_id": job_id, "status": "queued"}).encode()
    answers = [chaos.Answer(202, body, replayed=n > 0, attempts=1) for n in range(times)]
    return chaos.Outcome(planned, answers)


def email_line(job_id: str, to: str, summary: str) -> dict[str, Any]:
    email = render_email({"job_id": job_id, "to": to, "summary": summary})
    fields = {"to": email.to, "subject": email.subject, "text": email.text}
    return {"kind": "email", "idempotency_key": f"summary_ready:{job_id}", **fields}


def event_line(job_id: str, result: dict[str, str]) -> dict[str, Any]:
    data = {"job_id": job_id, **result}
    return webhook_line(f"ticket_triaged:{job_id}", "ticket.triaged", data)


def webhook_line(key: str, topic: str, data: dict[str, Any]) -> dict[str, Any]:
    body = json.dumps({"type": topic, "data": data})
    headers = {
        "webhook-id": key,
        "webhook-timestamp": str(int(T0)),
        "webhook-signature": sign(chaos.WEBHOOK_SECRET, key, int(T0), body.encode()),
    }
    return {
        "kind": "event",
        "idempotency_key": key,
        "type": topic,
        "data": data,
        "headers": headers,
        "body": body,
    }


def checkpoint(
    key: str, ordinal: int, kind: str, value: Any, at: float, ended: float | None = None
) -> Any:
    """A done checkpoint stored at T0 + ``at``; a wait or sleep of ``until``
    (``key`` = approval: 60 s, sleep: 2 s) that ended at T0 + ``ended``."""
    usage = {"model_calls": 1} if kind == "model" else None
    length = {"approval": 60.0, "sleep": 2.0}.get(key)
    until = T0 + at + length if length is not None else None
    finished = T0 + (ended if ended is not None else at)
    return chaos.CheckpointRow(key, ordinal, kind, "done", value, usage, until, T0 + at, finished)


def received(job_id: str) -> chaos.Answer:
    body = json.dumps({"job_id": job_id, "event": "approval", "status": "received"}).encode()
    return chaos.Answer(202, body, attempts=1)


def review_run() -> tuple[list[Any], dict[str, Any]]:
    """A review done (its event came while it waited, then it slept), and a
    doomed one dead (its wait timed out, its last call failed for good)."""
    review, doomed = request(3, "reviews", event="late"), request(4, "reviews", True, "never")
    outcomes = [accepted(review, REVIEW), accepted(doomed, DOOMED_REVIEW)]
    approval = chaos.approval_of(review)
    key = f"{review.key}-approval"
    outcomes[0].events = [chaos.EventSend("first", key, approval, received(REVIEW), "waiting")]
    lookup = {"run": "run-1", "pid": 41}
    steps = {
        REVIEW: [
            checkpoint("model", 1, "model", "Draft.", at=1.0),
            checkpoint("lookup", 2, "step", lookup, at=2.0),
            checkpoint("approval", 3, "wait", approval, at=2.0, ended=4.0),
            checkpoint("sleep", 4, "sleep", None, at=4.0, ended=6.5),
            checkpoint("model#2", 5, "model", "Final.", at=7.0),
        ],
        DOOMED_REVIEW: [
            checkpoint("model", 1, "model", "Draft.", at=1.0),
            checkpoint("lookup", 2, "step", {"run": "run-2", "pid": 41}, at=2.0),
            dataclasses.replace(
                checkpoint("approval", 3, "wait", None, at=2.0, ended=4.1), until=T0 + 4.0
            ),
        ],
    }
    result = {"draft": "Draft.", "lookup": "run-1", "final": "Final.", **approval}
    requested = chaos_app.REVIEW_REQUESTED
    decided = {"approved": approval["approved"], "by": approval["by"], "final": "Final."}
    return outcomes, {
        "rows": {REVIEW: (review, "done"), DOOMED_REVIEW: (doomed, "dead")},
        "results": {REVIEW: result},
        "checkpoints": steps,
        "events": {REVIEW: chaos.EventRow(approval, T0 + 3.0)},
        "side_runs": {
            REVIEW: [chaos.SideRun(REVIEW, "run-1", 41, T0 + 1.5)],
            DOOMED_REVIEW: [chaos.SideRun(DOOMED_REVIEW, "run-2", 41, T0 + 1.5)],
        },
        "prompts": {
            (3, "draft"): [chaos.PromptRecord(1, 1, (6001,), {}, {})],
            (3, "final"): [chaos.PromptRecord(1, 1, (6002,), {}, {})],
            (4, "draft"): [chaos.PromptRecord(1, 1, (6003,), {}, {})],
            (4, "final"): [chaos.PromptRecord(1, 0, (), {"400": 1}, {"400": (6004,)})],
        },
        "effects": [
            webhook_line(f"{requested}:{REVIEW}", requested, {"job_id": REVIEW, "draft": "Draft."}),
            webhook_line(
                f"{chaos_app.REVIEW_DECIDED}:{REVIEW}",
                chaos_app.REVIEW_DECIDED,
                {"job_id": REVIEW, **decided},
            ),
            webhook_line(
                f"{requested}:{DOOMED_REVIEW}",
                requested,
                {"job_id": DOOMED_REVIEW, "draft": "Draft."},
            ),
        ],
    }


def clean_run() -> tuple[list[Any], Any]:
    """A summary done, a ticket done and a scripted failure dead, and two
    reviews (``review_run``), as they should be."""
    summary, ticket, doomed = (
        request(0, "summaries"),
        request(1, "triage"),
        request(2, "triage", True),
    )
    outcomes = [accepted(p, j) for p, j in zip((summary, ticket, doomed), JOB_IDS[:3], strict=True)]
    triaged = {"category": "billing", "priority": "normal", "reply": "On it."}
    fates = zip(JOB_IDS[:3], (summary, ticket, doomed), ("done", "done", "dead"), strict=True)
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
    reviews, r = review_run()
    for job_id, (p, status) in r["rows"].items():
        evidence.jobs[job_id] = chaos.JobRow(
            job_id, "acme", "reviews", status, None, p.body, T0, T0 + 8
        )
    evidence.results.update(r["results"])
    evidence.checkpoints, evidence.events = r["checkpoints"], r["events"]
    evidence.side_runs, evidence.step_prompts = r["side_runs"], r["prompts"]
    evidence.effects += r["effects"]
    evidence.outbox += [
        chaos.OutboxRow(line["data"]["job_id"], line["idempotency_key"], True, False, 1)
        for line in r["effects"]
    ]
    evidence.deliveries = {"requests": 5, "effects": 5, "by_key": {}}
    return outcomes + reviews, evidence


def check(outcomes: list[Any], evidence: Any, kills: tuple[Any, ...] = ()) -> dict[str, Any]:
    options = chaos.parse_options([])
    return chaos.report(options, outcomes, evidence, list(kills), [], [], {}, (True, {}))


def kinds(report: dict[str, Any]) -> set[str]:
    return {v["kind"] for v in report["violations"]}


def test_the_checks_pass_a_run_where_everything_is_as_it_should_be() -> None:
    report = check(*clean_run())

    assert report["violations"] == []
    assert (report["accepted"], report["done"], report["dead_scripted"]) == (5, 3, 2)
    assert report["replays"] == 5
    assert report["effects"] == report["effects_expected"] == 5
    steps = report["multi_step"]
    assert (steps["done"], steps["dead_scripted"], steps["lost"]) == (1, 1, 0)
    assert (steps["waited"], steps["timed_out"], steps["sleeps"]) == (2, 1, 1)
    assert steps["events"]["received_while_waiting"] == 1
    assert steps["model_calls"]["checkpoints"] == steps["model_calls"]["billed"] == 3
    assert steps["side_steps"]["runs"] == steps["side_steps"]["checkpoints"] == 2


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


# -- multi-step defects: the review of the clean run ------------------------------------


def leave_a_review_waiting(outcomes: list[Any], e: Any) -> None:
    e.jobs[REVIEW] = dataclasses.replace(e.jobs[REVIEW], status="waiting")


def pay_a_checkpointed_call_again(outcomes: list[Any], e: Any) -> None:
    """The draft billed twice: the second time by a worker nobody killed."""
    e.step_prompts[3, "draft"] = [chaos.PromptRecord(2, 2, (6001, 6005), {}, {})]


def deliver_a_review_effect_twice(outcomes: list[Any], e: Any) -> None:
    [requested] = [x for x in e.effects if x["idempotency_key"].endswith(f":{REVIEW}")][:1]
    e.effects.append(dict(requested))


def emit_a_review_effect_under_another_key(outcomes: list[Any], e: Any) -> None:
    data = {"job_id": REVIEW, "draft": "Draft."}
    e.effects.append(webhook_line(f"review.requested.again:{REVIEW}", "review.requested", data))


def decide_a_dead_review(outcomes: list[Any], e: Any) -> None:
    key = f"{chaos_app.REVIEW_DECIDED}:{DOOMED_REVIEW}"
    data = {"job_id": DOOMED_REVIEW, "approved": None, "by": None, "final": "Final."}
    e.effects.append(webhook_line(key, chaos_app.REVIEW_DECIDED, data))


def rerun_a_stored_side_step(outcomes: list[Any], e: Any) -> None:
    """A run that began 3 s after the step's checkpoint was stored (at T0 + 2)."""
    e.side_runs[REVIEW].append(chaos.SideRun(REVIEW, "run-3", 43, T0 + 5.0))


def run_a_side_step_twice_for_no_reason(outcomes: list[Any], e: Any) -> None:
    e.side_runs[REVIEW].insert(0, chaos.SideRun(REVIEW, "run-0", 43, T0 + 1.2))


def keep_a_side_value_no_run_made(outcomes: list[Any], e: Any) -> None:
    steps = e.checkpoints[REVIEW]
    steps[1] = dataclasses.replace(steps[1], value={"run": "run-9", "pid": 41})


def miss_an_event_that_came_in_time(outcomes: list[Any], e: Any) -> None:
    steps = e.checkpoints[REVIEW]
    steps[2] = dataclasses.replace(steps[2], value=None)


def end_a_sleep_early(outcomes: list[Any], e: Any) -> None:
    steps = e.checkpoints[REVIEW]
    steps[3] = dataclasses.replace(steps[3], finished=T0 + 5.5)


def skip_the_sleep(outcomes: list[Any], e: Any) -> None:
    del e.checkpoints[REVIEW][3]


def ask_the_final_call_with_another_prompt(outcomes: list[Any], e: Any) -> None:
    e.step_prompts[3, "final"].append(chaos.PromptRecord(1, 1, (6006,), {}, {}))


def keep_the_conflicting_event(outcomes: list[Any], e: Any) -> None:
    e.events[REVIEW] = chaos.EventRow(chaos.conflicting_approval_of(outcomes[3].planned), T0 + 3)


def accept_a_conflicting_event(outcomes: list[Any], e: Any) -> None:
    other = chaos.conflicting_approval_of(outcomes[3].planned)
    answer = received(REVIEW)
    outcomes[3].events.append(chaos.EventSend("conflict", "k-2", other, answer, "waiting"))


def answer_with_a_value_no_checkpoint_holds(outcomes: list[Any], e: Any) -> None:
    e.results[REVIEW] = {**e.results[REVIEW], "final": "Another final."}


# What each defect breaks, in a clean run (the agent's are below).
BROKEN = [
    (lose_a_job, "lost"),
    (duplicate_an_effect, "duplicate_effects"),
    (let_a_doomed_job_finish, "scripted_failure_not_dead"),
    (change_a_replay, "replay_not_identical"),
    (accept_a_reused_key, "reused_key_not_422"),
    (pay_twice, "excess_model_calls_unexplained"),
    (send_another_summary, "effect_differs_from_result"),
    (email_a_stranger, "effect_of_no_accepted_job"),
    (leave_a_review_waiting, "lost"),
    (pay_a_checkpointed_call_again, "checkpointed_call_repeated"),
    (deliver_a_review_effect_twice, "duplicate_effects"),
    (emit_a_review_effect_under_another_key, "effect_without_checkpoint"),
    (decide_a_dead_review, "effect_without_checkpoint"),
    (rerun_a_stored_side_step, "side_step_ran_after_checkpoint"),
    (run_a_side_step_twice_for_no_reason, "side_step_repeated_unexplained"),
    (keep_a_side_value_no_run_made, "side_step_value_of_no_run"),
    (miss_an_event_that_came_in_time, "wait_missed_its_event"),
    (end_a_sleep_early, "sleep_ended_early"),
    (skip_the_sleep, "steps_differ"),
    (ask_the_final_call_with_another_prompt, "model_call_prompt_changed"),
    (keep_the_conflicting_event, "stored_event_differs"),
    (accept_a_conflicting_event, "unexpected_event_answer"),
    (answer_with_a_value_no_checkpoint_holds, "result_differs_from_checkpoints"),
]


def checked_with_each_kill(defect: Any, *kills: Any) -> list[dict[str, Any]]:
    """A clean run broken by ``defect``, checked once with each kill."""
    outcomes, evidence = clean_run()
    defect(outcomes, evidence)
    return [check(outcomes, evidence, (kill,)) for kill in kills]


def test_an_extra_model_call_paid_by_a_worker_killed_mid_job_is_explained() -> None:
    killed = chaos.Kill(T0 + 0.5, 1.0, "worker", "worker1.1", 42, model_ports=(5001,))
    after = chaos.Kill(T0 + 5, 6.0, "worker", "worker2.1", 43, model_ports=(5003,))
    explained, too_late = checked_with_each_kill(pay_twice, killed, after)

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


def test_a_repeated_checkpointed_call_is_explained_only_by_a_kill_while_it_was_in_flight():
    """The draft was stored at T0 + 1. A worker killed before, holding the
    port that paid the second call, explains it; the same kill while the
    job slept (T0 + 5, after the checkpoint) explains nothing, though the
    job was still in flight."""
    during = chaos.Kill(T0 + 0.5, 1.0, "worker", "worker1.1", 42, model_ports=(6005,))
    after = chaos.Kill(T0 + 5, 6.0, "worker", "worker2.1", 43, model_ports=(6005,))
    explained, too_late = checked_with_each_kill(pay_a_checkpointed_call_again, during, after)

    assert explained["violations"] == []
    assert explained["multi_step"]["model_calls"]["excess_explained_by"]["worker_kill"] == 1
    assert kinds(too_late) == {"checkpointed_call_repeated"}


def test_a_side_step_run_again_because_its_worker_died_mid_step_is_explained():
    outcomes, evidence = clean_run()
    run_a_side_step_twice_for_no_reason(outcomes, evidence)  # pid 43, at T0 + 1.2
    mid_step = chaos.Kill(T0 + 1.3, 1.3, "worker", "worker2.1", 43)

    report = check(outcomes, evidence, (mid_step,))

    assert report["violations"] == []
    side = report["multi_step"]["side_steps"]
    assert (side["runs"], side["extra_runs"]) == (3, 1)
    assert side["extra_explained_by"]["worker_died"] == 1


def test_a_second_final_call_after_the_waiting_delivery_lost_its_worker_is_explained():
    """The delivery that began the wait (T0 + 2, pid 44) was killed before
    it acknowledged its entry: the entry came back while the job ran again,
    and both deliveries paid for the final call."""
    outcomes, evidence = clean_run()
    evidence.step_prompts[3, "final"] = [chaos.PromptRecord(2, 2, (6002, 6007), {}, {})]
    evidence.suspensions = {REVIEW: [(44, T0 + 2.0)]}
    killed = chaos.Kill(T0 + 2.2, 2.2, "worker", "worker3.1", 44)

    unexplained = check(outcomes, evidence)
    explained = check(outcomes, evidence, (killed,))

    assert kinds(unexplained) == {"checkpointed_call_repeated"}
    assert explained["violations"] == []
    assert explained["multi_step"]["model_calls"]["excess_explained_by"]["stale_entry"] == 1


def test_a_worker_pid_is_read_from_its_consumer_name():
    assert chaos.consumer_pid("vm-host-20067-372cba") == 20067
    assert chaos.consumer_pid("nonsense") == 0


# -- the agent's checks: one support job, on made-up evidence ---------------------------

AGENT = str(uuid.UUID(int=42))
REFUND_ARGS = {"order_id": "A-1001", "cents": 4200, "reason": "broken"}


def agent_run() -> tuple[list[Any], Any]:
    """A support job done in three turns (lookup, refund, reply): three
    model checkpoints, the refund call answered, one refund and one reply
    at the provider, each turn billed once."""
    body = {"customer": "user7@example.com", "message": "req-000007 seed-0. Broken."}
    planned = chaos.Planned(
        7, "acme", "support", "chaos-0-support-000007", body, None, False, "sequential", 1, 0.0
    )
    result = {"reply": "Refunded.", "refunded_cents": 4200, "tool_calls": ["refund:ok"]}
    refund_key = f"refund.issue:{AGENT}:support/refund/call"
    reply = {
        "kind": "email",
        "idempotency_key": f"support.reply:{AGENT}",
        "to": "user7@example.com",
        "subject": "About your order",
        "text": "Refunded.",
    }
    evidence = chaos.Evidence(
        jobs={AGENT: chaos.JobRow(AGENT, "acme", "support", "done", None, body, T0, T0 + 4)},
        results={AGENT: result},
        usage={AGENT: {"model_calls": 3}},
        outbox=[
            chaos.OutboxRow(AGENT, refund_key, True, False, 1),
            chaos.OutboxRow(AGENT, f"support.reply:{AGENT}", True, False, 1),
        ],
        effects=[webhook_line(refund_key, "refund.issue", REFUND_ARGS), reply],
        deliveries={"requests": 2, "effects": 2, "by_key": {}},
        calls={"total": 3},
        prompts={7: chaos.PromptRecord(3, 3, (7001, 7002, 7003), {}, {})},
        log_events=collections.Counter(),
    )
    evidence.checkpoints = {
        AGENT: [
            checkpoint("support/model", 1, "model", None, 1.0),
            checkpoint("support/lookup_order/tool", 2, "tool", None, 1.2),
            checkpoint("support/model#2", 3, "model", None, 2.0),
            checkpoint("support/refund/call", 4, "call", {"ok": True}, 3.0),
            checkpoint("support/model#3", 5, "model", None, 3.5),
        ]
    }
    return [accepted(planned, AGENT)], evidence


def test_the_agent_checks_pass_a_clean_run_and_count_its_turns_and_refunds() -> None:
    report = check(*agent_run())

    assert report["violations"] == []
    agents = report["agents"]
    assert (agents["done"], agents["turns_stored"], agents["billed_for_turns"]) == (1, 3, 3)
    assert agents["refund_calls_answered"] == agents["refunds_received"] == 1
    assert agents["replies"] == 1 and report["effects_expected"] == 2


def refund_twice(outcomes: list[Any], e: Any) -> None:
    key = f"refund.issue:{AGENT}:support/refund/call#2"
    e.effects.append(webhook_line(key, "refund.issue", REFUND_ARGS))


def refund_another_amount(outcomes: list[Any], e: Any) -> None:
    key = e.effects[0]["idempotency_key"]
    e.effects[0] = webhook_line(key, "refund.issue", {**REFUND_ARGS, "cents": 9900})


def pay_a_turn_twice(outcomes: list[Any], e: Any) -> None:
    e.prompts[7] = chaos.PromptRecord(4, 4, (7001, 7002, 7003, 7004), {}, {})


def reply_twice(outcomes: list[Any], e: Any) -> None:
    e.effects.append({**e.effects[1], "idempotency_key": f"support.reply.again:{AGENT}"})


def refund_without_an_answered_call(outcomes: list[Any], e: Any) -> None:
    e.checkpoints[AGENT] = [c for c in e.checkpoints[AGENT] if c.kind != "call"]


AGENT_BROKEN = [
    (refund_twice, "agent_refunds_not_once"),
    (refund_another_amount, "agent_refund_differs"),
    (pay_a_turn_twice, "excess_model_calls_unexplained"),
    (reply_twice, "agent_reply_not_once"),
    (refund_without_an_answered_call, "agent_refunds_not_once"),
]


@pytest.mark.parametrize(
    ("run", "defect", "violation"),
    [pytest.param(clean_run, d, v, id=d.__name__) for d, v in BROKEN]
    + [pytest.param(agent_run, d, v, id=f"agent-{d.__name__}") for d, v in AGENT_BROKEN],
)
def test_the_checks_catch_each_broken_invariant(run: Any, defect: Any, violation: str) -> None:
    outcomes, evidence = run()
    defect(outcomes, evidence)

    report = check(outcomes, evidence)

    assert violation in kinds(report)
    assert report["ok"] is False


def test_an_agent_turn_paid_again_by_a_worker_killed_mid_job_is_explained() -> None:
    outcomes, evidence = agent_run()
    pay_a_turn_twice(outcomes, evidence)
    killed = chaos.Kill(T0 + 2.5, 2.5, "worker", "worker1.1", 41, (7004,))

    report = check(outcomes, evidence, (killed,))

    assert report["violations"] == []
    assert report["agents"]["excess_explained_by"]["worker_kill"] == 1
