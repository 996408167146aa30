"""The outbox relay against a minimal relay: what do the relay's guarantees cost?

N outbox rows already in PostgreSQL, drained by

- ``oncely``: a real ``oncely relay`` process (leases with an owner fence,
  attempts counted at claim, classified retries with backoff, a timeout per
  lease, LISTEN/NOTIFY, metrics and logs; the ``EffectRouter`` rendering the
  summaries email for the HTTP email sender);
- ``minimal``: the same sends and updates with none of the guarantees (this
  module with ``--minimal-relay``): a keyset SELECT of unsent rows, the email
  (``render_email``) POSTed with aiohttp and the Idempotency-Key, ``64`` at a
  time as slots free up, one UPDATE of ``sent_at`` per row;
- ``minimal_batched``: the same with the updates batched.

against the fake mail provider answering at once and after 50 ms. Every run
ends with its invariants checked: every row sent and none failed, one
effect per row at the provider, and the keys it saw are the outbox's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
import psycopg
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from bench.harness import profile
from bench.harness.drain import Drain
from bench.harness.fakes import FakeMail
from bench.harness.floor import pg_pool, until_stopped, whenever_set
from bench.harness.measure import Headline, Noise, Run, ratio, ratio_json, summary
from bench.harness.processes import clean_env
from bench.harness.report import Context, main, parser
from bench.harness.servers import TABLES, count
from oncely.builtin.summaries import SUMMARY_READY, dedupe_key, render_email
from oncely.errors import PermanentError
from oncely.sql import query

GOAL = 0.85  # oncely / minimal
BATCHED_GOAL = 1.0  # oncely / minimal_batched, instant provider
# oncely's defaults, which the minimal relays get too: relay concurrency and
# batch (Settings.relay_*), HTTP connections and timeout (HttpEmailSender,
# sender_timeout_s); the Postgres pool's are in bench.harness.floor.
CONCURRENCY = 64
BATCH = 100
HTTP_CONNECTIONS = 128
SEND_TIMEOUT_S = 10.0
POLL_S = 0.02
READY_POLL_S = 0.005
IDLE_POLL_S = 0.05
KINDS = ("oncely", "minimal", "minimal_batched")
SHOWN = ("rows", "rows_per_s", "cpu_ms_per_row", "provider_cpu_ms_per_row", "machine_busy_cores")

# Where a relay's CPU goes: inner work first.
BUCKETS = {
    "oncely": (
        ("claim: OutboxStore.claim", ["oncely.outbox.store:OutboxStore.claim"]),
        (
            "mark sent: OutboxStore.mark_sent_many (batched)",
            ["oncely.outbox.store:OutboxStore.mark_sent_many"],
        ),
        ("send: render_email", ["oncely.builtin.summaries:render_email"]),
        ("send: message_id_from", ["oncely.senders.http:message_id_from"]),
        ("send: JsonPoster.post (aiohttp)", ["oncely.senders.http:JsonPoster.post"]),
        ("send: HttpEmailSender.send rest", ["oncely.senders.http:HttpEmailSender.send"]),
        (
            "route: EffectRouter.send / _EmailRoute.deliver",
            [
                "oncely.senders.routing:_EmailRoute.deliver",
                "oncely.senders.routing:EffectRouter.send",
            ],
        ),
        ("after send: Relay._sent (metrics, log)", ["oncely.outbox.relay:Relay._sent"]),
        ("mark sent: Relay._mark_sent_batch", ["oncely.outbox.relay:Relay._mark_sent_batch"]),
        ("per row: Relay._send (lease, timeout)", ["oncely.outbox.relay:Relay._send"]),
        ("per row: Relay._relay (slot)", ["oncely.outbox.relay:Relay._relay"]),
        ("wait: Relay._wait_for_work", ["oncely.outbox.relay:Relay._wait_for_work"]),
        (
            "batch: Relay._relay_continuously (claims, starting sends)",
            ["oncely.outbox.relay:Relay._relay_continuously"],
        ),
        ("batch: Relay.run_once", ["oncely.outbox.relay:Relay.run_once"]),
        ("retention: Relay._clean_up_forever", ["oncely.outbox.relay:Relay._clean_up_forever"]),
        ("listener: Relay._listen", ["oncely.outbox.relay:Relay._listen"]),
        ("loop: Relay.run", ["oncely.outbox.relay:Relay.run"]),
    ),
    "minimal": (
        ("read: SELECT batch", ["bench.relay:MinimalRelay._read"]),
        ("send: render_email", ["oncely.builtin.summaries:render_email"]),
        (
            "update: one per row / batched",
            ["bench.relay:MinimalRelay._mark", "bench.relay:MinimalRelay._flush"],
        ),
        ("send: aiohttp POST", ["bench.relay:MinimalRelay._send"]),
        ("per row: MinimalRelay._relay", ["bench.relay:MinimalRelay._relay"]),
        ("loop: MinimalRelay.run", ["bench.relay:MinimalRelay.run"]),
    ),
}


@dataclass(frozen=True)
class Scenario:
    name: str
    delay_s: float  # the provider's answer time
    rows: int
    kinds: tuple[str, ...]


def scenarios(smoke: bool) -> list[Scenario]:
    if smoke:  # every contender once, a few rows each
        return [Scenario("instant", 0.0, 150, KINDS)]
    # With an instant provider 3000 rows took under half a second, and one
    # round's ratio ranged 0.68-1.3: enough rows for a few seconds instead.
    return [Scenario("instant", 0.0, 15000, KINDS), Scenario("provider_50ms", 0.05, 3000, KINDS)]


@dataclass(frozen=True)
class Trial:
    """One relay (``kind``) draining a scenario's rows."""

    kind: str
    scenario: Scenario

    @property
    def name(self) -> str:
        return self.kind

    @property
    def items(self) -> int:
        return self.scenario.rows

    @property
    def timeout_s(self) -> float:
        return 60 + self.scenario.rows * (0.01 + self.scenario.delay_s / CONCURRENCY) * 3


# -- the minimal relay (its own process) --------------------------------------------

# The minimal relay's own SQL, not oncely's: no lease, no owner, no attempts.
MINIMAL_READ = """
SELECT id, topic, dedupe_key, payload FROM outbox
 WHERE sent_at IS NULL AND id > %s
 ORDER BY id
 LIMIT %s
"""
MINIMAL_MARK_ONE = "UPDATE outbox SET sent_at = now(), provider_message_id = %s WHERE id = %s"
MINIMAL_MARK_MANY = """
UPDATE outbox o SET sent_at = now(), provider_message_id = v.message_id
  FROM unnest(%s::bigint[], %s::text[]) AS v(id, message_id)
 WHERE o.id = v.id
"""

Row = tuple[int, str, str, dict[str, Any]]


class MinimalRelay:
    """oncely's sends and updates with none of its guarantees: no lease or
    owner fence, no attempts, retries or backoff, no NOTIFY, metrics or logs.
    Rows are read once, in id order; a failed send is printed and forgotten."""

    def __init__(
        self,
        pool: AsyncConnectionPool,
        session: aiohttp.ClientSession,
        url: str,
        *,
        batch: int,
        concurrency: int,
        batched_updates: bool,
    ) -> None:
        self.pool = pool
        self.session = session
        self.url = url
        self.batch = batch
        self.batched_updates = batched_updates
        self._slots = asyncio.Semaphore(concurrency)
        self._tasks: set[asyncio.Task[None]] = set()
        self._sent: list[tuple[int, str | None]] = []
        self._flush_wanted = asyncio.Event()

    async def run(self) -> None:
        flusher = asyncio.create_task(whenever_set(self._flush_wanted, self._flush))
        last_id = 0
        try:
            while True:
                rows = await self._read(last_id)
                if not rows:
                    await asyncio.sleep(IDLE_POLL_S)
                    continue
                for row in rows:
                    await self._slots.acquire()  # released when the row is done
                    task = asyncio.create_task(self._relay(row))
                    self._tasks.add(task)
                    task.add_done_callback(self._finished)
                last_id = rows[-1][0]
        finally:
            flusher.cancel()
            if self._tasks:
                await asyncio.wait(self._tasks, timeout=5)
            await self._flush()

    async def _read(self, after_id: int) -> list[Row]:
        async with self.pool.connection() as conn:
            cur = await conn.execute(MINIMAL_READ, (after_id, self.batch))
            return await cur.fetchall()

    async def _relay(self, row: Row) -> None:
        try:
            row_id, topic, key, payload = row
            message_id = await self._send(topic, payload, key)
            if self.batched_updates:
                self._sent.append((row_id, message_id))
                self._flush_wanted.set()
            else:
                await self._mark(row_id, message_id)
        finally:
            self._slots.release()

    async def _send(self, topic: str, payload: dict[str, Any], key: str) -> str | None:
        if topic != SUMMARY_READY:  # what the router's topic lookup refuses
            raise PermanentError(f"no email for topic {topic!r}")
        body = json.dumps(asdict(render_email(payload))).encode()
        headers = {"Content-Type": "application/json", "Idempotency-Key": key}
        async with self.session.post(self.url, data=body, headers=headers) as response:
            answer = await response.read()
            response.raise_for_status()
        message_id = json.loads(answer).get("id")
        return None if message_id is None else str(message_id)

    async def _mark(self, row_id: int, message_id: str | None) -> None:
        async with self.pool.connection() as conn:
            await conn.execute(MINIMAL_MARK_ONE, (message_id, row_id))

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            print(f"minimal relay: send failed: {task.exception()!r}", file=sys.stderr)

    async def _flush(self) -> None:
        sent, self._sent = self._sent, []
        if sent:
            ids, message_ids = zip(*sent, strict=True)
            async with self.pool.connection() as conn:
                await conn.execute(MINIMAL_MARK_MANY, (list(ids), list(message_ids)))


async def minimal_main(args: argparse.Namespace) -> None:
    connector = aiohttp.TCPConnector(limit=HTTP_CONNECTIONS)
    timeout = aiohttp.ClientTimeout(total=SEND_TIMEOUT_S)
    async with (
        pg_pool(args.database_url) as pool,
        aiohttp.ClientSession(connector=connector, timeout=timeout) as session,
    ):
        relay = MinimalRelay(
            pool,
            session,
            args.sender_url,
            batch=args.batch,
            concurrency=CONCURRENCY,
            batched_updates=args.batched_updates,
        )
        await until_stopped(relay.run())


# -- one run ------------------------------------------------------------------------------


def _summary(i: int) -> str:
    return (
        f"Ticket {i}: invoice {1000 + i} was charged twice; support refunded the second "
        "charge and the customer confirmed the refund."
    )


class Bench(Drain[Trial, FakeMail]):
    """The outbox and the provider per run: reset, load, drain, check."""

    item = "row"
    fake_name = "provider"
    shown = SHOWN

    def __init__(self, ctx: Context, mail: FakeMail, batch: int | None) -> None:
        super().__init__(ctx, mail)
        self.batch = batch  # None: oncely's default

    async def load(self, trial: Trial) -> None:
        await self.db.execute(f"TRUNCATE {TABLES} RESTART IDENTITY")
        await self.fake.reset(trial.scenario.delay_s)
        await self.preload(trial.items)

    async def preload(self, rows: int) -> None:
        """Rows the way the worker leaves them (``insert_outbox``), then analysed."""
        params = []
        for i in range(rows):
            job_id = str(uuid.uuid4())
            payload = {"job_id": job_id, "to": f"user{i}@example.com", "summary": _summary(i)}
            params.append((SUMMARY_READY, dedupe_key(job_id), Jsonb(payload)))
        async with self.db.cursor() as cur:
            await cur.executemany(query("insert_outbox"), params)
        await self.db.execute("ANALYZE outbox")
        with contextlib.suppress(psycopg.Error):
            await self.db.execute("CHECKPOINT")

    def spawn(self, trial: Trial) -> subprocess.Popen[bytes]:
        s, kind = self.ctx.servers, trial.kind
        if kind == "oncely":
            settings = {
                "redis_url": s.redis_url,
                "database_url": s.database_url,
                "sender_url": self.fake.messages_url,
                "relay_concurrency": str(CONCURRENCY),
                "log_level": "WARNING",
            }
            if self.batch is not None:
                settings["relay_batch"] = str(self.batch)
            return self.ctx.children.python(kind, ["-m", "oncely", "relay"], clean_env(**settings))
        argv = [
            "-m",
            "bench.relay",
            "--minimal-relay",
            f"--database-url={s.database_url}",
            f"--sender-url={self.fake.messages_url}",
            f"--batch={self.batch or BATCH}",
            *(["--batched-updates"] if kind == "minimal_batched" else []),
        ]
        return self.ctx.children.python(kind, argv, clean_env())

    async def started(self, proc: subprocess.Popen[bytes], within_s: float) -> None:
        """Until the provider saw a request: the relay is up and sending."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline and proc.poll() is None:
            if (await self.fake.deliveries())["requests"] > 0:
                return
            await asyncio.sleep(READY_POLL_S)
        raise RuntimeError("the relay never sent")

    async def drained(self, proc: subprocess.Popen[bytes], trial: Trial, within_s: float) -> None:
        deadline = time.monotonic() + within_s
        unsent = "SELECT count(*) FROM outbox WHERE sent_at IS NULL AND failed_at IS NULL"
        while time.monotonic() < deadline and proc.poll() is None:
            if await count(self.db, unsent) == 0:
                return
            await asyncio.sleep(POLL_S)
        raise RuntimeError(f"{await count(self.db, unsent)} rows unsent when the wait ended")

    async def checks(self, trial: Trial) -> dict[str, Any]:
        rows = trial.items
        seen = await self.fake.deliveries()
        cur = await self.db.execute("SELECT dedupe_key FROM outbox")
        keys = {str(row[0]) for row in await cur.fetchall()}
        c: dict[str, Any] = {
            "rows": rows,
            "sent": await count(self.db, "SELECT count(*) FROM outbox WHERE sent_at IS NOT NULL"),
            "failed": await count(
                self.db, "SELECT count(*) FROM outbox WHERE failed_at IS NOT NULL"
            ),
            "provider_effects": int(seen["effects"]),
            "provider_requests": int(seen["requests"]),
            "keys_sent_twice": sum(1 for n in seen["by_key"].values() if n > 1),
            "effects_are_the_rows": set(seen["by_key"]) == keys,
        }
        c["ok"] = (
            c["sent"] == c["provider_effects"] == rows
            and not c["failed"]
            and c["effects_are_the_rows"]
        )
        return c


async def run_scenario(
    bench: Bench, scenario: Scenario
) -> tuple[dict[str, Any], dict[str, list[Run]]]:
    runs = await bench.run_rounds([Trial(kind, scenario) for kind in scenario.kinds], scenario.name)
    ratios = {
        f"oncely_vs_{kind}": {
            m: ratio_json(runs["oncely"], runs[kind], m) for m in ("rows_per_s", "cpu_ms_per_row")
        }
        for kind in scenario.kinds[1:]
    }
    detail = {
        "scenario": scenario.name,
        "provider_delay_s": scenario.delay_s,
        "rows": scenario.rows,
        "results": {kind: summary(rs) for kind, rs in runs.items()},
        "ratios": ratios,
    }
    return detail, runs


# -- the profile ----------------------------------------------------------------------------


def profile_lineup(smoke: bool) -> list[Trial]:
    """Both relays with both providers; a smoke run profiles oncely once,
    on enough rows for py-spy to see it work (300 took the relay 50 ms)."""
    if smoke:
        return [Trial("oncely", Scenario("instant", 0.0, 3000, KINDS))]
    both = (Scenario("instant", 0.0, 15000, KINDS), Scenario("provider_50ms", 0.05, 6000, KINDS))
    return [Trial(kind, s) for s in both for kind in ("oncely", "minimal")]


async def profile_one(bench: Bench, trial: Trial) -> dict[str, Any]:
    """py-spy on one relay, its samples in its kind's buckets."""
    rules = profile.buckets(BUCKETS["oncely" if trial.kind == "oncely" else "minimal"])
    scenario = trial.scenario.name
    return await bench.profile(trial, rules, f"{trial.kind}-{scenario}", scenario=scenario)


# -- the benchmark ----------------------------------------------------------------------------


async def bench_main(ctx: Context) -> tuple[list[Headline], dict[str, Any], bool]:
    for spec in BUCKETS.values():
        profile.buckets(spec)  # fail fast on a renamed function
    mail = FakeMail.start(ctx.children, "fake-mail")
    bench = Bench(ctx, mail, ctx.args.relay_batch)
    await bench.open()
    headline, details, ok = [], [], True
    profiles = []
    try:
        for scenario in scenarios(ctx.smoke):
            detail, runs = await run_scenario(bench, scenario)
            details.append(detail)
            ok = ok and all(r.ok for rs in runs.values() for r in rs)
            for kind in scenario.kinds[1:]:
                goal = {"at_least": GOAL} if kind == "minimal" else {}
                if kind == "minimal_batched" and scenario.name == "instant":
                    goal = {"at_least": BATCHED_GOAL}
                what = f"relay {scenario.name}: oncely / {kind}, rows/s"
                headline.append(
                    Headline.of(what, ratio(runs["oncely"], runs[kind], "rows_per_s"), **goal)
                )
        if ctx.args.profile:
            for trial in profile_lineup(ctx.smoke):
                profiles.append(await profile_one(bench, trial))
    finally:
        await bench.close()
    ok = ok and all(p["checks_ok"] for p in profiles)
    detail_all = {
        "goal": GOAL,
        "batched_goal": BATCHED_GOAL,
        "concurrency": CONCURRENCY,
        "batch": ctx.args.relay_batch or BATCH,
        "scenarios": details,
        "profiles": profiles or None,
    }
    return headline, detail_all, ok


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(
        "relay",
        __doc__ or "",
        rounds=3,
        noise=Noise(0.3, 15.0, 1, 60.0),
        profile="also py-spy the oncely and minimal relays (both providers): CPU per bucket",
    )
    p.add_argument("--relay-batch", type=int, help="ONCELY_RELAY_BATCH (default: oncely's, 100)")
    # The minimal relay, run by the benchmark itself:
    p.add_argument("--minimal-relay", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--sender-url", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=BATCH, help=argparse.SUPPRESS)
    p.add_argument("--batched-updates", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.minimal_relay:
        import uvloop  # what `oncely relay` runs on too

        uvloop.run(minimal_main(arguments))
    else:
        main("relay", "oncely relay vs minimal relays", arguments, bench_main)
