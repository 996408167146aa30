"""Operator commands: status, dead letters, the outbox. Tables on stdout via
rich, every stored text shown literally (``oncely.cli.terminal``); ``--json``
where a script wants to read the answer."""

from __future__ import annotations

import getpass
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any, Literal

from oncely.app import App
from oncely.bootstrap.clients import budgets, jobs_for, open_resources, shadow_streams
from oncely.bootstrap.configs import app_from
from oncely.cli.status import Clocks, read_clocks, read_status
from oncely.cli.terminal import console, literal, print_rows
from oncely.clock import SKEW_WARN_S
from oncely.jobs import dead_letters
from oncely.jobs.checkpoints import Cancelled, Checkpoints, EventOutcome, Rewound
from oncely.jobs.children import Children
from oncely.jobs.inspection import UNREPORTED_NOTE, JobInspection, inspect_job
from oncely.jobs.records import JobRecord
from oncely.jobs.schedules import Scheduler, scheduled
from oncely.jobs.store import Jobs
from oncely.live.events import JobEvents, LiveConfig
from oncely.llm.batches import BatchLines, BatchRow
from oncely.outbox.store import OutboxRow, OutboxStore
from oncely.settings import Settings
from oncely.shadow.report import VariantReport, build_report
from oncely.shadow.store import ShadowResults
from oncely.statuses import ROW_STATUSES
from oncely.usage import ledger
from oncely.usage.budgets import BudgetLimits, published_limits, utc_day
from oncely.views import waited_on

out = console()


@asynccontextmanager
async def _jobs(settings: Settings, workflows: list[str] | None = None) -> AsyncIterator[Jobs]:
    """The jobs stores, with a status change an operator makes told to the
    job's live stream, and a map child's end counted in its map
    (``oncely.jobs.transitions``), before the command ends."""
    app: App = app_from(settings, workflows)
    async with open_resources(settings) as res:
        jobs = jobs_for(app, res)
        events = JobEvents(res.redis, LiveConfig(settings.stream_maxlen, settings.stream_ttl_s))
        jobs.transitions.subscribe(events.status_changed)
        jobs.transitions.when_ended(Children(jobs).on_end)
        try:
            yield jobs
        finally:
            await events.drain()


async def show_status(settings: Settings, *, as_json: bool) -> None:
    app = app_from(settings)
    async with open_resources(settings) as res:
        jobs = jobs_for(app, res)
        clocks = await read_clocks(res.pool, res.redis, timeout_s=settings.pg_statement_timeout_s)
        status = await read_status(jobs, OutboxStore(jobs.pool), shadow_streams(app, res), clocks)
    if as_json:
        print(json.dumps(status.to_json(), indent=2))
        return
    statuses = ROW_STATUSES
    columns = ("workflow", "stream", "pending", "delayed", "dead letters", *statuses)
    rows: list[list[object]] = [
        [w.workflow, w.stream.length, w.stream.pending, w.stream.delayed, w.stream.dead_letters]
        + [w.jobs.get(k, 0) for k in statuses]
        for w in status.workflows
    ]
    for name, s in status.shadows.items():
        # Shadow runs have no job rows of their own (their results: `oncely eval report`).
        rows.append(
            [name, s.length, s.pending, s.delayed, s.dead_letters, *("-" for _ in statuses)]
        )
    print_rows(out, "oncely status", columns, rows)
    o = status.outbox
    oldest = "-" if o.oldest_unsent_age_s is None else f"{o.oldest_unsent_age_s:.1f} s"
    out.print(
        f"outbox: {o.unsent} unsent ({o.in_flight} in flight), {o.failed} failed, "
        f"oldest unsent {oldest}"
    )
    streams = [(w.workflow, w.stream) for w in status.workflows] + list(status.shadows.items())
    for name, stats in streams:
        for c in stats.consumers:
            out.print(
                f"consumer {name}/{literal(c.name)}: {c.pending} pending, idle {c.idle_ms} ms"
            )
    _print_clocks(status.clocks)


def _print_clocks(clocks: Clocks) -> None:
    """One line when every clock is in sync, else one warning per clock off."""
    warnings = clocks.warnings()
    for warning in warnings:
        out.print(f"warning: {literal(warning)}", style="yellow")
    if not warnings:
        out.print(
            f"clocks: this machine's and {len(clocks.processes)} running processes' "
            f"within {SKEW_WARN_S:.0f} s of PostgreSQL's"
        )


async def show_dead_letters(
    settings: Settings, *, limit: int, workflow: str | None, as_json: bool
) -> None:
    async with _jobs(settings, [workflow] if workflow else None) as jobs:
        letters = [
            letter
            for name in jobs.streams
            for letter in await dead_letters.list_dead(jobs, name, limit)
        ]
    if as_json:
        items = [
            {
                "workflow": d.workflow,
                "dead_id": d.dead_id,
                "job_id": d.job_id,
                "tenant": d.tenant,
                "reason": d.reason,
                "deliveries": d.deliveries,
                "dead_at": d.dead_at.isoformat(),
                "last_error": d.last_error,
            }
            for d in letters
        ]
        print(json.dumps(items, indent=2))
        return
    columns = (
        "workflow",
        "job (the dead letter's id)",
        "reason",
        "deliveries",
        "dead at",
        "last error",
    )
    rows = [
        (d.workflow, d.job_id, d.reason, d.deliveries, _when(d.dead_at), d.last_error)
        for d in letters
    ]
    title = f"dead letters ({len(letters)} shown, newest first per workflow)"
    print_rows(out, title, columns, rows, ids=2)


async def replay_dead_letters(
    settings: Settings, dead_id: str | None, *, workflow: str | None, dry_run: bool = False
) -> list[dict[str, str]]:
    """Replay one dead letter (or all); what was (or, dry, would be) replayed."""
    async with _jobs(settings, [workflow] if workflow else None) as jobs:
        if dead_id is None:
            if dry_run:
                return [
                    {"workflow": name, "dead_id": d.dead_id, "job_id": d.job_id}
                    for name in jobs.streams
                    for d in await dead_letters.list_dead(jobs, name, 100_000)
                ]
            return [
                {"workflow": name, "job_id": job_id}
                for name in jobs.streams
                for job_id in await dead_letters.replay_all(jobs, name)
            ]
        job = await dead_letters.replay(jobs, workflow, dead_id)
        return [] if job is None else [{"workflow": job.kind, "job_id": job.job_id}]


async def show_outbox(
    settings: Settings, *, failed_only: bool, limit: int, as_json: bool = False
) -> None:
    async with open_resources(settings) as res:
        rows = await OutboxStore(res.pool).list(failed_only=failed_only, limit=limit)
    if as_json:
        fields = ("id", "topic", "dedupe_key", "attempts", "last_error", "age_s")
        items = [{f: getattr(r, f) for f in fields} | {"state": _state(r)} for r in rows]
        print(json.dumps(items, indent=2))
        return
    title = "failed outbox rows" if failed_only else "unsent outbox rows"
    columns = ("id", "dedupe key", "topic", "attempts", "state", "last error")
    cells = [(r.id, r.dedupe_key, r.topic, r.attempts, _state(r), r.last_error or "") for r in rows]
    print_rows(out, f"{title} ({len(rows)} shown)", columns, cells, ids=2)


def _state(row: OutboxRow) -> str:
    if row.failed_at is not None:
        return "failed"
    if row.locked_until is not None and row.locked_until.timestamp() > time.time():
        return "sending"
    return "waiting"


async def show_schedules(settings: Settings, *, as_json: bool = False) -> None:
    """Every scheduled workflow of the app: its timetable, last and next tick."""
    app = app_from(settings)
    async with open_resources(settings) as res:
        states = await Scheduler(jobs_for(app, res), scheduled(app)).states()
    if as_json:
        items = [
            {
                "workflow": st.workflow,
                "schedule": st.expression,
                "tz": st.tz,
                "last_tick": st.last_tick.isoformat() if st.last_tick else None,
                "last_job_id": st.last_job_id,
                "next_tick": st.next_tick.isoformat(),
            }
            for st in states
        ]
        print(json.dumps(items, indent=2))
        return
    columns = ("workflow", "schedule", "tz", "last tick", "last job", "next tick")
    cells = [
        (
            st.workflow,
            st.expression,
            st.tz,
            # A schedule seen but never run starts from the tick before it was seen.
            st.last_tick.isoformat() if st.last_tick and st.last_job_id else "none yet",
            st.last_job_id or "",
            st.next_tick.isoformat(),
        )
        for st in states
    ]
    print_rows(out, f"schedules ({len(states)})", columns, cells, ids=1)


async def retry_outbox(
    settings: Settings, row_id: int | None, *, dry_run: bool = False
) -> list[int]:
    """Failed rows back to sending: one, or all; their ids (dry: would be)."""
    async with open_resources(settings) as res:
        store = OutboxStore(res.pool)
        if row_id is None:
            if dry_run:
                return [r.id for r in await store.list(failed_only=True, limit=1_000_000)]
            return await store.retry_all_failed()
        return [row_id] if await store.retry(row_id) else []


async def show_job(
    settings: Settings, job_id: uuid.UUID, *, workflow: str | None, as_json: bool
) -> bool:
    """One job in detail (of any workflow unless named); False if there is none."""
    async with _jobs(settings, [workflow] if workflow else None) as jobs:
        view = await inspect_job(jobs, OutboxStore(jobs.pool), workflow, job_id)
    if view is None:
        return False
    if as_json:
        print(json.dumps(view.to_json(), indent=2, default=str))
        return True
    _print_job(view)
    return True


def _print_job(view: JobInspection) -> None:
    j = view.job
    out.print(f"{j.kind} job {j.job_id}: {view.status} (tenant {literal(j.tenant)})")
    out.print(f"created {_when(j.created_at)}, updated {_when(j.updated_at)}")
    out.print(f"request: {_json(j.payload)}", soft_wrap=True)
    if j.result is not None:
        out.print(f"result: {_json(j.result)}", soft_wrap=True)
    if view.usage is not None:
        out.print(f"usage: {_json(view.usage)}")
    if j.error:
        out.print(f"error: {literal(j.error)}", soft_wrap=True)
    if j.status == "waiting" and j.wait_until is not None:
        out.print(f"waiting for {literal(waited_on(j))} until {_when(j.wait_until)}")
    if j.parent_id is not None:
        out.print(f"a child of job {j.parent_id}")
    for m in view.maps:
        counts = ", ".join(f"{n} {what}" for what, n in m.to_json().items() if what != "total")
        state = "ended" if m.finished else "running"
        out.print(
            f"map {literal(m.key)} ({state}): {m.total} child jobs of {literal(m.workflow)}:"
            f" {counts} (oncely jobs list --parent {j.job_id})"
        )
    _print_checkpoints(view)
    columns = ("#", "outcome", "started", "finished", "model calls", "consumer", "error")
    rows = [
        (
            d.delivery,
            d.outcome,
            _when(d.started_at),
            _when(d.finished_at),
            d.model_calls,
            d.consumer,
            d.error or "",
        )
        for d in view.deliveries
    ]
    print_rows(out, f"deliveries ({len(view.deliveries)})", columns, rows, ids=2)
    message = view.to_json()["message"]
    out.print("message now: " + ("unknown" if message is None else _json(message)))
    out.print(UNREPORTED_NOTE)
    for r in view.outbox:
        state = "sent" if r.sent_at else _state(r)
        out.print(
            f"outbox row {r.id} {literal(r.topic)} {literal(r.dedupe_key)}: "
            f"{state}, {r.attempts} attempt(s)"
        )


def _json(value: object) -> str:
    """JSON as stored (non-ASCII kept), with hidden characters escaped."""
    return literal(json.dumps(value, ensure_ascii=False, default=str))


def _print_checkpoints(view: JobInspection) -> None:
    """Each checkpoint on its own lines (values can be long): ordinal, key,
    kind and status, when it finished, what it spent, then its value."""
    out.print(f"checkpoints ({len(view.checkpoints)}):")
    for c in view.checkpoints:
        when = _when(c.finished_at) if c.finished_at else f"until {_when(c.until)}"
        spent = f", usage {_json(c.usage)}" if c.usage else ""
        out.print(f"  {c.ordinal}. {literal(c.key)} ({c.kind}, {c.status}, {when}{spent})")
        if c.with_result:
            out.print("     (kept with the result: what came of it is there)")
        elif c.status == "done":
            out.print(f"     {_json(c.value)}", soft_wrap=True)


async def cancel_job(
    settings: Settings, job_id: uuid.UUID, *, workflow: str | None
) -> Cancelled | None:
    """Cancel a queued, running or waiting job (of any workflow unless
    named); what it was, or None if there is no such job."""
    async with _jobs(settings, [workflow] if workflow else None) as jobs:
        return await Checkpoints(jobs).cancel(job_id, kind=workflow)


async def decide_call(
    settings: Settings,
    job_id: uuid.UUID,
    call_id: str,
    decision: dict[str, Any],
    *,
    on: Literal["approval", "uncertain"] = "approval",
) -> EventOutcome | None:
    """A person's decision on a call the job waits on (an approval, or the
    word on an uncertain call), as the API takes it
    (``oncely.api.approvals``): stored, and the job queued again. None: no
    such job."""
    from oncely.jobs.approvals import ArgumentsRefused, decide, edited_arguments_errors

    async with _jobs(settings) as jobs:
        checkpoints = Checkpoints(jobs)
        edited = decision.get("arguments")
        if isinstance(edited, dict):
            # Checked as the API checks them (a 422 there).
            job = await jobs.detail(None, job_id)
            app = app_from(settings)
            if job is not None and job.kind in app.names:
                errors = await edited_arguments_errors(
                    app[job.kind], checkpoints, job_id, job.tenant, call_id, edited
                )
                if errors:
                    raise ArgumentsRefused(errors)
        by = f"cli:{getpass.getuser()}"
        outcome = await decide(checkpoints, job_id, call_id, decision, by=by, on=on)
        if outcome is not None and outcome.resumed is not None:
            await jobs.restore(outcome.resumed)
        return outcome


async def list_jobs(
    settings: Settings,
    *,
    workflow: str | None,
    status: str | None,
    reason: str | None,
    limit: int,
    parent: uuid.UUID | None = None,
) -> list[JobRecord]:
    """Jobs newest first, as ``oncely jobs list`` shows them."""
    async with _jobs(settings, [workflow] if workflow else None) as jobs:
        return await jobs.recent(workflow, status, limit, reason, parent=parent)


def print_jobs(found: list[JobRecord], *, as_json: bool) -> None:
    """``oncely jobs list``'s table (or JSON)."""
    if as_json:
        rows = [
            {
                "job_id": str(j.job_id),
                "workflow": j.kind,
                "tenant": j.tenant,
                "status": j.status,
                "error": j.error,
                "updated_at": j.updated_at.isoformat(),
            }
            for j in found
        ]
        print(json.dumps(rows, indent=2))
        return
    columns = ("job", "workflow", "tenant", "status", "updated", "error")
    shown = [
        (str(j.job_id), j.kind, j.tenant, j.status, _when(j.updated_at), j.error or "")
        for j in found
    ]
    print_rows(out, "jobs", columns, shown, ids=1)


# Where a nondeterministic job's error names the checkpoint its stored run has.
_STORED_KEY = re.compile(r"where the stored run has '([^']+)'")


async def rewind_nondeterministic(
    settings: Settings, *, limit: int, dry_run: bool
) -> list[tuple[str, str, Rewound | None]]:
    """Every job dead as ``nondeterministic`` rerun from its first checkpoint
    that no longer matches the code (the matching ones before are kept: a
    deploy that changed a step without ``ctx.patched``): (job, key, what the
    rewind did; None on a dry run)."""
    async with _jobs(settings) as jobs:
        dead = await jobs.recent(None, "dead", limit, "nondeterministic")
        done: list[tuple[str, str, Rewound | None]] = []
        for job in dead:
            found = _STORED_KEY.search(job.error or "")
            if found is None:
                continue
            key = found.group(1)
            rewound = None if dry_run else await Checkpoints(jobs).rewind(job.job_id, key)
            done.append((str(job.job_id), key, rewound))
        return done


async def rewind_job(settings: Settings, job_id: uuid.UUID, key: str) -> Rewound | None:
    """Run a dead or cancelled job again from checkpoint ``key``; None if
    there is no such job."""
    async with _jobs(settings) as jobs:
        return await Checkpoints(jobs).rewind(job_id, key)


async def checkpoint_keys(settings: Settings, job_id: uuid.UUID) -> list[str]:
    async with _jobs(settings) as jobs:
        return [c.key for c in await Checkpoints(jobs).of_job(job_id, values=False)]


async def erase_tenant(settings: Settings, tenant: str) -> dict[str, int]:
    """Right to erasure: the tenant's jobs, results and outbox rows first (so a
    step still running writes nothing), then its messages in every stream,
    delayed set and dead-letter stream, its idempotency records, then its API
    keys."""
    from oncely.api.auth import announce_revocation, erase_tenant_api_keys
    from oncely.api.store import IdempotencyStore

    async with open_resources(settings) as res:
        jobs = jobs_for(app_from(settings), res)
        counts = await jobs.erase_tenant(tenant)
        # Shadow streams too: their messages carry the tenant's requests.
        streams = [*jobs.streams.values(), *shadow_streams(app_from(settings), res).values()]
        counts["messages"] = sum([await s.erase_tenant(tenant) for s in streams])
        records = IdempotencyStore(res.redis, lock_ttl_s=1, result_ttl_s=1)
        counts["idempotency_records"] = await records.erase_tenant(tenant)
        counts["api_keys"] = await erase_tenant_api_keys(res.pool, tenant)
        counts["model_calls"] = await ledger.erase_tenant(res.pool, tenant)
        await announce_revocation(res.redis)
    return counts


async def create_key(settings: Settings, tenant: str) -> tuple[str, str]:
    """(the secret, its id)."""
    from oncely.api.auth import create_api_key_with_id

    async with open_resources(settings) as res:
        return await create_api_key_with_id(res.pool, tenant)


async def revoke_key(settings: Settings, *, key: str | None, key_id: str | None) -> str | None:
    """Revoke by secret or by id; the tenant, or None if no such active key."""
    from oncely.api.auth import announce_revocation, revoke_api_key, revoke_api_key_by_id

    async with open_resources(settings) as res:
        if key_id is not None:
            tenant = await revoke_api_key_by_id(res.pool, key_id)
        else:
            assert key is not None
            tenant = await revoke_api_key(res.pool, key)
        if tenant is not None:
            await announce_revocation(res.redis)
        return tenant


async def show_keys(settings: Settings, *, tenant: str | None, as_json: bool) -> None:
    from oncely.api.auth import list_api_keys

    async with open_resources(settings) as res:
        keys = await list_api_keys(res.pool, tenant)
    if as_json:
        print(json.dumps([asdict(k) for k in keys], indent=2, default=str))
        return
    columns = ("id", "tenant", "created", "last used", "revoked")
    rows = [
        (k.id, k.tenant, _when(k.created_at), _when(k.last_used_at), _when(k.revoked_at))
        for k in keys
    ]
    print_rows(out, f"API keys ({len(keys)})", columns, rows, ids=2)


def _when(moment: datetime | None) -> str:
    return "-" if moment is None else moment.astimezone(UTC).isoformat(timespec="seconds")


async def eval_reports(
    settings: Settings, workflow: str, variant: str | None, since: datetime
) -> list[VariantReport]:
    """The shadow report of ``workflow``, per variant (only ``variant`` if given)."""
    async with open_resources(settings) as res:
        store = ShadowResults(res.pool, statement_timeout_s=settings.pg_statement_timeout_s)
        return await build_report(store, workflow, variant, since)


def print_eval_report(
    reports: list[VariantReport], *, workflow: str, variant: str | None = None, as_json: bool
) -> None:
    if as_json:
        print(
            json.dumps({"workflow": workflow, "variants": [r.to_json() for r in reports]}, indent=2)
        )
        return
    if not reports:
        which = f" of variant {literal(variant)}" if variant is not None else ""
        out.print(f"no shadow runs{which} stored for {literal(workflow)} (in the period asked)")
        return
    for r in reports:
        out.print(
            f"{literal(r.workflow)} / {literal(r.variant)}: {r.pairs} pairs compared, "
            f"{r.runs} shadow runs, {r.errors} errors ({r.error_rate:.1%})",
            style="bold",
        )
        out.print(f"agreement {_maybe(r.agreement)}")
        if r.fields:
            fields = [(name, f"{mean:.3f}") for name, mean in r.fields.items()]
            print_rows(out, "agreement per field", ("field", "agreement"), fields)
        out.print("scores: " + ", ".join(f"{k}: {n}" for k, n in r.scores.items()))
        costs = []
        for key, label in (
            ("tokens", "tokens"),
            ("model_calls", "model calls"),
            ("model_ms", "model time (ms)"),
        ):
            p, s = r.primary[key], r.shadow[key]
            delta = None if p is None or s is None else s - p
            costs.append((label, _maybe(p, ".1f"), _maybe(s, ".1f"), _maybe(delta, "+.1f")))
        print_rows(out, "per job (pairs)", ("", "primary", "shadow", "delta"), costs)
        out.print(f"cost ratio {_maybe(r.cost_ratio)}, latency ratio {_maybe(r.latency_ratio)}")
        for error, n in r.top_errors:
            out.print(f"error x{n}: {literal(error)}", soft_wrap=True)


def _maybe(value: float | None, spec: str = ".3f") -> str:
    return "n/a" if value is None else format(value, spec)


# -- usage -------------------------------------------------------------------------


async def usage_report(
    settings: Settings, *, since: datetime, by: ledger.GroupBy, as_json: bool
) -> list[ledger.UsageRow]:
    """``oncely usage report``: the ledger's calls since ``since``, grouped ``by``."""
    async with open_resources(settings) as res:
        rows = await ledger.usage_report(res.pool, since=since, by=by)
    if as_json:
        print(json.dumps([row.to_json(by) for row in rows], indent=2))
        return rows
    columns = (
        by,
        "calls",
        "prompt tokens",
        "completion tokens",
        "cache reads",
        "cache writes",
        "cost (USD)",
        "cache saved (USD)",
        "lane saved (USD)",
        "wasted calls",
    )
    cells = [
        (
            r.group,
            r.calls,
            r.prompt_tokens,
            r.completion_tokens,
            r.cached_tokens,
            r.cache_write_tokens,
            _usd(r.cost_usd),
            _usd(r.cache_saved_usd),
            _usd(r.lane_saved_usd),
            r.wasted_calls,
        )
        for r in rows
    ]
    title = f"model calls since {since.astimezone(UTC):%Y-%m-%d %H:%M} UTC, by {by}"
    print_rows(out, title, columns, cells, ids=1)
    return rows


async def show_batches(
    settings: Settings,
    *,
    batch_id: str | None = None,
    limit: int = 50,
    as_json: bool = False,
) -> list[BatchRow]:
    """``oncely batches list|show``: the batch lane's batches, newest first
    (docs/lanes.md); one of them by its oncely id, with its lines' jobs."""
    async with open_resources(settings) as res:
        store = BatchLines(res.pool)
        rows = await store.batches(batch_id, limit=limit)
        lines = await store.lines_of(batch_id) if batch_id is not None and rows else []
    if batch_id is not None and not rows:
        return rows
    if not rows and not as_json:
        out.print("no batches yet: a call on the batch lane makes one (docs/lanes.md)")
        return rows
    if as_json:
        items = [row.to_json() for row in rows]
        if batch_id is not None:
            items[0]["lines"] = [line.to_json() for line in lines]
        print(json.dumps(items[0] if batch_id is not None else items, indent=2))
        return rows
    columns = ("batch", "provider id", "status", "model", "dialect", "lines", "answered",
               "failed", "jobs waiting", "created")  # fmt: skip
    cells = [
        (r.batch_id, r.provider_id or "(not recorded)", r.status, r.model, r.dialect, r.lines,
         r.answered, r.failed, r.waiting, f"{r.created_at.astimezone(UTC):%Y-%m-%d %H:%M:%S}")
        for r in rows
    ]  # fmt: skip
    print_rows(out, "batch-lane batches, newest first", columns, cells, ids=2)
    if lines:
        named = [(line.custom_id, line.job_id, line.key, line.status) for line in lines]
        print_rows(out, "its lines", ("custom id", "job", "call", "status"), named, ids=2)
    return rows


async def tenant_usage(settings: Settings, tenant: str, *, as_json: bool) -> dict[str, object]:
    """``oncely tenants usage``: today's spend (UTC), as the budgets count it
    and as the ledger has it, against the tenant's budgets."""
    day = utc_day()
    midnight = datetime.strptime(day, "%Y-%m-%d").replace(tzinfo=UTC)
    async with open_resources(settings) as res:
        counting = budgets(settings, res.redis)
        counted = await counting.spent(tenant, day)
        reserved = await counting.reserved(tenant, day)
        rows = await ledger.usage_report(res.pool, since=midnight, by="tenant", tenant=tenant)
        # The budgets set here, else those the API said it enforces.
        limits = counting.limits if counting.limits.enabled else None
        limits = limits or await published_limits(res.redis) or BudgetLimits()
    booked = rows[0] if rows else ledger.UsageRow(tenant, 0, 0, 0, None, 0)
    report: dict[str, object] = {
        "tenant": tenant,
        "day": day,
        "tokens": counted.tokens,
        "cost_usd": round(counted.usd, 10),
        "reserved_tokens": reserved,
        "daily_tokens": limits.daily_tokens or None,
        "daily_usd": limits.daily_usd or None,
        "over_budget": limits.exceeded_by(counted),
        "ledger": booked.to_json("tenant") | {"tenant": tenant},
    }
    if as_json:
        print(json.dumps(report, indent=2))
        return report
    columns = ("", "tokens", "cost (USD)", "calls", "wasted calls")
    cells = [
        ("today, counted for budgets", counted.tokens, _usd(counted.usd), "", ""),
        (
            "today, in the ledger",
            booked.prompt_tokens + booked.completion_tokens,
            _usd(booked.cost_usd),
            booked.calls,
            booked.wasted_calls,
        ),
        ("today, reserved for accepted jobs", reserved, "", "", ""),
        (
            "daily budget",
            limits.daily_tokens or "none",
            _usd(limits.daily_usd) if limits.daily_usd else "none",
            "",
            "",
        ),
    ]
    print_rows(out, f"tenant {tenant} on {day} (UTC)", columns, cells)
    if report["over_budget"]:
        out.print("over budget: new jobs are refused (429) until midnight UTC")
    return report


def _usd(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.6f}"
