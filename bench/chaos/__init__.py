"""The chaos soak: every failure at once, then every invariant checked.

(In parts: ``plan`` the requests from the seed, ``traffic`` the clients,
``fleet`` the processes, kills and scenarios, ``evidence`` what the run left,
``checks`` the invariants, ``report`` the JSON, ``run`` the whole; ``common``
what they share.)

Starts a private embedded PostgreSQL and Valkey, the fake model and the fake
mail/webhook provider with random faults (``oncely fake-llm --faults …``,
``oncely fake-mail --faults …``), one ``oncely api``, three ``oncely worker``
and two ``oncely relay`` processes, all configured through documented
``ONCELY_*`` settings only, serving ``--app`` (default
``bench.chaos_app:app``: the two built-in workflows and ``reviews``, a
multi-step one). Then, all at once:

- clients send ``--requests`` requests over the app's workflows
  (``/v1/summaries``, ``/v1/triage``, ``/v1/reviews``), each 1–3 times:
  sequential retries, concurrent duplicates, delayed retries; some reuse
  their key with another body (must be 422), some are scripted to fail
  permanently (``[[fake:400]]`` in the text, or for a review in its final
  model call only, after its wait: must end ``dead``). Clients behave well:
  409 (a key in progress), 429, 5xx and connection errors are retried with
  the same key until the request is accepted;
- for each review the client plays its part in the review's wait for an
  ``approval`` event: sends it at once (before the job reaches its wait,
  mostly), once the job is seen ``waiting``, twice at once with one key,
  then once more with another payload (must be 409
  ``event-already-received``), never (the wait times out), or only after
  the job is finished (must be 409 ``job-finished``); some reviews also
  sleep a few seconds after their wait;
- every ``--kill-every`` seconds a random worker or relay (with
  ``--kill-api``, the API too) gets SIGKILL, and a replacement starts; any
  process that exits by itself is restarted and reported;
- the ``--scenarios``, one after another, spread over the load: ``flushall``
  (Redis FLUSHALL), ``redis-restart`` (Redis restarted empty),
  ``pg-restart`` (PostgreSQL restarted), ``redis-freeze`` (Redis SIGSTOPped
  for ``--freeze-s``, then SIGCONT).

It then waits (at most ``--drain-timeout``) until nothing is queued,
waiting, pending, delayed or unsent, checks the invariants (docs/chaos.md: "What it
promises") against PostgreSQL (jobs, results, outbox, checkpoints, events),
the fake provider's mailbox, the fake model's call counts and the side
steps' own record, and prints one JSON report on stdout (progress goes to
stderr). Exit status 1 on any violation, 2 on a usage error.

    .venv/bin/python -m bench.chaos --requests 2000 --kill-every 2 --scenarios all --seed 1
    .venv/bin/python -m bench.chaos --requests 200 --scenarios redis-restart --seed 7

A run is reproducible in what it does, not in how it interleaves: the seed
fixes every request (workflow, body, key, pattern, scripted fate, the
review's event, wait and sleep), the fault each model call and each send
meets (by prompt or key and call number), the kill victims and the
scenarios' order; the timing is the machine's.

Model calls. The fake model counts per prompt the calls it *billed*:
those that generated the real answer, whether or not the caller stayed to
read it (for a text answer a ``badjson`` one is usable too, so it counts).
Each model call of a job has a prompt of its own (a summary's or a
ticket's one call; a review's ``[step=draft]`` and ``[step=final]``
calls). A call needs one; each one more is an *excess* call, and must be
explained by what happened while the call was in flight: its worker killed
(the fake names the client port each billed call came from, and the runner
notes the ports a worker holds to the model when it kills it); a client
timeout inside the delivery that stored the answer (its ``model_calls``
counts more attempts than the faults the fake served, and a delivery asks
again after a billed answer only when that answer did not reach it in
time); a lease lost or a redelivery after a transient failure (the
workers' logs name the job); or a scenario (a store that failed, a message
Redis forgot). At most one excess call per call per such event; the rest is
a violation. For a review every model call is a checkpoint, and "in
flight" ends when its checkpoint was stored: a kill, a log line or a
scenario after that explains nothing, so a replay that paid for a stored
call again is caught even in a job that met other trouble later. One more
cause is a review's own: a stale entry (the worker of the delivery that
began the job's wait killed before it acknowledged its entry, which came
back while the resumed job ran: two deliveries at once).

Side steps. A review's ``lookup`` step notes each run in a file (job, run
token, process, start time); its checkpoint names the run whose value was
kept. Every other run must have started before that checkpoint was stored
(a run that could not see it yet) and be explained: its process was
SIGKILLed after it started (it died mid-step), or a lease lost, a
redelivery, a reconcile or a scenario while the step was in flight.
"""

from __future__ import annotations

from bench.chaos.checks import (
    ONE_CALL,
    Excess,
    ReviewRun,
    StepTally,
    Tally,
    Violations,
    check_effects,
    check_intake,
    check_jobs,
    check_model_calls,
    check_reviews,
    expected_steps,
    review_effects,
)
from bench.chaos.common import (
    DEFAULT_APP,
    DEFAULT_MAIL_FAULTS,
    DEFAULT_MODEL_FAULTS,
    DOOMED_SHARE,
    EVENT_PLANS,
    EVENT_WAIT_S,
    EVENT_WEIGHTS,
    FLEET_SETTINGS,
    KILL_REACH_S,
    KNOWN_WORKFLOWS,
    MARKER,
    PATTERN_WEIGHTS,
    PATTERNS,
    POLL_S,
    RACE_S,
    REUSE_SHARE,
    REVIEW_CALLS,
    ROUTES,
    SCENARIO_REACH_S,
    SCENARIOS,
    SENTENCES,
    SENTINEL,
    SIDE_CALLS_FILE,
    SLEEP_SHARE,
    STEP_TAG,
    SUBJECTS,
    TENANTS,
    WEBHOOK_SECRET,
    say,
)
from bench.chaos.evidence import (
    EXPLAINING_EVENTS,
    KEPT_WITH_RESULT,
    CheckpointRow,
    EventRow,
    Evidence,
    JobRow,
    OutboxRow,
    PromptRecord,
    SideRun,
    consumer_pid,
    count_log_events,
    gather_evidence,
    log_events,
    side_runs,
)
from bench.chaos.fleet import (
    FAKES,
    Child,
    Deployment,
    Exit,
    Fleet,
    Kill,
    ScenarioRun,
    Servers,
    backlog,
    drain,
    kill_loop,
    run_scenarios,
    settled,
    supervise,
    wait_http,
)
from bench.chaos.plan import (
    Clock,
    Options,
    Planned,
    approval_of,
    conflicting_approval_of,
    parse_options,
    plan,
    served,
)
from bench.chaos.report import report
from bench.chaos.run import deploy, main, run, run_directory, run_until_stopped, soak
from bench.chaos.traffic import (
    FINAL_CONFLICTS,
    FINISHED,
    Answer,
    Client,
    EventSend,
    Outcome,
    problem_type,
    send_all,
)

__all__ = [
    "DEFAULT_APP",
    "DEFAULT_MAIL_FAULTS",
    "DEFAULT_MODEL_FAULTS",
    "DOOMED_SHARE",
    "EVENT_PLANS",
    "EVENT_WAIT_S",
    "EVENT_WEIGHTS",
    "EXPLAINING_EVENTS",
    "FAKES",
    "FINAL_CONFLICTS",
    "FINISHED",
    "FLEET_SETTINGS",
    "KEPT_WITH_RESULT",
    "KILL_REACH_S",
    "KNOWN_WORKFLOWS",
    "MARKER",
    "ONE_CALL",
    "PATTERNS",
    "PATTERN_WEIGHTS",
    "POLL_S",
    "RACE_S",
    "REUSE_SHARE",
    "REVIEW_CALLS",
    "ROUTES",
    "SCENARIOS",
    "SCENARIO_REACH_S",
    "SENTENCES",
    "SENTINEL",
    "SIDE_CALLS_FILE",
    "SLEEP_SHARE",
    "STEP_TAG",
    "SUBJECTS",
    "TENANTS",
    "WEBHOOK_SECRET",
    "Answer",
    "CheckpointRow",
    "Child",
    "Client",
    "Clock",
    "Deployment",
    "EventRow",
    "EventSend",
    "Evidence",
    "Excess",
    "Exit",
    "Fleet",
    "JobRow",
    "Kill",
    "Options",
    "OutboxRow",
    "Outcome",
    "Planned",
    "PromptRecord",
    "ReviewRun",
    "ScenarioRun",
    "Servers",
    "SideRun",
    "StepTally",
    "Tally",
    "Violations",
    "approval_of",
    "backlog",
    "check_effects",
    "check_intake",
    "check_jobs",
    "check_model_calls",
    "check_reviews",
    "conflicting_approval_of",
    "consumer_pid",
    "count_log_events",
    "deploy",
    "drain",
    "expected_steps",
    "gather_evidence",
    "kill_loop",
    "log_events",
    "main",
    "parse_options",
    "plan",
    "problem_type",
    "report",
    "review_effects",
    "run",
    "run_directory",
    "run_scenarios",
    "run_until_stopped",
    "say",
    "send_all",
    "served",
    "settled",
    "side_runs",
    "soak",
    "supervise",
    "wait_http",
]
