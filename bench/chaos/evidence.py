"""What the run left: the rows in PostgreSQL, the fakes' records, the side steps' runs,
the workers' logs."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import psycopg

from bench.chaos.common import MARKER, SIDE_CALLS_FILE, STEP_TAG
from bench.chaos.fleet import Deployment


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
