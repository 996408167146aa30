"""A live stream through real `oncely api`, `worker` and `relay` processes
while the worker is SIGKILLed mid-answer (docs/streaming.md): the stream,
read with an SSE client library, says ``reset`` when the next worker starts
the call over, and the tokens kept after it are exactly the stored answer;
the email is sent once, and the killed call is in the ledger as sent. Also:
no run form logs a stream token, and a crowd of clients that read nothing
of a long history costs the API a bounded amount of memory."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from httpx_sse import aconnect_sse

from oncely import names
from oncely.api.auth import create_api_key
from oncely.live.events import JobEvents
from tests.helpers import rows, scalar
from tests.processes import (
    Deployment,
    deployment_env,
    free_port,
    running,
    start,
    start_command,
    wait_effects,
    wait_for,
    wait_healthy,
)
from tests.test_streams import streamed_text
from tests.test_streams_hostile import answered, closing_all, long_history, stalled_client

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


async def test_a_worker_killed_mid_stream_resets_and_the_kept_tokens_are_the_answer(
    redis_url, database_url, api_key, pool, redis, providers, tmp_path
):
    # ``redis`` flushes the database first: an earlier run's idempotency
    # record for this key would answer for a job this database never had.
    model, mail = providers
    env = deployment_env(redis_url, database_url, model, mail, ONCELY_CLAIM_IDLE_MS="1500")
    # A word every 0.2 s: the worker is killed while the answer is typing.
    text = "[[fake:typing=0.2]] Killed workers start over. The stream says reset first. Done."
    killed = killed_mid_stream(env, tmp_path, api_key, mail, text, "killed-mid-stream-0001")
    async with killed as (job_id, events, got):

        async def billed() -> bool:
            return await scalar(pool, "SELECT count(*) FROM model_calls WHERE outcome = 'ok'") == 1

        await wait_for(billed, what="the answered call's ledger row")

    assert got["status"] == "done" and events[-1] == ("end", got)
    kinds = [kind for kind, _ in events]
    assert "reset" in kinds, "the next worker's attempt said reset"
    assert kinds.index("token") < kinds.index("reset")
    # The reset names the new attempt: the redelivery's, not the killed one's.
    [reset] = [d for k, d in events if k == "reset"]
    assert reset["delivery"] >= 2 and reset["attempt"] == 1
    assert streamed_text([("", k, d) for k, d in events]) == got["result"]["summary"]
    assert (await mail.deliveries())["effects"] == 1
    # The killed call reached the provider: it is in the ledger as sent.
    outcomes = "SELECT outcome FROM model_calls WHERE job_id = %s ORDER BY outcome"
    assert [r[0] for r in await rows(pool, outcomes, job_id)] == ["ok", "sent"]


@asynccontextmanager
async def killed_mid_stream(
    env: dict[str, str], tmp_path: Path, api_key: str, mail: Any, text: str, key: str
) -> AsyncIterator[tuple[str, list[tuple[str, Any]], dict[str, Any]]]:
    """A deployment of ``env``; ``text`` posted as a streamed summary under
    ``key``, its worker killed mid-stream (``stream_killing_the_worker``),
    the summary's email sent: the job's id, the events streamed, and the job
    as GET shows it. The deployment runs until the block ends."""
    with Deployment(env, tmp_path) as d:
        async with d.client(api_key, timeout=60) as http:
            job_id, events = await stream_killing_the_worker(d, http, text, key)
            got = (await http.get(f"/v1/summaries/{job_id}")).json()
            await wait_effects(mail, what="the summary's email")
            yield job_id, events, got


async def stream_killing_the_worker(
    d: Deployment, http: httpx.AsyncClient, text: str, key: str
) -> tuple[str, list[tuple[str, Any]]]:
    """A summary of ``text`` posted (under idempotency key ``key``) and its
    stream read to the end, the worker SIGKILLed four tokens in (the call in
    flight across several of the ledger's batches) and another started: the
    job's id and the events read."""
    posted = await http.post(
        "/v1/summaries",
        json={"text": text, "notify": "ada@example.com"},
        headers={"Idempotency-Key": key},
    )
    assert posted.status_code == 202, posted.text
    job_id = str(posted.json()["job_id"])
    events: list[tuple[str, Any]] = []
    async with aconnect_sse(http, "GET", f"/v1/summaries/{job_id}/stream") as source:
        async for sse in source.aiter_sse():
            events.append((sse.event, json.loads(sse.data)))
            if sum(kind == "token" for kind, _ in events) == 4 and len(d.workers) == 1:
                d.kill_worker()
                d.workers.append(d.start_worker())
            if sse.event == "end":
                break
    assert len(d.workers) == 2, "the worker was killed mid-stream"
    return job_id, events


async def test_no_run_form_logs_a_stream_token(redis_url, database_url, pool, tmp_path):
    """``uvicorn --factory`` (its own access log, on) and ``oncely api``:
    a stream opened with ``?token=`` leaves the token in neither log;
    uvicorn's access line is there, with the token redacted."""
    key = await create_api_key(pool, "acme")
    auth = {"Authorization": f"Bearer {key}"}
    env = {"ONCELY_REDIS_URL": redis_url, "ONCELY_DATABASE_URL": database_url}
    factory_port, api_port = free_port(), free_port()
    factory = start_command(
        ["-m", "uvicorn", "--factory", "oncely.bootstrap:asgi_app", "--port", str(factory_port)],
        env,
        tmp_path / "factory.log",
    )
    api = start(["api", "--port", str(api_port)], env, tmp_path / "api.log")
    tokens = []
    with running(factory, api):
        for port, proc, log in ((factory_port, factory, "factory.log"), (api_port, api, "api.log")):
            base = f"http://127.0.0.1:{port}"
            await wait_healthy(base, proc, tmp_path / log)
            tokens.append(await open_with_token(base, auth))
    factory_log = (tmp_path / "factory.log").read_text()
    api_log = (tmp_path / "api.log").read_text()
    assert "/stream?token=[redacted]" in factory_log, factory_log[-2000:]
    assert all(token not in factory_log + api_log for token in tokens)


async def open_with_token(base: str, auth: dict[str, str]) -> str:
    """A job's stream opened with a stream token (to its first event); the token."""
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        posted = await http.post(
            "/v1/summaries",
            json={"text": "Tokens stay out of logs.", "notify": "a@example.com"},
            headers={**auth, "Idempotency-Key": f"token-log-{uuid.uuid4()}"},
        )
        assert posted.status_code == 202, posted.text
        job_id = posted.json()["job_id"]
        issued = await http.post(f"/v1/summaries/{job_id}/stream-token", headers=auth)
        token = str(issued.json()["token"])
        async with aconnect_sse(http, "GET", f"/v1/summaries/{job_id}/stream?token={token}") as s:
            assert s.response.status_code == 200
            async for sse in s.aiter_sse():
                assert sse.event == "snapshot"
                break
    return token


def established(port: int) -> int:
    """Connections the server listening on ``port`` (IPv4) holds open:
    ESTABLISHED on its side (a connection it closed is FIN-WAIT, or gone)."""
    local = f"0100007F:{port:04X}"
    with open("/proc/net/tcp") as table:
        rows = [line.split() for line in table][1:]
    return sum(row[1] == local and row[3] == "01" for row in rows)


def rss_mib(pid: int) -> float:
    """The process's resident memory (MiB), from /proc."""
    with open(f"/proc/{pid}/status") as status:
        line = next(x for x in status if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


SLOW_READERS = 100


@pytest.mark.timeout(480)  # two heartbeats of 30 s to close, on a loaded machine
async def test_clients_that_read_nothing_of_a_long_history_cost_bounded_memory(
    redis_url, database_url, pool, redis, tmp_path
):
    """100 clients open a job's stream (10,000 events of 1 KB in Redis) and
    never read: the API's memory grows by a bounded amount (the history is
    read a page at a time), and each stream ends once its writes stall,
    giving its place back and its connection (aborted: a graceful close
    would wait for a client that never reads). Prints the numbers measured."""
    key = await create_api_key(pool, "acme")
    auth = {"Authorization": f"Bearer {key}"}
    port = free_port()
    env = {
        "ONCELY_REDIS_URL": redis_url,
        "ONCELY_DATABASE_URL": database_url,
        "ONCELY_STREAMS_PER_TENANT": "1000",
        # Stalled writes end a stream after two heartbeats: 20 s here.
        "ONCELY_STREAM_HEARTBEAT_S": "10",
    }
    api = start(["api", "--port", str(port)], env, tmp_path / "api.log")
    base = f"http://127.0.0.1:{port}"
    open_streams = names.open_streams(names.tenant_digest("acme"))
    measured: dict[str, float] = {}
    with running(api):
        await wait_healthy(base, api, tmp_path / "api.log")
        async with httpx.AsyncClient(base_url=base, headers=auth, timeout=60) as http:
            posted = await http.post(
                "/v1/summaries",
                json={"text": "A long history.", "notify": "a@example.com"},
                headers={"Idempotency-Key": f"long-history-{uuid.uuid4()}"},
            )
            job_id = posted.json()["job_id"]
            await long_history(JobEvents(redis), job_id, 10_000, 1000)
            # One client reads it all first: the baseline has served it once.
            assert await read_progress(http, f"/v1/summaries/{job_id}/stream") >= 9000
        measured["baseline"] = measured["peak"] = rss_mib(api.pid)
        path = f"/v1/summaries/{job_id}/stream"
        socks = [stalled_client(base, path, auth) for _ in range(SLOW_READERS)]
        with closing_all(socks):

            async def all_answered() -> bool:
                # Each got its stream (a 200 waiting unread in its socket),
                # whether or not the first ones have ended since: on a loaded
                # machine the last may open after the first stalled out.
                measured["peak"] = max(measured["peak"], rss_mib(api.pid))
                measured["most_open"] = max(
                    measured.get("most_open", 0), await redis.zcard(open_streams)
                )
                return all(answered(sock) for sock in socks)

            async def all_closed() -> bool:
                measured["peak"] = max(measured["peak"], rss_mib(api.pid))
                return await redis.zcard(open_streams) == 0

            async def connections_closed() -> bool:
                return established(port) == 0

            try:
                await wait_for(all_answered, within_s=120, what="every slow reader's stream open")
                await wait_for(all_closed, within_s=240, what="every stalled stream closed")
                await wait_for(connections_closed, what="the stalled connections closed")
            finally:
                measured["end"] = rss_mib(api.pid)
                print(f"\nAPI RSS under {SLOW_READERS} slow readers (MiB): {measured}")
    assert measured["peak"] - measured["baseline"] < 256, measured


async def read_progress(http: httpx.AsyncClient, url: str) -> int:
    """Progress events read from the stream at ``url`` until 10 s pass with none."""
    found = 0
    async with aconnect_sse(http, "GET", url) as source:
        events = source.aiter_sse()
        while True:
            try:
                sse = await asyncio.wait_for(anext(events), 10)
            except TimeoutError:
                return found
            found += sse.event == "progress"
            if found == 10_000:
                return found
