"""Operator commands: status, dead letters, the outbox. Tables on stdout via
rich; ``--json`` where a script wants to read the answer."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict
from datetime import UTC, datetime

from rich.console import Console
from rich.table import Table

from oncely.app import App
from oncely.bootstrap import app_from, jobs_for, open_resources
from oncely.jobs import dead_letters
from oncely.jobs.store import Jobs
from oncely.outbox.store import OutboxStore
from oncely.settings import Settings
from oncely.status import read_status

out = Console()


@asynccontextmanager
async def _jobs(settings: Settings, workflows: list[str] | None = None) -> AsyncIterator[Jobs]:
    app: App = app_from(settings, workflows)
    async with open_resources(settings) as res:
        yield jobs_for(app, res)


async def show_status(settings: Settings, *, as_json: bool) -> None:
    async with _jobs(settings) as jobs:
        status = await read_status(jobs, OutboxStore(jobs.pool))
    if as_json:
        print(json.dumps(status.to_json(), indent=2))
        return
    table = Table(title="oncely status")
    columns = ("workflow", "stream", "pending", "delayed", "dead letters", "queued", "done", "dead")
    for column in columns:
        table.add_column(column)
    for w in status.workflows:
        s, j = w.stream, w.jobs
        table.add_row(
            w.workflow,
            *(str(n) for n in (s.length, s.pending, s.delayed, s.dead_letters)),
            *(str(j.get(k, 0)) for k in ("queued", "done", "dead")),
        )
    out.print(table)
    o = status.outbox
    oldest = "-" if o.oldest_unsent_age_s is None else f"{o.oldest_unsent_age_s:.1f} s"
    out.print(
        f"outbox: {o.unsent} unsent ({o.in_flight} in flight), {o.failed} failed, "
        f"oldest unsent {oldest}"
    )
    for w in status.workflows:
        for c in w.stream.consumers:
            out.print(f"consumer {w.workflow}/{c.name}: {c.pending} pending, idle {c.idle_ms} ms")


async def show_dead_letters(
    settings: Settings, *, limit: int, workflow: str | None, as_json: bool
) -> None:
    async with _jobs(settings, [workflow] if workflow else None) as jobs:
        letters = [
            (name, letter)
            for name in jobs.streams
            for letter in await dead_letters.list_dead(jobs, name, limit)
        ]
    if as_json:
        rows = [
            {"workflow": name, **{k: v for k, v in asdict(d).items() if k != "fields"}}
            for name, d in letters
        ]
        print(json.dumps(rows, indent=2))
        return
    table = Table(title=f"dead letters ({len(letters)} shown, newest first per workflow)")
    for column in ("workflow", "id", "job"):
        table.add_column(column, no_wrap=True)
    for column in ("reason", "deliveries", "dead at", "last error"):
        table.add_column(column, overflow="fold")
    for name, d in letters:
        dead_at = datetime.fromtimestamp(d.dead_at, UTC).isoformat(timespec="seconds")
        table.add_row(name, d.dead_id, d.job_id, d.reason, str(d.deliveries), dead_at, d.last_error)
    out.print(table)


class AmbiguousDeadLetter(Exception):
    """The same dead-letter id exists in several workflows."""


async def replay_dead_letters(
    settings: Settings, dead_id: str | None, *, workflow: str | None
) -> int:
    async with _jobs(settings, [workflow] if workflow else None) as jobs:
        if dead_id is None:
            return sum([len(await dead_letters.replay_all(jobs, name)) for name in jobs.streams])
        owners = [
            name
            for name, stream in jobs.streams.items()
            if await stream.dead_letter_by_id(dead_id) is not None
        ]
        if len(owners) > 1:
            raise AmbiguousDeadLetter(f"{dead_id} is a dead letter of {owners}; add --workflow")
        if not owners:
            return 0
        return 0 if await dead_letters.replay(jobs, owners[0], dead_id) is None else 1


async def show_outbox(settings: Settings, *, failed_only: bool, limit: int) -> None:
    async with open_resources(settings) as res:
        rows = await OutboxStore(res.pool).list(failed_only=failed_only, limit=limit)
    title = "failed outbox rows" if failed_only else "unsent outbox rows"
    table = Table(title=f"{title} ({len(rows)} shown)")
    for column in ("id", "topic", "dedupe key", "attempts", "state", "last error"):
        table.add_column(column, overflow="fold")
    now = time.time()
    for r in rows:
        if r.failed_at is not None:
            state = "failed"
        elif r.locked_until is not None and r.locked_until.timestamp() > now:
            state = "sending"
        else:
            state = "waiting"
        table.add_row(str(r.id), r.topic, r.dedupe_key, str(r.attempts), state, r.last_error or "")
    out.print(table)


async def retry_outbox(settings: Settings, row_id: int | None) -> int:
    async with open_resources(settings) as res:
        store = OutboxStore(res.pool)
        if row_id is None:
            return await store.retry_all_failed()
        return 1 if await store.retry(row_id) else 0


async def erase_tenant(settings: Settings, tenant: str) -> dict[str, int]:
    """Right to erasure: the tenant's jobs, results and outbox rows first (so a
    step still running writes nothing), then its messages in every stream,
    delayed set and dead-letter stream, then its API keys."""
    from oncely.api.auth import erase_tenant_api_keys

    async with _jobs(settings) as jobs:
        counts = await jobs.erase_tenant(tenant)
        counts["messages"] = sum([await s.erase_tenant(tenant) for s in jobs.streams.values()])
        counts["api_keys"] = await erase_tenant_api_keys(jobs.pool, tenant)
    return counts
