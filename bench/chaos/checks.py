"""Every invariant, checked against the evidence (docs/chaos.md: "What it promises")."""

from __future__ import annotations

import collections
import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

from bench import chaos_app
from bench.chaos.common import (
    AGENT_ORDER,
    AGENT_REFUND_CENTS,
    AGENT_WORKFLOWS,
    KILL_REACH_S,
    RACE_S,
    REVIEW_CALLS,
    SCENARIO_REACH_S,
    WEBHOOK_SECRET,
)
from bench.chaos.evidence import (
    KEPT_WITH_RESULT,
    CheckpointRow,
    Evidence,
    JobRow,
    OutboxRow,
    PromptRecord,
)
from bench.chaos.fleet import Kill, ScenarioRun
from bench.chaos.plan import Planned, approval_of
from bench.chaos.traffic import Answer, EventSend, Outcome, problem_type
from oncely.builtin.summaries import render_email
from oncely.senders.webhook import verify


class Violations:
    """Violations by kind: a count and the first few examples of each."""

    EXAMPLES = 5

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.examples: dict[str, list[str]] = collections.defaultdict(list)

    def add(self, kind: str, example: str) -> None:
        self.counts[kind] += 1
        if len(self.examples[kind]) < self.EXAMPLES:
            self.examples[kind].append(example)

    def to_json(self) -> list[dict[str, Any]]:
        return [
            {"kind": kind, "count": n, "examples": self.examples[kind]}
            for kind, n in sorted(self.counts.items())
        ]


@dataclass
class Excess:
    """Calls (or runs) beyond the one needed: how many, on how many calls,
    and what explained them."""

    EXAMPLES = 10

    total: int = 0
    items: int = 0
    explained: collections.Counter[str] = field(default_factory=collections.Counter)
    examples: list[dict[str, Any]] = field(default_factory=list)

    def blame(
        self,
        excess: int,
        causes: dict[str, int],
        v: Violations,
        kind: str,
        example: dict[str, Any],
    ) -> None:
        """One excess call per cause at most, in the causes' order; the rest
        is a violation of ``kind``."""
        self.total += excess
        self.items += 1
        left = excess
        for cause, n in causes.items():
            taken = min(left, n)
            self.explained[cause] += taken
            left -= taken
        if left:
            self.explained["unexplained"] += left
            v.add(kind, f"{example}: {excess} extra, causes {causes}")
        if len(self.examples) < self.EXAMPLES:
            self.examples.append({**example, "excess": excess, "causes": causes})


@dataclass
class Tally:
    """The numbers of the report, filled in by the checks."""

    accepted: int = 0
    replays: int = 0
    reused_422: int = 0
    done: int = 0
    dead: int = 0
    dead_scripted: int = 0
    lost: int = 0
    duplicate_effects: int = 0
    # Effects the stored rows make (one per done one-call job; a review's
    # for each of its effect's checkpoints).
    effects_expected: int = 0
    # Done jobs of the one-call workflows, their calls, and their usable
    # answers billed.
    one_call_done: int = 0
    one_call_calls: int = 0
    billed: int = 0
    calls: Excess = field(default_factory=Excess)
    explaining_kills: set[str] = field(default_factory=set)
    agents: AgentTally = field(default_factory=lambda: AgentTally())


@dataclass
class AgentTally:
    """The numbers of the report's agents section (the support agent's jobs)."""

    # The app's support agent (common.AGENT_WORKFLOWS).
    workflow: str = "support"
    done: int = 0
    dead: int = 0
    # Model turns stored (checkpoints), and usable answers billed for them.
    turns: int = 0
    billed: int = 0
    calls: Excess = field(default_factory=Excess)
    # Refund calls the jobs' checkpoints hold answered, and the refunds the
    # provider received (distinct webhook-ids).
    refunds_answered: int = 0
    refunds_received: int = 0
    replies: int = 0


def check_intake(outcomes: list[Outcome], v: Violations, t: Tally) -> None:
    for o in outcomes:
        p = o.planned
        finals = [a.status for a in o.answers]
        for answer in o.answers:
            if answer.status is None:
                v.add("no_final_answer", f"{p.key}: retried {dict(answer.retried)}")
        for status, answer in zip(finals, o.answers, strict=True):
            if status not in (None, 202):
                v.add("unexpected_status", f"{p.key}: {status} {answer.body[:200]!r}")
        bodies = {a.body for a in o.accepted}
        if len(bodies) > 1:
            v.add("replay_not_identical", f"{p.key}: {sorted(bodies)}")
        t.accepted += bool(o.accepted)
        t.replays += sum(a.replayed for a in o.accepted)
        if o.reuse is not None:
            _check_reuse(o, o.reuse, v, t)


def _check_reuse(o: Outcome, reuse: Answer, v: Violations, t: Tally) -> None:
    problem = json.loads(reuse.body) if reuse.body.startswith(b"{") else {}
    if reuse.status == 422 and str(problem.get("type", "")).endswith("/idempotency-key-reused"):
        t.reused_422 += 1
    else:
        v.add("reused_key_not_422", f"{o.planned.key}: {reuse.status} {reuse.body[:200]!r}")


def check_jobs(outcomes: list[Outcome], e: Evidence, v: Violations, t: Tally) -> None:
    accepted = {o.job_id: o for o in outcomes if o.job_id is not None}
    for job_id, o in accepted.items():
        row = e.jobs.get(job_id)
        if row is None or row.status not in ("done", "dead"):
            t.lost += 1
            v.add("lost", f"{o.planned.key} job {job_id}: {row.status if row else 'no row'}")
            continue
        p = o.planned
        if (row.tenant, row.kind, row.payload) != (p.tenant, p.workflow, p.body):
            v.add("job_row_differs", f"{job_id}: {row.tenant} {row.kind} {row.payload}")
        if row.status == "done":
            t.done += 1
            if p.doomed:
                v.add("scripted_failure_not_dead", f"{p.key} job {job_id} is done")
        else:
            t.dead += 1
            t.dead_scripted += p.doomed
            if not p.doomed and not _dead_explained(row, e.prompts.get(p.index)):
                v.add("dead_not_scripted", f"{p.key} job {job_id}: {row.error}")
    for job_id, row in e.jobs.items():
        if job_id not in accepted and row.status != "withdrawn":
            v.add("job_never_accepted", f"{job_id} ({row.kind}, {row.status})")


def _dead_explained(row: JobRow, prompt: PromptRecord | None) -> bool:
    """Random ``badjson`` answers may exhaust a triage job's re-asks: dead by design."""
    bad = prompt.faults.get("badjson", 0) if prompt else 0
    return row.kind == "triage" and "invalid" in (row.error or "").lower() and bad >= 3


def check_effects(outcomes: list[Outcome], e: Evidence, v: Violations, t: Tally) -> None:
    by_job: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for line in e.effects:
        by_job[_effect_job(line)].append(line)
    rows: dict[str | None, list[OutboxRow]] = collections.defaultdict(list)
    for outbox_row in e.outbox:
        rows[outbox_row.job_id].append(outbox_row)
    jobs = {o.job_id: o for o in outcomes if o.job_id is not None}
    for job_id, o in jobs.items():
        row = e.jobs.get(job_id)
        status = row.status if row else None
        effects, outbox = by_job.pop(job_id, []), rows.pop(job_id, [])
        stepwise = _STEPWISE_EFFECTS.get(o.planned.workflow)
        if stepwise is not None:
            if row is not None and status in ("done", "dead"):
                stepwise(o, row, e, effects, outbox, v, t)
        elif status == "done":
            _check_done(o, e.results.get(job_id), outbox, effects, v, t)
        elif effects or outbox or job_id in e.results:
            v.add("effect_without_done_job", f"{job_id} ({status}): {len(effects)} effects")
    for job_id, lines in by_job.items():
        t.duplicate_effects += len(lines)
        v.add("effect_of_no_accepted_job", f"{job_id}: {[x['idempotency_key'] for x in lines]}")


def _effect_job(line: dict[str, Any]) -> str:
    """The job of an effect's key: ``<topic>:<job_id>``, or a call's
    ``<topic>:<job_id>:<checkpoint key>``."""
    return str(line["idempotency_key"]).split(":")[1]


def _check_agent_effects(
    o: Outcome,
    row: JobRow,
    e: Evidence,
    effects: list[dict[str, Any]],
    outbox: list[OutboxRow],
    v: Violations,
    t: Tally,
) -> None:
    """A support agent's effects: the refund call once per answered call
    checkpoint (the provider saw one webhook-id for it, signed, with the
    arguments the model gave), and the reply email once, as the result says."""
    job_id, a = row.job_id, t.agents
    answered = [c for c in e.checkpoints.get(job_id, []) if c.kind == "call" and c.status == "done"]
    refunds = [x for x in effects if x.get("type") == "refund.issue"]
    replies = [x for x in effects if x.get("kind") == "email"]
    a.refunds_answered += len(answered)
    a.refunds_received += len(refunds)
    a.replies += len(replies)
    t.effects_expected += len(answered) + (row.status == "done")
    if len(refunds) != len(answered):
        t.duplicate_effects += max(0, len(refunds) - len(answered))
        v.add("agent_refunds_not_once", f"{job_id}: {len(refunds)} sent, {len(answered)} answered")
    refund_args = {"order_id": AGENT_ORDER, "cents": AGENT_REFUND_CENTS, "reason": "broken"}
    for refund in refunds:
        problem = _webhook_problem(refund, {**refund.get("data", {}), **refund_args})
        if problem:
            v.add("agent_refund_differs", f"{job_id}: {problem}")
    result = e.results.get(job_id)
    if row.status == "dead" or result is None:
        if replies or result is not None:
            v.add("effect_without_done_job", f"{job_id} ({row.status}): {len(replies)} replies")
        return
    if len(replies) != 1:
        t.duplicate_effects += max(0, len(replies) - 1)
        v.add("agent_reply_not_once", f"{job_id}: {len(replies)} replies")
    for reply in replies[:1]:
        got = (reply.get("to"), reply.get("text"))
        if got != (o.planned.body["customer"], result["reply"]):
            v.add("effect_differs_from_result", f"{job_id}: reply {got}")
    unsent = [r for r in outbox if not r.sent]
    if unsent or len(outbox) != len(answered) + 1:
        v.add("outbox_row_not_one_sent", f"{job_id}: {outbox}")


def _check_done(
    o: Outcome,
    result: dict[str, Any] | None,
    outbox: list[OutboxRow],
    effects: list[dict[str, Any]],
    v: Violations,
    t: Tally,
) -> None:
    job_id = o.job_id
    t.effects_expected += 1
    if result is None:
        v.add("done_without_result", f"{job_id}")
        return
    if len(outbox) != 1 or not outbox[0].sent:
        v.add("outbox_row_not_one_sent", f"{job_id}: {outbox}")
    if len(effects) != 1:
        t.duplicate_effects += max(0, len(effects) - 1)
        kind = "duplicate_effects" if effects else "done_without_effect"
        v.add(kind, f"{job_id}: {len(effects)} effects")
    for effect in effects[:1]:
        problem = _effect_problem(o, result, effect)
        if problem:
            v.add("effect_differs_from_result", f"{job_id}: {problem}")


def _effect_problem(o: Outcome, result: dict[str, Any], effect: dict[str, Any]) -> str:
    """Why the delivered effect is not the one the stored result makes, or ''."""
    job_id = str(o.job_id)
    if o.planned.workflow == "summaries":
        payload = {"job_id": job_id, "to": o.planned.body["notify"], "summary": result["summary"]}
        expected = render_email(payload)
        got = (effect.get("to"), effect.get("subject"), effect.get("text"))
        return "" if got == (expected.to, expected.subject, expected.text) else f"email {got}"
    return _webhook_problem(effect, {"job_id": job_id, **result})


def _webhook_problem(effect: dict[str, Any], data: dict[str, Any]) -> str:
    """Why a delivered webhook is not the one with ``data``, or ''."""
    if effect.get("data") != data:
        return f"event data {effect.get('data')}, expected {data}"
    headers, body = effect.get("headers") or {}, str(effect.get("body")).encode()
    now = float(headers.get("webhook-timestamp") or 0)
    return "" if verify(WEBHOOK_SECRET, headers, body, now=now) else "bad webhook signature"


# -- the multi-step checks (reviews) ---------------------------------------------------


@dataclass
class StepTally:
    """The numbers of the report's multi-step section."""

    accepted: int = 0
    done: int = 0
    dead: int = 0
    dead_scripted: int = 0
    lost: int = 0
    plans: collections.Counter[str] = field(default_factory=collections.Counter)
    # Waits: suspended at the wait (the event was not there yet), ended by
    # the timeout (and of those, the ones whose plan sent an event in time).
    waited: int = 0
    timed_out: int = 0
    timed_out_unplanned: int = 0
    sleeps: int = 0
    sleep_late_s: list[float] = field(default_factory=list)
    events: collections.Counter[str] = field(default_factory=collections.Counter)
    # Final answers to event sends, by the send's label and status.
    answers: collections.Counter[str] = field(default_factory=collections.Counter)
    # Model calls: one prompt per model checkpoint; usable answers billed.
    prompts: int = 0
    billed: int = 0
    per_prompt: collections.Counter[int] = field(default_factory=collections.Counter)
    calls: Excess = field(default_factory=Excess)
    side_runs: int = 0
    side_checkpoints: int = 0
    side: Excess = field(default_factory=Excess)
    # The latest start of an extra side run after its step's checkpoint was stored.
    latest_extra_run_s: float | None = None


@dataclass(frozen=True)
class ReviewRun:
    """A finished review's evidence: its checkpoints by key, and for each the
    window it was in flight: from the end of the checkpoint before it (the
    job's creation for the first) until it was stored."""

    outcome: Outcome
    row: JobRow
    steps: dict[str, CheckpointRow]
    windows: dict[str, tuple[float, float]]

    @property
    def job_id(self) -> str:
        return self.row.job_id


def expected_steps(p: Planned, status: str) -> list[tuple[str, str]]:
    """The (key, kind) of each checkpoint a review that ended ``status`` stored."""
    steps = [("model", "model"), ("lookup", "step"), ("approval", "wait")]
    steps += [("sleep", "sleep")] if p.sleeps else []
    return steps + ([("model#2", "model")] if status == "done" else [])


def check_reviews(
    outcomes: list[Outcome],
    e: Evidence,
    kills: list[Kill],
    scenarios: list[ScenarioRun],
    v: Violations,
    s: StepTally,
) -> None:
    for o in outcomes:
        if o.planned.workflow != "reviews" or o.job_id is None:
            continue
        s.accepted += 1
        s.plans[str(o.planned.event)] += 1
        _check_event_answers(o, e, v, s)
        row = e.jobs.get(o.job_id)
        if row is None or row.status not in ("done", "dead"):
            s.lost += 1  # check_jobs says so
            continue
        s.done += row.status == "done"
        s.dead += row.status == "dead"
        s.dead_scripted += row.status == "dead" and o.planned.doomed
        steps = e.checkpoints.get(o.job_id, [])
        reached = [(c.key, c.kind, c.status) for c in steps]
        expected = [(key, kind, "done") for key, kind in expected_steps(o.planned, row.status)]
        if reached != expected:
            v.add("steps_differ", f"{o.job_id} ({row.status}): {reached}")
            continue
        job = ReviewRun(o, row, {c.key: c for c in steps}, _windows(row, steps))
        _check_wait(job, e, v, s)
        _check_sleep(job, v, s)
        _check_review_result(job, e.results.get(o.job_id), v)
        _check_review_calls(job, e, kills, scenarios, v, s)
        _check_side_runs(job, e, kills, scenarios, v, s)


def _windows(row: JobRow, steps: list[CheckpointRow]) -> dict[str, tuple[float, float]]:
    windows, start = {}, row.created
    for c in steps:
        windows[c.key] = (start, c.stored)
        start = c.stored
    return windows


def _check_event_answers(o: Outcome, e: Evidence, v: Violations, s: StepTally) -> None:
    """Each send's final answer as its label wants it; the event stored if
    and only if one was accepted, and it is the first payload."""
    job_id, p = str(o.job_id), o.planned
    for send in o.events:
        s.events["sends"] += 1
        s.events["http_attempts"] += send.answer.attempts
        if send.answer.status is None:
            v.add("no_final_answer", f"{send.key} ({send.label}): {dict(send.answer.retried)}")
            continue
        s.answers[f"{send.label} {send.answer.status}"] += 1
        s.events["replayed"] += send.answer.replayed
        problem = _event_answer_problem(send, job_id)
        if problem:
            v.add("unexpected_event_answer", f"{send.key} ({send.label}): {problem}")
    bodies = {x.answer.body for x in o.events if x.label in ("first", "again")}
    if len(bodies) > 1:
        v.add("replay_not_identical", f"{p.key} approval: {sorted(bodies)}")
    stored = e.events.get(job_id)
    s.events["stored"] += stored is not None
    if any(x.answer.status == 202 for x in o.events) != (stored is not None):
        v.add("event_stored_unless_accepted", f"{job_id}: stored {stored}, sends {o.events}")
    if stored is not None and stored.payload != approval_of(p):
        v.add("stored_event_differs", f"{job_id}: {stored.payload}")


def _event_answer_problem(send: EventSend, job_id: str) -> str:
    answer = send.answer
    if send.label in ("first", "again"):
        received = {"job_id": job_id, "event": "approval", "status": "received"}
        with contextlib.suppress(ValueError):
            if answer.status == 202 and json.loads(answer.body) == received:
                return ""
    else:
        problem = "/event-already-received" if send.label == "conflict" else "/job-finished"
        if answer.status == 409 and problem_type(answer.body).endswith(problem):
            return ""
    return f"{answer.status} {answer.body[:200]!r}"


def _check_wait(job: ReviewRun, e: Evidence, v: Violations, s: StepTally) -> None:
    """The wait ended with the event if the event came in time (with
    RACE_S to spare: an event and the timeout at the same instant may go
    either way), never with an event that is not the job's."""
    wait, p = job.steps["approval"], job.outcome.planned
    _check_duration(job, wait, float(p.body["wait_s"]), v)
    s.waited += wait.stored > wait.created
    if wait.value is None:
        s.timed_out += 1
        s.timed_out_unplanned += p.event not in ("after", "never")
    event = e.events.get(job.job_id)
    if event is None:
        if wait.value is not None:
            v.add("wait_ended_with_no_event", f"{job.job_id}: {wait.value}")
        return
    if event.received <= wait.created:
        s.events["received_before_the_wait"] += 1
    elif wait.value is not None:
        s.events["received_while_waiting"] += 1
    in_time = event.received <= (wait.until or 0.0) - RACE_S
    if wait.value != event.payload and (wait.value is not None or in_time):
        after = event.received - wait.created
        v.add("wait_missed_its_event", f"{job.job_id}: {wait.value}, event {after:+.3f} s")


def _check_duration(job: ReviewRun, c: CheckpointRow, seconds: float, v: Violations) -> None:
    if c.until is None or abs(c.until - c.created - seconds) > 0.01:
        v.add("wait_of_another_length", f"{job.job_id} {c.key}: {c.until} for {seconds} s")


def _check_sleep(job: ReviewRun, v: Violations, s: StepTally) -> None:
    """A sleep ends at its time or after, never before."""
    p = job.outcome.planned
    if not p.sleeps:
        return
    s.sleeps += 1
    sleep = job.steps["sleep"]
    _check_duration(job, sleep, float(p.body["sleep_s"]), v)
    if sleep.until is None or sleep.finished is None:
        return
    late = sleep.finished - sleep.until
    s.sleep_late_s.append(late)
    if late < 0:
        v.add("sleep_ended_early", f"{job.job_id}: {-late:.3f} s early")


def _check_review_result(job: ReviewRun, result: dict[str, Any] | None, v: Violations) -> None:
    """A done review's result is made of its checkpoints' values."""
    if job.row.status != "done":
        if result is not None:
            v.add("result_of_a_dead_job", f"{job.job_id}: {result}")
        return
    steps = job.steps
    approval = steps["approval"].value if isinstance(steps["approval"].value, dict) else {}
    lookup = steps["lookup"].value if isinstance(steps["lookup"].value, dict) else {}
    expected = {
        "draft": steps["model"].value,
        "lookup": lookup.get("run"),
        "approved": approval.get("approved"),
        "by": approval.get("by"),
        "final": steps["model#2"].value,
    }
    if expected["final"] is KEPT_WITH_RESULT and result is not None:
        # Stored in the same statement as the result: nothing apart to compare.
        expected["final"] = result.get("final")
    if result != expected:
        v.add("result_differs_from_checkpoints", f"{job.job_id}: {result} != {expected}")


def _check_review_calls(
    job: ReviewRun,
    e: Evidence,
    kills: list[Kill],
    scenarios: list[ScenarioRun],
    v: Violations,
    s: StepTally,
) -> None:
    """Each model checkpoint's prompt billed once, each call beyond explained
    by what happened while that call was in flight."""
    index = job.outcome.planned.index
    for key, tag in REVIEW_CALLS.items():
        c = job.steps.get(key)
        if c is None:
            continue  # a scripted failure's last call
        records = e.step_prompts.get((index, tag), [])
        if len(records) > 1:
            v.add("model_call_prompt_changed", f"{job.job_id} {key}: {len(records)} prompts")
        prompt = _merged(records)
        useful = _useful_answers("reviews", prompt)
        s.prompts += 1
        s.billed += useful
        s.per_prompt[useful] += 1
        if useful == 0:
            v.add("checkpoint_without_billed_call", f"{job.job_id} {key}: {prompt}")
        elif prompt is not None and useful > 1:
            _blame_call(job, key, prompt, useful - 1, e, kills, scenarios, v, s)


def _merged(records: list[PromptRecord]) -> PromptRecord | None:
    if len(records) <= 1:
        return records[0] if records else None
    faults: collections.Counter[str] = collections.Counter()
    fault_ports: dict[str, tuple[int, ...]] = collections.defaultdict(tuple)
    for r in records:
        faults.update(r.faults)
        for kind, ports in r.fault_ports.items():
            fault_ports[kind] += ports
    return PromptRecord(
        sum(r.calls for r in records),
        sum(r.billed for r in records),
        tuple(port for r in records for port in r.billed_ports),
        dict(faults),
        dict(fault_ports),
    )


def _blame_call(
    job: ReviewRun,
    key: str,
    prompt: PromptRecord,
    excess: int,
    e: Evidence,
    kills: list[Kill],
    scenarios: list[ScenarioRun],
    v: Violations,
    s: StepTally,
) -> None:
    start, end = job.windows[key]
    in_flight = [k for k in kills if k.role == "worker" and start - KILL_REACH_S <= k.at <= end]
    killed = [k for k in in_flight if set(k.model_ports) & set(prompt.billed_ports)]
    attempts = int((job.steps[key].usage or {}).get("model_calls", 0))
    causes = {
        "worker_kill": len(killed),
        "client_timeout": _lost_in_delivery("reviews", prompt, attempts, in_flight),
        "stale_entry": _stale_entries(job.job_id, start, end, e, kills),
        **_window_causes(job.job_id, start, end, e, scenarios),
    }
    example = {"job_id": job.job_id, "call": key, "killed": sorted(k.name for k in killed)}
    s.calls.blame(excess, causes, v, "checkpointed_call_repeated", example)


def _stale_entries(job_id: str, start: float, end: float, e: Evidence, kills: list[Kill]) -> int:
    """Deliveries that ended at a wait or sleep before this call's window
    whose worker was killed just after (within KILL_REACH_S), before it
    could acknowledge the entry: the entry comes back after the claim idle
    time, and if the job runs again by then, both deliveries run it."""
    return sum(
        any(k.pid == pid and at <= k.at <= min(at + KILL_REACH_S, end) for k in kills)
        for pid, at in e.suspensions.get(job_id, [])
        if at <= start + KILL_REACH_S
    )


def _window_causes(
    job_id: str, start: float, end: float, e: Evidence, scenarios: list[ScenarioRun]
) -> dict[str, int]:
    """What happened to the job while one of its checkpoints was in flight
    that may cost it a second run of it: a lost lease (noticed late, so up
    to SCENARIO_REACH_S after), a redelivery, a reconcile, a scenario."""

    def logged(event: str, reach_s: float) -> int:
        times = e.log_times.get((event, job_id), [])
        return sum(start - KILL_REACH_S <= at <= end + reach_s for at in times)

    return {
        "lease_lost": logged("worker.lease_lost", SCENARIO_REACH_S),
        "redelivery": logged("job.deferred", KILL_REACH_S),
        "reconciled": logged("reconcile.requeued", KILL_REACH_S),
        "scenario": sum(
            sc.started - KILL_REACH_S <= end and start <= sc.ended + SCENARIO_REACH_S
            for sc in scenarios
        ),
    }


def _check_side_runs(
    job: ReviewRun,
    e: Evidence,
    kills: list[Kill],
    scenarios: list[ScenarioRun],
    v: Violations,
    s: StepTally,
) -> None:
    """The side step's kept run is among its runs; every other run started
    before the checkpoint was stored, and died with its worker or lost a
    race that something explains."""
    c, runs = job.steps["lookup"], e.side_runs.get(job.job_id, [])
    s.side_runs += len(runs)
    s.side_checkpoints += 1
    kept = c.value.get("run") if isinstance(c.value, dict) else None
    if not any(r.run == kept for r in runs):
        v.add("side_step_value_of_no_run", f"{job.job_id}: {c.value}, runs {runs}")
        return
    start, end = job.windows["lookup"]
    extra = [r for r in runs if r.run != kept]
    for r in extra:
        after = round(r.at - end, 3)
        s.latest_extra_run_s = max(after, s.latest_extra_run_s or after)
    late = [r for r in extra if r.at > end + RACE_S]
    for r in late:
        v.add("side_step_ran_after_checkpoint", f"{job.job_id}: pid {r.pid}, {r.at - end:.3f} s")
    if late:
        s.side.total += len(late)
        s.side.explained["ran_after_checkpoint"] += len(late)
    raced = [r for r in extra if r not in late]
    if not raced:
        return
    died = sum(
        any(k.pid == r.pid and r.at <= k.at <= end + KILL_REACH_S for k in kills) for r in raced
    )
    causes = {"worker_died": died, **_window_causes(job.job_id, start, end, e, scenarios)}
    example = {"job_id": job.job_id, "pids": [r.pid for r in raced]}
    s.side.blame(len(raced), causes, v, "side_step_repeated_unexplained", example)


def _check_review_effects(
    o: Outcome,
    row: JobRow,
    e: Evidence,
    effects: list[dict[str, Any]],
    outbox: list[OutboxRow],
    v: Violations,
    t: Tally,
) -> None:
    """Exactly the effects of the review's stored checkpoints, each once at
    the provider by its dedupe key, each from one sent outbox row, each
    the webhook its checkpoint's values make."""
    job_id = row.job_id
    expected = review_effects(row, e)
    t.effects_expected += len(expected)
    at_provider = collections.Counter(str(line["idempotency_key"]) for line in effects)
    for key in expected:
        n = at_provider[key]
        if n != 1:
            t.duplicate_effects += max(0, n - 1)
            v.add("duplicate_effects" if n else "missing_effect", f"{job_id}: {key} ×{n}")
    for key in sorted(at_provider.keys() - expected.keys()):
        t.duplicate_effects += at_provider[key]
        v.add("effect_without_checkpoint", f"{job_id}: {key} ×{at_provider[key]}")
    rows = sorted((r.dedupe_key, r.sent) for r in outbox)
    if rows != sorted((key, True) for key in expected):
        v.add("outbox_rows_not_one_sent_each", f"{job_id}: {rows}")
    for line in effects:
        data = expected.get(str(line["idempotency_key"]))
        problem = _webhook_problem(line, data) if data is not None else ""
        if problem:
            v.add("effect_differs_from_result", f"{job_id}: {problem}")


def review_effects(row: JobRow, e: Evidence) -> dict[str, dict[str, Any]]:
    """Dedupe key -> webhook data of the effects a finished review's rows make:
    the request for approval once its wait was stored, the decision once done."""
    job_id = row.job_id
    steps = {c.key: c for c in e.checkpoints.get(job_id, [])}
    expected: dict[str, dict[str, Any]] = {}
    if "approval" in steps and "model" in steps:
        draft = {"job_id": job_id, "draft": steps["model"].value}
        expected[f"{chaos_app.REVIEW_REQUESTED}:{job_id}"] = draft
    result = e.results.get(job_id)
    if row.status == "done" and result is not None:
        decided = {name: result.get(name) for name in ("approved", "by", "final")}
        expected[f"{chaos_app.REVIEW_DECIDED}:{job_id}"] = {"job_id": job_id, **decided}
    return expected


# The workflows whose jobs make one model call (the built-in ones).
ONE_CALL = ("summaries", "triage")
# The workflows whose model calls are counted by prompt: one call each, and
# the agent (a call per turn, all of one prompt).
MODEL_CHECKED = (*ONE_CALL, *AGENT_WORKFLOWS)


def check_model_calls(
    outcomes: list[Outcome],
    e: Evidence,
    kills: list[Kill],
    scenarios: list[ScenarioRun],
    v: Violations,
    t: Tally,
) -> None:
    worker_kills = [k for k in kills if k.role == "worker"]
    for o in outcomes:
        row = e.jobs.get(o.job_id or "")
        if row is None or row.status != "done" or o.planned.workflow not in MODEL_CHECKED:
            continue
        prompt = e.prompts.get(o.planned.index)
        useful = _useful_answers(o.planned.workflow, prompt)
        if o.planned.workflow in AGENT_WORKFLOWS:
            # An agent's turns share their prompt: one answer per turn stored.
            needed = sum(c.kind == "model" for c in e.checkpoints.get(row.job_id, []))
            t.agents.workflow = o.planned.workflow
            t.agents.done += 1
            t.agents.turns += needed
            t.agents.billed += useful
            excesses = t.agents.calls
        else:
            needed = 1
            t.one_call_done += 1
            t.one_call_calls += prompt.calls if prompt is not None else 0
            t.billed += useful
            excesses = t.calls
        if useful < needed or needed == 0:
            v.add("done_without_model_answer", f"{o.job_id}: {needed} needed, {prompt}")
            continue
        excess = useful - needed
        if excess <= 0:
            continue
        assert prompt is not None
        # Killed while the job was in flight (a kill after it was done cost
        # it nothing; one before it existed was another process on the port).
        in_flight = [k for k in worker_kills if row.created - KILL_REACH_S <= k.at <= row.updated]
        killed = {k for k in in_flight if set(k.model_ports) & set(prompt.billed_ports)}
        attempts = int((e.usage.get(row.job_id) or {}).get("model_calls", 0))
        lost = _lost_in_delivery(o.planned.workflow, prompt, attempts, in_flight, needed)
        causes = {
            "worker_kill": len(killed),
            "client_timeout": lost,
            **_other_causes(row, e.log_events, scenarios),
        }
        example = {"job_id": o.job_id, "killed": sorted(k.name for k in killed)}
        excesses.blame(excess, causes, v, "excess_model_calls_unexplained", example)
        t.explaining_kills.update(k.name for k in killed)


def _useful_answers(workflow: str, prompt: PromptRecord | None) -> int:
    """Answers a step could use: for a text answer (all but triage's) a
    ``badjson`` one is usable too."""
    if prompt is None:
        return 0
    bad = prompt.faults.get("badjson", 0) if workflow != "triage" else 0
    return prompt.billed + bad


def _lost_in_delivery(
    workflow: str, prompt: PromptRecord, attempts: int, killed: list[Kill], needed: int = 1
) -> int:
    """Billed answers the deliveries that stored the result paid for and
    never got (a call timed out first), at least: their attempts, less the
    faults the fake served this prompt that killed workers did not meet,
    less the ``needed`` answers they used."""
    still_answers = {"slow"} if workflow == "triage" else {"slow", "badjson"}
    dead_ports = {port for kill in killed for port in kill.model_ports}
    faults = sum(
        port not in dead_ports
        for kind, ports in prompt.fault_ports.items()
        if kind not in still_answers
        for port in ports
    )
    return max(0, attempts - faults - needed)


def _other_causes(
    row: JobRow, events: collections.Counter[tuple[str, str]], scenarios: list[ScenarioRun]
) -> dict[str, int]:
    """What else happened while the job was in flight that may cost a model call."""
    start, end = row.created, row.updated
    return {
        "lease_lost": events["worker.lease_lost", row.job_id],
        "redelivery": events["job.deferred", row.job_id],
        "reconciled": events["reconcile.requeued", row.job_id],
        "scenario": sum(
            s.started - KILL_REACH_S <= end and start <= s.ended + SCENARIO_REACH_S
            for s in scenarios
        ),
    }


# The workflows whose effects follow their checkpoints, not only their
# result: checked once the job ended, done or dead.
_STEPWISE_EFFECTS = {
    "reviews": _check_review_effects,
    **{name: _check_agent_effects for name in AGENT_WORKFLOWS},
}
