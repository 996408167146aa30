"""Operator commands: status, dead letters, the outbox. Tables to stderr-free
stdout via rich; ``--json`` where a script wants to read the answer."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime

from rich.console import Console
from rich.table import Table

from oncely.bootstrap import open_resources
from oncely.outbox.store import OutboxStore
from oncely.queue.dead import list_dead, replay, replay_all
from oncely.queue.stream import Stream
from oncely.settings import Settings
from oncely.status import read_status

out = Console()


async def show_status(settings: Settings, *, as_json: bool) -> None:
    async with open_resources(settings) as res:
        status = await read_status(res.pool, Stream(res.redis))
    if as_json:
        print(json.dumps(status.to_json(), indent=2))
        return
    table = Table(title="oncely status", show_header=False)
    table.add_row("stream length", str(status.stream_length))
    table.add_row("pending", str(status.pending))
    table.add_row("dead letters", str(status.dead_letters))
    for name, n in status.jobs.items():
        table.add_row(f"jobs {name}", str(n))
    o = status.outbox
    table.add_row("outbox unsent", str(o.unsent))
    table.add_row("outbox in flight", str(o.in_flight))
    table.add_row("outbox failed", str(o.failed))
    oldest = "-" if o.oldest_unsent_age_s is None else f"{o.oldest_unsent_age_s:.1f} s"
    table.add_row("outbox oldest unsent", oldest)
    for c in status.consumers:
        table.add_row(f"consumer {c.name}", f"{c.pending} pending, idle {c.idle_ms} ms")
    out.print(table)


async def show_dead_letters(settings: Settings, *, limit: int) -> None:
    async with open_resources(settings) as res:
        letters = await list_dead(Stream(res.redis), limit)
    table = Table(title=f"dead letters ({len(letters)} shown, newest first)")
    for column in ("id", "job", "reason", "deliveries", "dead at", "last error"):
        table.add_column(column)
    for d in letters:
        dead_at = datetime.fromtimestamp(d.dead_at, UTC).isoformat(timespec="seconds")
        table.add_row(d.dead_id, d.job_id, d.reason, str(d.deliveries), dead_at, d.last_error)
    out.print(table)


async def replay_dead_letters(settings: Settings, dead_id: str | None) -> int:
    async with open_resources(settings) as res:
        stream = Stream(res.redis)
        if dead_id is None:
            return len(await replay_all(res.pool, stream))
        return 0 if await replay(res.pool, stream, dead_id) is None else 1


async def show_outbox(settings: Settings, *, failed_only: bool, limit: int) -> None:
    async with open_resources(settings) as res:
        rows = await OutboxStore(res.pool).list(failed_only=failed_only, limit=limit)
    title = "failed outbox rows" if failed_only else "unsent outbox rows"
    table = Table(title=f"{title} ({len(rows)} shown)")
    for column in ("id", "topic", "dedupe key", "attempts", "state", "last error"):
        table.add_column(column)
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
