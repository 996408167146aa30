"""The outbox relay on real Postgres, sending through the real effect router
and HTTP email sender to the fake mail provider. Every test counts effects: provider
requests and effects, attempts, and which rows ended sent or failed.

Time is rewound in the database (leases, next_attempt_at, sent_at), never
slept through.
"""

from __future__ import annotations

import asyncio
import inspect
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool
from structlog.testing import capture_logs

from oncely.bootstrap import relay_config
from oncely.effects import Email, Payload, email
from oncely.fakes.mail import FakeMailServer, Faults
from oncely.outbox.relay import LISTENER_APPLICATION_NAME, Relay, RelayConfig
from oncely.outbox.store import OutboxStore
from oncely.retry import backoff_s
from oncely.senders import EffectRouter, Sender, SendersConfig, SendResult, build_router
from oncely.settings import Settings
from oncely.sql import query
from tests.helpers import rows, service_running
from tests.processes import wait_for

DAY_S = 86400.0
SUMMARY_READY = "email.summary_ready"


def render_summary(payload: Payload) -> Email:
    return Email(
        payload["to"], f"Your summary is ready (job {payload['job_id']})", payload["summary"]
    )


def dedupe_key(job_id: str) -> str:
    return f"summary_ready:{job_id}"


def email_router(url: str) -> EffectRouter:
    """The relay's sender as the composition root builds it, for one email topic."""
    effects = [("summaries", email(SUMMARY_READY, render_summary))]
    return build_router(effects, SendersConfig(email="http", email_url=url, timeout_s=2.0))


class Crash(BaseException):
    """Stands for kill -9: nothing after it runs, nothing is cleaned up."""


class Crashing:
    """A relay process that dies right before or right after the real send."""

    def __init__(self, inner: Sender, *, after_send: bool) -> None:
        self.inner = inner
        self.after_send = after_send

    async def send(self, topic: str, payload: dict[str, Any], dedupe_key: str) -> SendResult:
        if self.after_send:
            await self.inner.send(topic, payload, dedupe_key)
        raise Crash

    async def aclose(self) -> None:
        pass


class Blocking:
    """A send that hangs until released, then goes to the real provider;
    counts the sends under way at once, and notes (loop time) when each
    began and when one was cut off."""

    def __init__(self, inner: Sender) -> None:
        self.inner = inner
        self.keys: list[str] = []
        self.release = asyncio.Event()
        self.in_flight = self.most_in_flight = 0
        self.started: dict[str, float] = {}
        self.cut: dict[str, float] = {}

    async def send(self, topic: str, payload: dict[str, Any], dedupe_key: str) -> SendResult:
        self.keys.append(dedupe_key)
        self.started[dedupe_key] = asyncio.get_running_loop().time()
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await self.release.wait()
            return await self.inner.send(topic, payload, dedupe_key)
        except asyncio.CancelledError:
            self.cut[dedupe_key] = asyncio.get_running_loop().time()
            raise
        finally:
            self.in_flight -= 1

    async def aclose(self) -> None:
        pass


class Watching:
    """The real sender, noting when each send began (loop time)."""

    def __init__(self, inner: Sender) -> None:
        self.inner = inner
        self.started: dict[str, float] = {}

    async def send(self, topic: str, payload: dict[str, Any], dedupe_key: str) -> SendResult:
        self.started.setdefault(dedupe_key, asyncio.get_running_loop().time())
        return await self.inner.send(topic, payload, dedupe_key)

    async def aclose(self) -> None:
        pass


class RenewalsFail(OutboxStore):
    """A database that refuses every lease renewal."""

    async def renew(self, *args: Any, **kwargs: Any) -> set[int]:
        raise psycopg.OperationalError("renewal refused (injected)")


@pytest.fixture
async def fake_mail() -> AsyncIterator[FakeMailServer]:
    async with FakeMailServer() as server:
        yield server


@pytest.fixture
async def sender(fake_mail: FakeMailServer) -> AsyncIterator[EffectRouter]:
    s = email_router(fake_mail.url)
    yield s
    await s.aclose()


@pytest.fixture
def store(pool: AsyncConnectionPool) -> OutboxStore:
    return OutboxStore(pool)


def make_relay(
    store: OutboxStore, sender: Sender, *, database_url: str | None = None, **cfg: Any
) -> Relay:
    # rand=1.0 makes the full-jitter backoff its ceiling: base * 2**(attempts-1).
    config = RelayConfig(**{"batch": 10, "concurrency": 4, "poll_s": 0.05, **cfg})
    return Relay(store, sender, config, database_url=database_url, rand=lambda: 1.0)


async def add_rows(pool: AsyncConnectionPool, count: int, *, notify: bool = False) -> list[int]:
    """Outbox rows as the worker's transaction writes them; their ids in order."""
    job_ids = [str(uuid.uuid4()) for _ in range(count)]
    rows = [
        (SUMMARY_READY, dedupe_key(j), Jsonb({"job_id": j, "to": "ada@example.com", "summary": j}))
        for j in job_ids
    ]
    async with pool.connection() as conn, conn.transaction():
        async with conn.cursor() as cur:
            await cur.executemany(query("insert_outbox"), rows)
        if notify:
            await conn.execute(query("notify_outbox"))
        cur = await conn.execute(
            "SELECT id FROM outbox WHERE dedupe_key = ANY(%s) ORDER BY id",
            ([dedupe_key(j) for j in job_ids],),
        )
        return [row[0] for row in await cur.fetchall()]


async def seconds_until(pool: AsyncConnectionPool, column: str, row_id: int) -> float:
    found = await rows(
        pool,
        f"SELECT extract(epoch FROM {column} - now())::float8 FROM outbox WHERE id = %s",
        row_id,
    )
    return float(found[0][0])


async def all_sent(pool: AsyncConnectionPool) -> bool:
    return await rows(pool, "SELECT count(*) FROM outbox WHERE sent_at IS NULL") == [(0,)]


async def woken_by_notify(
    relay: Relay, pool: Any, mail: FakeMailServer, effect_within_s: float, wake_within_s: float
) -> None:
    """One row added with its NOTIFY: the relay sends it, woken by the
    notification before any poll."""
    await add_rows(pool, 1, notify=True)
    await eventually(_effects(mail, 1), timeout_s=effect_within_s)
    await eventually(lambda: relay.stats["woken_by_notify"] >= 1, timeout_s=wake_within_s)
    assert relay.stats["polls"] == 0


async def sent_once_each(pool: Any, mail: FakeMailServer, n: int, attempts: int) -> None:
    """``n`` rows sent, each after ``attempts`` attempts, each one request
    and one effect at the receiver."""
    assert await rows(pool, "SELECT attempts, count(*) FROM outbox GROUP BY 1") == [(attempts, n)]
    deliveries = await mail.deliveries()
    assert deliveries["requests"] == deliveries["effects"] == n


async def eventually(check: Callable[[], bool | Awaitable[bool]], timeout_s: float = 2.0) -> None:
    async def holds() -> bool:
        result = check()
        return await result if inspect.isawaitable(result) else result

    await wait_for(holds, timeout_s)


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1/messages"


# -- crashes and leases --------------------------------------------------------


async def test_relay_dying_after_send_resends_once_lease_expires_as_one_effect(
    pool: AsyncConnectionPool, store: OutboxStore, sender: Sender, fake_mail: FakeMailServer
) -> None:
    [row_id] = await add_rows(pool, 1)
    dying = make_relay(store, Crashing(sender, after_send=True))
    with pytest.raises(BaseExceptionGroup) as crashed:
        await dying.run_once()
    assert crashed.group_contains(Crash)

    survivor = make_relay(store, sender)
    assert await survivor.run_once() == 0, "the dead relay's lease still holds the row"
    await rows(pool, "UPDATE outbox SET locked_until = now() - interval '1 s'")
    assert await survivor.run_once() == 1

    row = await store.get(row_id)
    assert row is not None and row.sent_at is not None and row.attempts == 2
    deliveries = await fake_mail.deliveries()
    assert (deliveries["requests"], deliveries["effects"]) == (2, 1)
    assert deliveries["by_key"] == {row.dedupe_key: 2}


async def test_expired_lease_cannot_mark_a_row_another_relay_now_holds(
    pool: AsyncConnectionPool, store: OutboxStore
) -> None:
    [row_id] = await add_rows(pool, 1)
    first, second = uuid.uuid4(), uuid.uuid4()
    [old] = await store.claim(first, 10, 30)
    await rows(pool, "UPDATE outbox SET locked_until = now() - interval '1 s'")
    [new] = await store.claim(second, 10, 30)
    assert (old.id, new.id) == (row_id, row_id)

    assert await store.mark_sent_many(first, [(old, "msg_first")]) == set()
    failed = await store.mark_failed_attempt(
        old, first, "late", next_attempt_at_delay_s=0, give_up=True
    )
    assert failed is False
    assert await store.mark_sent_many(second, [(new, "msg_second")]) == {(row_id, 2)}
    assert await store.mark_sent_many(second, [(new, "again")]) == set(), "sent stays sent"

    row = await store.get(row_id)
    assert row is not None
    assert (row.provider_message_id, row.attempts, row.failed_at) == ("msg_second", 2, None)
    assert (row.locked_by, row.locked_until, row.last_error) == (None, None, None)


async def test_batched_marking_records_only_the_rows_this_relay_still_holds(
    pool: AsyncConnectionPool, store: OutboxStore
) -> None:
    ids = await add_rows(pool, 3)
    first, second = uuid.uuid4(), uuid.uuid4()
    claimed = await store.claim(first, 10, 30)
    assert sorted(r.id for r in claimed) == sorted(ids)
    # The first row's lease ran out and another relay took it.
    await rows(
        pool, "UPDATE outbox SET locked_until = now() - interval '1 s' WHERE id = %s", ids[0]
    )
    assert [r.id for r in await store.claim(second, 10, 30)] == [ids[0]]

    marked = await store.mark_sent_many(first, [(row, f"msg_{row.id}") for row in claimed])
    assert marked == {(i, 1) for i in ids[1:]}
    found = await rows(pool, "SELECT id, sent_at IS NOT NULL, locked_by FROM outbox ORDER BY id")
    assert found == [(ids[0], False, second), (ids[1], True, None), (ids[2], True, None)]
    again = [row for row in claimed if row.id == ids[1]]
    assert await store.mark_sent_many(first, [(again[0], "again")]) == set(), "sent stays sent"


async def test_a_relay_that_claims_its_own_row_again_fences_off_its_first_claim(
    pool: AsyncConnectionPool, store: OutboxStore
) -> None:
    """One relay, one row, two claims (its first lease ended while the send
    hung, and its next poll took the row back): the first claim's late
    record of its failure must not release the row under the second
    claim's running send, nor mark it sent."""
    [row_id] = await add_rows(pool, 1)
    owner = uuid.uuid4()
    [first] = await store.claim(owner, 10, 30)
    await rows(pool, "UPDATE outbox SET locked_until = now() - interval '1 s'")
    [second] = await store.claim(owner, 10, 30)
    assert (first.id, second.id, first.attempts, second.attempts) == (row_id, row_id, 1, 2)

    late = await store.mark_failed_attempt(
        first, owner, "cut off", next_attempt_at_delay_s=60, give_up=False
    )
    assert late is False
    assert await store.mark_sent_many(owner, [(first, "msg_first")]) == set()
    [(locked_by, held)] = await rows(
        pool, "SELECT locked_by, locked_until > now() FROM outbox WHERE id = %s", row_id
    )
    assert (locked_by, held) == (owner, True), "the second claim still holds the row"
    assert await store.mark_sent_many(owner, [(second, "msg_second")]) == {(row_id, 2)}
    row = await store.get(row_id)
    assert row is not None and (row.provider_message_id, row.last_error) == ("msg_second", None)


async def test_stuck_send_holds_no_row_lock_and_keeps_its_rows_until_the_lease_ends(
    pool: AsyncConnectionPool, store: OutboxStore, sender: Sender, fake_mail: FakeMailServer
) -> None:
    await add_rows(pool, 6)
    blocking = Blocking(sender)
    stuck = make_relay(store, blocking, batch=2)
    stuck_pass = asyncio.create_task(stuck.run_once())
    await eventually(lambda: len(blocking.keys) == 2)

    # Mid-send, no session holds a lock on the table or an open transaction.
    locks = await rows(
        pool,
        "SELECT count(*) FROM pg_locks WHERE relation = 'outbox'::regclass"
        " AND pid <> pg_backend_pid()",
    )
    open_tx = await rows(
        pool,
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND state LIKE 'idle in transaction%'",
    )
    assert locks == [(0,)] and open_tx == [(0,)]

    other = make_relay(store, sender)
    async with asyncio.timeout(1):
        assert await other.run_once() == 4
    assert await other.run_once() == 0, "the stuck relay's leases are still valid"
    assert not set(blocking.keys) & set((await fake_mail.deliveries())["by_key"])

    await rows(
        pool, "UPDATE outbox SET locked_until = now() - interval '1 s' WHERE sent_at IS NULL"
    )
    assert await other.run_once() == 2

    blocking.release.set()
    await asyncio.wait_for(stuck_pass, 2)
    assert stuck.stats["lease_lost"] == 2 and stuck.stats["sent"] == 0
    assert other.stats["sent"] == 6
    deliveries = await fake_mail.deliveries()
    assert (deliveries["requests"], deliveries["effects"]) == (8, 6)


async def leased_to(pool: AsyncConnectionPool, relay: Relay) -> int:
    found = await rows(
        pool, "SELECT count(*) FROM outbox WHERE locked_by = %s AND sent_at IS NULL", relay.owner
    )
    return int(found[0][0])


async def test_the_loop_claims_a_slot_ahead_but_sends_no_more_than_its_concurrency(
    pool: AsyncConnectionPool, store: OutboxStore, sender: Sender, fake_mail: FakeMailServer
) -> None:
    """Up to ``concurrency`` claimed rows wait for a slot: the next send's
    row is leased before a slot frees, and the provider still never sees
    more than ``concurrency`` sends at once."""
    await add_rows(pool, 20)
    blocking = Blocking(sender)
    relay = make_relay(store, blocking, concurrency=4, batch=10)
    loop = asyncio.create_task(relay.run())
    try:
        await eventually(lambda: len(blocking.keys) == 4)

        async def claimed_ahead() -> bool:
            return await leased_to(pool, relay) == 8  # four sending, four waiting

        await eventually(claimed_ahead, timeout_s=5)
        assert blocking.most_in_flight == 4
        blocking.release.set()
        await eventually(lambda: all_sent(pool), timeout_s=10)
    finally:
        relay.stop()
        await asyncio.wait_for(loop, 5)
    assert blocking.most_in_flight == 4
    deliveries = await fake_mail.deliveries()
    assert deliveries["requests"] == deliveries["effects"] == 20
    assert await rows(pool, "SELECT attempts, count(*) FROM outbox GROUP BY 1") == [(1, 20)]


async def test_a_row_claimed_ahead_whose_lease_ends_before_its_slot_is_not_sent_by_it(
    pool: AsyncConnectionPool, sender: Sender, fake_mail: FakeMailServer
) -> None:
    """One slot, a 1 s lease that no renewal reaches: the first send hangs
    past its lease (cut off), the row claimed behind it gets its slot with
    its lease over and is left to its next claim. Every row is sent once in
    the end."""
    ids = await add_rows(pool, 3)
    blocking = Blocking(sender)
    relay = make_relay(
        RenewalsFail(pool),
        blocking,
        concurrency=1,
        lease_s=1.0,
        backoff_base_s=0.05,
        backoff_max_s=0.05,
    )
    loop = asyncio.create_task(relay.run())
    try:
        await eventually(lambda: relay.stats["lease_lost"] >= 1, timeout_s=10)
        blocking.release.set()
        await eventually(lambda: all_sent(pool), timeout_s=10)
    finally:
        relay.stop()
        await asyncio.wait_for(loop, 5)
    deliveries = await fake_mail.deliveries()
    assert deliveries["effects"] == 3
    keys = await rows(pool, "SELECT dedupe_key FROM outbox")
    assert set(deliveries["by_key"]) == {k for (k,) in keys}
    attempts = dict(await rows(pool, "SELECT id, attempts FROM outbox"))
    assert attempts[ids[0]] >= 2 and attempts[ids[1]] >= 2, "cut off, and left unsent: again"


async def test_row_whose_lease_keeps_running_out_mid_send_gives_up_unsent(
    pool: AsyncConnectionPool, store: OutboxStore, sender: Sender, fake_mail: FakeMailServer
) -> None:
    [row_id] = await add_rows(pool, 1)
    for _ in range(2):
        with pytest.raises(BaseExceptionGroup):
            await make_relay(store, Crashing(sender, after_send=False), max_attempts=2).run_once()
        await rows(pool, "UPDATE outbox SET locked_until = now() - interval '1 s'")

    relay = make_relay(store, sender, max_attempts=2)
    assert await relay.run_once() == 1
    row = await store.get(row_id)
    assert row is not None and row.failed_at is not None and row.sent_at is None
    assert row.last_error is not None and "lease ran out mid-send 2 times" in row.last_error
    assert relay.stats["failed"] == 1
    assert (await fake_mail.deliveries())["requests"] == 0


# -- leases renewed in short steps -----------------------------------------------


async def lease_ends(pool: AsyncConnectionPool) -> tuple[Any, Any]:
    """The earliest and the latest ``locked_until`` of the unsent rows."""
    [(earliest, latest)] = await rows(
        pool, "SELECT min(locked_until), max(locked_until) FROM outbox WHERE sent_at IS NULL"
    )
    return earliest, latest


async def test_a_live_relays_slow_send_keeps_its_rows_lease_after_lease(
    pool: AsyncConnectionPool, store: OutboxStore, sender: Sender, fake_mail: FakeMailServer
) -> None:
    """A 1.5 s lease renewed every half second: sends that outlast it many
    times over are never taken over by the relay polling beside them, and
    each row is sent once, by the relay that claimed it."""
    await add_rows(pool, 2)
    blocking = Blocking(sender)
    slow = make_relay(store, blocking, lease_s=1.5)
    watching = Watching(sender)
    other = make_relay(store, watching, lease_s=1.5)
    loops = [asyncio.create_task(slow.run())]
    try:
        await eventually(lambda: len(blocking.keys) == 2, timeout_s=10)
        loops.append(asyncio.create_task(other.run()))
        _, claimed_until = await lease_ends(pool)

        async def renewed_past_two_more_leases() -> bool:
            earliest, _ = await lease_ends(pool)
            return bool((earliest - claimed_until).total_seconds() > 3.0)

        await eventually(renewed_past_two_more_leases, timeout_s=30)
        polls = other.stats["polls"]
        await eventually(lambda: other.stats["polls"] >= polls + 2, timeout_s=10)
        assert watching.started == {}, "the other relay took over a live relay's rows"
        blocking.release.set()
        await eventually(lambda: all_sent(pool), timeout_s=10)
    finally:
        for relay in (slow, other):
            relay.stop()
        blocking.release.set()
        await asyncio.wait_for(asyncio.gather(*loops), 5)
    assert (slow.stats["sent"], slow.stats["lease_lost"], slow.stats["retried"]) == (2, 0, 0)
    assert other.stats["sent"] == 0 and watching.started == {}
    await sent_once_each(pool, fake_mail, 2, attempts=1)


async def test_a_dead_relays_rows_are_sent_by_another_within_a_lease(
    pool: AsyncConnectionPool, store: OutboxStore, sender: Sender, fake_mail: FakeMailServer
) -> None:
    """With the default lease (3 s), a relay that dies mid-send (its task
    cancelled: no renewal and no write from then on, as kill -9 leaves it)
    has its rows claimed by the relay beside it once their lease ends,
    never before, and each sent again with its key: one effect each."""
    await add_rows(pool, 2)
    blocking = Blocking(sender)
    dying = make_relay(store, blocking, lease_s=RelayConfig.lease_s)
    watching = Watching(sender)
    survivor = make_relay(store, watching, lease_s=RelayConfig.lease_s)
    dying_loop = asyncio.create_task(dying.run())
    survivor_loop: asyncio.Task[None] | None = None
    try:
        await eventually(lambda: len(blocking.keys) == 2, timeout_s=10)
        survivor_loop = asyncio.create_task(survivor.run())
        _, claimed_until = await lease_ends(pool)

        async def renewed() -> bool:
            earliest, _ = await lease_ends(pool)
            return bool(earliest > claimed_until)

        await eventually(renewed, timeout_s=10)
        dying_loop.cancel()
        await asyncio.wait([dying_loop])
        loop = asyncio.get_running_loop()
        died = loop.time()
        [(left_s,)] = await rows(
            pool,
            "SELECT extract(epoch FROM max(locked_until) - now())::float8 FROM outbox"
            " WHERE sent_at IS NULL",
        )
        lease_ended = died + left_s  # on this loop's clock, give or take a statement
        await eventually(lambda: all_sent(pool), timeout_s=20)
    finally:
        survivor.stop()
        if survivor_loop is not None:
            await asyncio.wait_for(survivor_loop, 5)
    assert blocking.cut.keys() == set(blocking.keys), "the dying relay's sends never finished"
    assert set(watching.started) == set(blocking.keys)
    taken_over = max(watching.started.values()) - died
    assert min(watching.started.values()) >= lease_ended - 0.5, "resent before the lease ended"
    assert taken_over < 15, (
        f"resent {taken_over:.1f} s after the death: the bound is one lease (3 s) and a poll;"
        " 15 s allowed for a loaded machine"
    )
    await sent_once_each(pool, fake_mail, 2, attempts=2)


async def test_a_hung_send_is_renewed_up_to_the_send_timeout_then_cut_off(
    pool: AsyncConnectionPool, store: OutboxStore, sender: Sender, fake_mail: FakeMailServer
) -> None:
    """A provider that never answers (and a sender without a timeout of its
    own): the relay renews the row while the send runs up to
    ``send_timeout_s``, then no more, so the send is cut off a lease
    later and the row released for another try."""
    [row_id] = await add_rows(pool, 1)
    blocking = Blocking(sender)
    hung = make_relay(
        store, blocking, lease_s=1.0, send_timeout_s=2.0, backoff_base_s=60, backoff_max_s=60
    )
    loop = asyncio.create_task(hung.run())
    try:
        await eventually(lambda: hung.stats["retried"] == 1, timeout_s=20)
    finally:
        hung.stop()
        await asyncio.wait_for(loop, 5)
    [key] = blocking.keys
    assert blocking.cut[key] - blocking.started[key] >= 2.0, "renewed while the send was young"
    row = await store.get(row_id)
    assert row is not None and row.last_error is not None
    assert "send cut off" in row.last_error and "end of its lease" in row.last_error
    assert (row.sent_at, row.locked_by, row.attempts) == (None, None, 1)
    assert (await fake_mail.deliveries())["requests"] == 0


async def test_a_renewal_that_finds_the_row_taken_over_stops_the_send(
    pool: AsyncConnectionPool, store: OutboxStore, sender: Sender, fake_mail: FakeMailServer
) -> None:
    """Another relay holds the row now (as its claim after an expired lease
    leaves it): the next renewal tells, well before the relay's own view
    of its 6 s lease ends, the send stops, and nothing is written over the
    new holder's claim."""
    [row_id] = await add_rows(pool, 1)
    blocking = Blocking(sender)
    first = make_relay(store, blocking, lease_s=6.0)
    taker = uuid.uuid4()
    with capture_logs() as logs:
        loop = asyncio.create_task(first.run())
        try:
            await eventually(lambda: first.stats["renewals"] >= 1, timeout_s=10)
            await rows(
                pool,
                "UPDATE outbox SET locked_by = %s, locked_until = now() + interval '1 minute',"
                " attempts = attempts + 1",
                taker,
            )
            await eventually(lambda: first.stats["lease_lost"] == 1, timeout_s=10)
        finally:
            first.stop()
            await asyncio.wait_for(loop, 5)
    assert [e["outbox_id"] for e in logs if e["event"] == "outbox.renewal_refused"] == [row_id]
    assert set(blocking.cut) == set(blocking.keys)
    row = await store.get(row_id)
    assert row is not None
    assert (row.locked_by, row.attempts, row.last_error, row.sent_at) == (taker, 2, None, None)
    assert first.stats["retried"] == 0
    assert (await fake_mail.deliveries())["requests"] == 0


async def test_a_row_held_less_than_a_sixth_of_a_lease_costs_no_renewal(
    pool: AsyncConnectionPool, store: OutboxStore, sender: Sender
) -> None:
    await add_rows(pool, 1)
    blocking = Blocking(sender)
    relay = make_relay(store, blocking, lease_s=60.0)
    pass_ = asyncio.create_task(relay.run_once())
    try:
        await eventually(lambda: len(blocking.keys) == 1)
        assert await relay.renew_leases() == 0, "held for less than 10 s: no statement"
    finally:
        blocking.release.set()
        await asyncio.wait_for(pass_, 5)
    assert relay.stats["renewals"] == 0 and relay.stats["sent"] == 1


async def test_renew_is_owner_checked_and_never_revives_an_ended_lease(
    pool: AsyncConnectionPool, store: OutboxStore
) -> None:
    """``OutboxStore.renew``: only the owner's unsent rows whose lease runs."""
    ids = await add_rows(pool, 3)
    owner, stranger = uuid.uuid4(), uuid.uuid4()
    assert len(await store.claim(owner, 10, 30)) == 3
    await rows(
        pool, "UPDATE outbox SET locked_until = now() - interval '1 s' WHERE id = %s", ids[0]
    )
    await rows(pool, "UPDATE outbox SET sent_at = now() WHERE id = %s", ids[1])
    assert await store.renew(stranger, ids, 30, timeout_s=5) == set()
    assert await store.renew(owner, ids, 60, timeout_s=5) == {ids[2]}
    assert 50 < await seconds_until(pool, "locked_until", ids[2]) <= 60
    assert await seconds_until(pool, "locked_until", ids[0]) < 0, "never revived"


# -- provider failures -------------------------------------------------------------


@pytest.mark.parametrize("outage", ["closed_port", "503"])
async def test_provider_down_counts_an_attempt_and_schedules_a_retry_that_sends(
    outage: str,
    pool: AsyncConnectionPool,
    store: OutboxStore,
    sender: Sender,
    fake_mail: FakeMailServer,
) -> None:
    [row_id] = await add_rows(pool, 1)
    if outage == "503":
        fake_mail.state.script(Faults(fail_next=1, status=503))
        down: Sender = sender
    else:
        down = email_router(closed_port_url())
    relay = make_relay(store, down)
    assert await relay.run_once() == 1
    if down is not sender:
        await down.aclose()

    row = await store.get(row_id)
    assert row is not None and row.attempts == 1 and row.sent_at is None and row.failed_at is None
    assert row.last_error and (
        "503" in row.last_error if outage == "503" else "POST" in row.last_error
    )
    # First retry: the backoff ceiling base * 2**0 = 1 s (rand pinned to 1).
    assert 0.5 < await seconds_until(pool, "next_attempt_at", row_id) <= 1.0
    assert relay.stats["retried"] == 1
    assert await make_relay(store, sender).run_once() == 0, "not due yet"

    await rows(pool, "UPDATE outbox SET next_attempt_at = now() - interval '1 s'")
    assert await make_relay(store, sender).run_once() == 1
    row = await store.get(row_id)
    assert row is not None and row.sent_at is not None and row.attempts == 2
    assert (await fake_mail.deliveries())["effects"] == 1


async def test_provider_retry_after_wins_over_backoff(
    pool: AsyncConnectionPool, store: OutboxStore, sender: Sender, fake_mail: FakeMailServer
) -> None:
    [row_id] = await add_rows(pool, 1)
    fake_mail.state.script(Faults(fail_next=1, status=429, retry_after=120))
    assert await make_relay(store, sender).run_once() == 1
    assert 118 < await seconds_until(pool, "next_attempt_at", row_id) <= 120


async def test_permanent_4xx_fails_the_row_after_one_attempt(
    pool: AsyncConnectionPool, store: OutboxStore, sender: Sender, fake_mail: FakeMailServer
) -> None:
    [row_id] = await add_rows(pool, 1)
    fake_mail.state.script(Faults(fail_next=1, status=400))
    relay = make_relay(store, sender)
    with capture_logs() as logs:
        assert await relay.run_once() == 1

    row = await store.get(row_id)
    assert row is not None and row.attempts == 1 and row.failed_at is not None
    assert row.last_error is not None and "400" in row.last_error
    assert [e["outbox_id"] for e in logs if e["event"] == "outbox.gave_up"] == [row_id]
    assert await relay.run_once() == 0, "a failed row is not retried by itself"
    assert relay.stats["failed"] == 1
    deliveries = await fake_mail.deliveries()
    assert (deliveries["requests"], deliveries["effects"]) == (1, 0)


async def test_max_attempts_stops_the_row_until_an_operator_retries_it(
    pool: AsyncConnectionPool, store: OutboxStore, sender: Sender, fake_mail: FakeMailServer
) -> None:
    [row_id] = await add_rows(pool, 1)
    fake_mail.state.script(Faults(fail_next=100, status=503))
    relay = make_relay(store, sender, max_attempts=3)
    for _ in range(3):
        assert await relay.run_once() == 1
        await rows(pool, "UPDATE outbox SET next_attempt_at = now() - interval '1 s'")
    assert await relay.run_once() == 0
    assert (relay.stats["retried"], relay.stats["failed"]) == (2, 1)
    assert [r.id for r in await store.list(failed_only=True)] == [row_id]
    assert (await store.counts()).failed == 1

    fake_mail.state.script(Faults())
    assert await store.retry(row_id) is True
    assert await store.retry(row_id) is False, "only failed rows are retried"
    assert await relay.run_once() == 1
    row = await store.get(row_id)
    assert row is not None and row.sent_at is not None and row.attempts == 1
    assert await store.list(failed_only=True) == []
    deliveries = await fake_mail.deliveries()
    assert (deliveries["requests"], deliveries["effects"]) == (4, 1)


# -- many relays, wake-ups, shutdown ------------------------------------------------


async def test_two_relays_side_by_side_send_500_rows_exactly_once(
    pool: AsyncConnectionPool, store: OutboxStore, fake_mail: FakeMailServer
) -> None:
    await add_rows(pool, 500)
    senders = [email_router(fake_mail.url) for _ in range(2)]
    relays = [make_relay(store, s, batch=25, concurrency=8, poll_s=0.02) for s in senders]
    loops = [asyncio.create_task(r.run()) for r in relays]
    try:
        await eventually(lambda: all_sent(pool), timeout_s=10)
    finally:
        for relay in relays:
            relay.stop()
        await asyncio.wait_for(asyncio.gather(*loops), 2)
        for s in senders:
            await s.aclose()

    deliveries = await fake_mail.deliveries()
    assert deliveries["requests"] == deliveries["effects"] == 500
    assert set(deliveries["by_key"].values()) == {1}
    assert await rows(pool, "SELECT attempts, count(*) FROM outbox GROUP BY 1") == [(1, 500)]
    assert [r.stats["sent"] > 0 for r in relays] == [True, True]
    assert sum(r.stats["sent"] for r in relays) == 500


@pytest.fixture
def listening(store: OutboxStore, sender: Sender, database_url: str) -> Callable[..., Relay]:
    """A relay that listens for NOTIFY on a connection of its own
    (``make_relay``'s options)."""
    return lambda **options: make_relay(store, sender, database_url=database_url, **options)


async def test_notify_wakes_the_relay_well_before_its_poll_interval(
    pool: AsyncConnectionPool, fake_mail: FakeMailServer, listening: Callable[..., Relay]
) -> None:
    # A poll far beyond the wait below: only the NOTIFY can deliver in time.
    relay = listening(poll_s=120.0)
    async with service_running(relay, stop_within_s=2):
        await asyncio.wait_for(relay.listening.wait(), 10)
        # The row and its NOTIFY in one transaction.
        await woken_by_notify(relay, pool, fake_mail, effect_within_s=30.0, wake_within_s=5.0)


async def test_listener_reconnects_after_its_connection_drops(
    pool: AsyncConnectionPool, fake_mail: FakeMailServer, listening: Callable[..., Relay]
) -> None:
    relay = listening(poll_s=10.0, listen_retry_s=0.05)
    async with service_running(relay, stop_within_s=2):
        await asyncio.wait_for(relay.listening.wait(), 2)
        terminated = await rows(
            pool,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE application_name = %s AND datname = current_database()",
            LISTENER_APPLICATION_NAME,
        )
        assert terminated == [(True,)]
        await eventually(lambda: relay.stats["listens"] == 2)
        await woken_by_notify(relay, pool, fake_mail, effect_within_s=1.0, wake_within_s=0.5)


async def test_stop_lets_the_send_in_flight_finish_and_record_it(
    pool: AsyncConnectionPool, store: OutboxStore, sender: Sender, fake_mail: FakeMailServer
) -> None:
    [row_id] = await add_rows(pool, 1)
    blocking = Blocking(sender)
    relay = make_relay(store, blocking)
    loop = asyncio.create_task(relay.run())
    await eventually(lambda: len(blocking.keys) == 1)

    relay.stop()
    await asyncio.sleep(0.05)
    assert not loop.done(), "run() waits for the send in flight"
    blocking.release.set()
    await asyncio.wait_for(loop, 2)

    row = await store.get(row_id)
    assert row is not None and row.sent_at is not None
    assert (await fake_mail.deliveries())["effects"] == 1


# -- retention and operator views ------------------------------------------------------


async def test_retention_deletes_only_rows_sent_before_the_window(
    pool: AsyncConnectionPool, store: OutboxStore, sender: Sender
) -> None:
    ids = await add_rows(pool, 8)
    old_sent, fresh_sent, old_unsent, old_failed = ids[:5], ids[5], ids[6], ids[7]
    await rows(
        pool,
        "UPDATE outbox SET sent_at = now() - interval '8 days',"
        " created_at = now() - interval '9 days' WHERE id = ANY(%s)",
        old_sent,
    )
    await rows(
        pool, "UPDATE outbox SET sent_at = now() - interval '1 hour' WHERE id = %s", fresh_sent
    )
    await rows(
        pool, "UPDATE outbox SET created_at = now() - interval '30 days' WHERE id = %s", old_unsent
    )
    await rows(
        pool,
        "UPDATE outbox SET failed_at = now() - interval '30 days',"
        " created_at = now() - interval '30 days' WHERE id = %s",
        old_failed,
    )

    relay = make_relay(store, sender, retention_s=7 * DAY_S, cleanup_batch=2)
    assert await relay.clean_up() == 5
    assert await relay.clean_up() == 0
    remaining = await rows(pool, "SELECT id FROM outbox ORDER BY id")
    assert [r[0] for r in remaining] == [fresh_sent, old_unsent, old_failed]


async def test_counts_and_retry_all_failed_for_operators(
    pool: AsyncConnectionPool, store: OutboxStore
) -> None:
    sent, failed, waiting = await add_rows(pool, 3)
    await rows(pool, "UPDATE outbox SET sent_at = now() WHERE id = %s", sent)
    await rows(pool, "UPDATE outbox SET failed_at = now(), attempts = 10 WHERE id = %s", failed)
    await rows(
        pool, "UPDATE outbox SET created_at = now() - interval '60 s' WHERE id = %s", waiting
    )

    counts = await store.counts()
    assert (counts.unsent, counts.in_flight, counts.failed) == (1, 0, 1)
    assert counts.oldest_unsent_age_s is not None and 59 < counts.oldest_unsent_age_s < 70
    assert [r.id for r in await store.list()] == [failed, waiting]

    await store.claim(uuid.uuid4(), 10, 30)
    assert (await store.counts()).in_flight == 1
    assert len(await store.retry_all_failed()) == 1
    counts = await store.counts()
    assert (counts.unsent, counts.failed) == (2, 0)
    row = await store.get(failed)
    assert row is not None and row.attempts == 0 and row.failed_at is None


def test_backoff_is_full_jitter_exponential_and_capped() -> None:
    assert [backoff_s(n, 1.0, 300.0, lambda: 1.0) for n in (1, 2, 4, 9, 10, 10_000)] == [
        1.0,
        2.0,
        8.0,
        256.0,
        300.0,
        300.0,
    ]
    assert backoff_s(5, 1.0, 300.0, lambda: 0.0) == 0.0
    assert all(0.0 <= backoff_s(6, 1.0, 300.0) <= 32.0 for _ in range(100))


def test_relay_config_from_settings_takes_the_relay_knobs() -> None:
    settings = Settings(
        relay_max_attempts=3,
        relay_lease_s=12,
        relay_batch=7,
        relay_concurrency=5,
        relay_poll_s=0.5,
        outbox_retention_s=60,
        sender_timeout_s=4,
    )
    config = relay_config(settings)
    assert (config.max_attempts, config.lease_s, config.batch) == (3, 12, 7)
    assert config.send_timeout_s == 4
    assert (config.concurrency, config.poll_s, config.retention_s) == (5, 0.5, 60)


# -- helpers for eventually() -------------------------------------------------------------


def _effects(fake_mail: FakeMailServer, count: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return (await fake_mail.deliveries())["effects"] >= count

    return check


async def test_a_dead_retention_task_stops_the_relay_with_the_error_logged(pool, sender):
    relay = make_relay(OutboxStore(pool), sender, cleanup_every_s=0.01)

    async def broken() -> int:
        raise RuntimeError("retention broke (injected)")

    relay.clean_up = broken  # type: ignore[method-assign]
    with capture_logs() as logs, pytest.raises(ExceptionGroup) as stopped:
        await asyncio.wait_for(relay.run(), timeout=10)
    assert "retention broke" in str(stopped.value.exceptions[0])
    [failed] = [e for e in logs if e["event"] == "process.task_failed"]
    assert failed["task"] == "outbox-retention"
