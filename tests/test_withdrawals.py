"""Withdrawing intakes answered 503, statement by statement.

Each test replays one interleaving of intake attempts on the same job id by
running ``accept_job`` and ``withdraw_jobs`` in the order a race can produce,
then reads the row. The rule under test: a row runs (stays queued) if any
attempt that touched it was answered, and is withdrawn once every one of them
was answered 503.
"""

from __future__ import annotations

import uuid

import pytest
from psycopg.types.json import Jsonb

from oncely.sql import query

JOB = "6f8d8a6e-3f6b-4c8e-9d1a-000000000001"
BODY = {"text": "x", "notify": "ada@example.com"}


@pytest.fixture
async def conn(pool):
    async with pool.connection() as c:
        yield c


async def accept(conn, token: uuid.UUID, fingerprint: str = "fp-1") -> tuple[bool, str] | None:
    cur = await conn.execute(
        query("accept_job"),
        {
            "job_id": JOB,
            "tenant": "acme",
            "kind": "summaries",
            "payload": Jsonb(BODY),
            "fingerprint": fingerprint,
            "token": token,
        },
    )
    return await cur.fetchone()


async def withdraw(conn, token: uuid.UUID) -> bool:
    """Withdraw one attempt; whether this withdrew a row that had landed."""
    cur = await conn.execute(
        query("withdraw_jobs"),
        {"job_ids": [JOB], "tenants": ["acme"], "kinds": ["summaries"], "tokens": [token]},
    )
    [(_, undone)] = await cur.fetchall()
    return bool(undone)


async def status(conn) -> str:
    cur = await conn.execute("SELECT status FROM jobs WHERE job_id = %s", (JOB,))
    [(value,)] = await cur.fetchall()
    return str(value)


async def test_an_attempt_alone_is_withdrawn_and_its_late_insert_changes_nothing(conn):
    p = uuid.uuid4()
    assert await withdraw(conn, p) is False  # before its insert landed
    assert await accept(conn, p) == (False, None)  # the late insert
    assert await status(conn) == "withdrawn"


async def test_an_attempt_whose_insert_landed_is_undone(conn):
    p = uuid.uuid4()
    assert await accept(conn, p) == (True, "fp-1")
    assert await withdraw(conn, p) is True
    assert await status(conn) == "withdrawn"


async def test_a_row_answered_202_survives_an_adopter_answered_503(conn):
    """The race CI found: another request recorded the row and was answered;
    this attempt's insert waited on its lock, timed out, and landed after the
    commit by adopting the row. Withdrawing this attempt must not lose it."""
    answered, late = uuid.uuid4(), uuid.uuid4()
    await accept(conn, answered)
    assert await accept(conn, late) == (False, "fp-1")  # adopted
    assert await withdraw(conn, late) is False
    assert await status(conn) == "queued"


async def test_a_row_answered_from_by_an_adopter_survives_its_writers_withdrawal(conn):
    p, retry = uuid.uuid4(), uuid.uuid4()
    await accept(conn, p)  # landed, but p was answered 503
    assert await accept(conn, retry) == (False, "fp-1")  # the retry replays from the row
    assert await withdraw(conn, p) is False
    assert await status(conn) == "queued"


@pytest.mark.parametrize("order", ["writer first", "adopter first"])
async def test_a_row_every_attempt_of_which_was_answered_503_is_withdrawn(conn, order):
    p, retry = uuid.uuid4(), uuid.uuid4()
    await accept(conn, p)
    await accept(conn, retry)
    first, second = (p, retry) if order == "writer first" else (retry, p)
    assert await withdraw(conn, first) is False
    assert await withdraw(conn, second) is True
    assert await status(conn) == "withdrawn"


async def test_a_retry_takes_a_withdrawn_row_over_and_an_old_late_insert_only_joins_it(conn):
    p, retry = uuid.uuid4(), uuid.uuid4()
    await withdraw(conn, p)
    assert await accept(conn, retry) == (True, "fp-1")  # a fresh acceptance
    assert await accept(conn, p) == (False, "fp-1")  # p's insert lands at last
    assert await status(conn) == "queued"
    assert await withdraw(conn, retry) is True  # ...and if the retry was 503 too
    assert await status(conn) == "withdrawn"


async def test_a_row_from_before_intake_tokens_counts_as_answered(conn):
    await conn.execute(query("insert_job"), (JOB, "acme", "summaries", Jsonb(BODY)))
    await conn.execute("UPDATE jobs SET fingerprint = 'fp-1' WHERE job_id = %s", (JOB,))
    late = uuid.uuid4()
    await accept(conn, late)
    assert await withdraw(conn, late) is False
    assert await status(conn) == "queued"


async def test_a_finished_job_is_never_withdrawn(conn):
    p = uuid.uuid4()
    await accept(conn, p)
    await conn.execute("UPDATE jobs SET status = 'done' WHERE job_id = %s", (JOB,))
    assert await withdraw(conn, p) is False
    assert await status(conn) == "done"
