"""Live streams under hostile or careless clients (docs/streaming.md,
docs/security.md), on the real API served by uvicorn in this process and
real Redis and PostgreSQL: a resume id that is no event id is refused and
never reaches the reader other tenants share; the shared reader outlives a
key it cannot read, an entry it cannot decode and its own failure; a client
that reads nothing keeps its place counted and is closed once its writes
stall; the process bounds its open streams; a streamed POST refused at a
cap accepts no job; a stream token dies with its API key."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from oncely import names
from oncely.api.auth import (
    announce_revocation,
    create_api_key,
    erase_tenant_api_keys,
    revoke_api_key,
)
from oncely.api.streaming import StreamConfig
from oncely.live.events import JobEvents
from oncely.live.follow import Followers, Watcher
from oncely.live.tokens import StreamTokens
from tests.helpers import asgi_app, count
from tests.processes import wait_for
from tests.test_streams import BODY, Served, read, served, serving

__all__ = ["served"]

MALFORMED_IDS = ["abc", "-5", "1-2-3", str(2**64), "$", "+"]


async def post_job(http: httpx.AsyncClient, base: str, auth: dict[str, str]) -> str:
    headers = {**auth, "Idempotency-Key": f"hostile-{uuid.uuid4()}"}
    r = await http.post(f"{base}/v1/summaries", json=BODY, headers=headers)
    assert r.status_code == 202, r.text
    return str(r.json()["job_id"])


async def post_streamed(
    http: httpx.AsyncClient, base: str, headers: dict[str, str]
) -> httpx.Response:
    """``BODY`` posted with ``headers``, asking for the job's stream."""
    headers = {**headers, "Accept": "text/event-stream"}
    return await http.post(f"{base}/v1/summaries", json=BODY, headers=headers)


@contextlib.asynccontextmanager
async def served_with_a_job(
    settings: Any, redis: Any, pool: Any, auth: dict[str, str], **update: Any
) -> AsyncIterator[tuple[str, httpx.AsyncClient, str]]:
    """An API of ``settings`` (``update`` applied) served, and a job of
    ``auth``'s posted: the base URL, a client, and the job's stream URL."""
    app = asgi_app(settings.model_copy(update=update), redis, pool)
    async with serving(app) as base, httpx.AsyncClient(timeout=30) as http:
        job_id = await post_job(http, base, auth)
        yield base, http, f"{base}/v1/summaries/{job_id}/stream"


# -- 2: one client's Last-Event-ID affects that client only ---------------------------


async def test_malformed_resume_ids_are_refused_and_another_tenants_stream_goes_on(
    served: Served, pool
) -> None:
    """globex sends every malformed id while acme follows its job on the
    same API process: each is a 400 problem, and acme's stream gets its
    job's events live (status, tokens, step), then its end."""
    globex = {"Authorization": f"Bearer {await create_api_key(pool, 'globex')}"}
    async with httpx.AsyncClient(timeout=30) as http, contextlib.AsyncExitStack() as stack:
        victim_job = await served.post(http)
        hostile_job = await post_job(http, served.base, globex)
        opened = asyncio.Event()
        victim_url = f"{served.base}/v1/summaries/{victim_job}/stream"
        victim = asyncio.create_task(read(http, victim_url, served.auth, opened=opened))
        await asyncio.wait_for(opened.wait(), 30)
        hostile_url = f"{served.base}/v1/summaries/{hostile_job}/stream"
        hostile = []
        for bad in MALFORMED_IDS:
            for headers, url in (
                ({**globex, "Last-Event-ID": bad}, hostile_url),
                (globex, f"{hostile_url}?after={bad}"),
            ):
                response = await stack.enter_async_context(http.stream("GET", url, headers=headers))
                hostile.append((response.status_code, response.headers["content-type"]))
                if response.status_code == 400:
                    await response.aread()
                    assert response.json()["type"].endswith("/bad-request")
        await served.run_jobs()
        events = await asyncio.wait_for(victim, 30)

    kinds = [kind for _, kind, _ in events]
    assert {"status", "token", "step"} <= set(kinds), kinds
    assert kinds[-1] == "end" and events[-1][2]["status"] == "done"
    assert hostile == [(400, "application/problem+json")] * 2 * len(MALFORMED_IDS)


@contextlib.asynccontextmanager
async def followers(redis: Any, **options: Any) -> AsyncIterator[Followers]:
    found = Followers(redis, block_ms=20, **options)
    try:
        yield found
    finally:
        await found.aclose()


async def next_event(watcher: Watcher) -> Any:
    return await asyncio.wait_for(watcher.queue.get(), 10)


async def test_a_key_the_reader_cannot_read_cuts_off_its_own_watchers_only(redis) -> None:
    """One job's events key is no stream (WRONGTYPE), another's entry is no
    event: their watchers are cut off (``None``), logged, and the watcher of
    a third job on the same reader gets its events."""
    events = JobEvents(redis)
    wrong_type, garbled, healthy = (str(uuid.uuid4()) for _ in range(3))
    await redis.set(names.job_events("summaries", wrong_type), "not a stream")
    await redis.xadd(names.job_events("summaries", garbled), {"type": "status", "data": "{"})
    with capture_logs() as logs:
        async with (
            followers(redis) as shared,
            shared.watch("summaries", wrong_type, "0-0") as cut,
            shared.watch("summaries", garbled, "0-0") as undecodable,
            shared.watch("summaries", healthy, "0-0") as watching,
        ):
            events.publish("summaries", healthy, "status", {"status": "running"})
            await events.drain()
            assert (await next_event(watching)).data == {"status": "running"}
            assert await next_event(cut) is None
            assert await next_event(undecodable) is None
            events.publish("summaries", healthy, "status", {"status": "queued"})
            await events.drain()
            assert (await next_event(watching)).data == {"status": "queued"}
    failed = [e for e in logs if e["event"] == "live.watch_failed"]
    assert sorted(e["error"] for e in failed) == ["JSONDecodeError", "ResponseError"]


async def test_a_malformed_id_is_never_watched(redis) -> None:
    async with followers(redis) as shared:
        for bad in MALFORMED_IDS:
            with pytest.raises(ValueError):
                async with shared.watch("summaries", str(uuid.uuid4()), bad):
                    pass


async def test_a_reader_that_fails_is_logged_and_started_again(redis, monkeypatch) -> None:
    """Whatever breaks the shared reader, it never dies silently: logged
    with a stable name, started again, and its watchers get the next events."""
    events = JobEvents(redis)
    job = str(uuid.uuid4())
    hand_out = Followers._hand_out
    failures = [RuntimeError("a bug in the reader")]

    def failing_once(self: Followers, *args: Any) -> None:
        if failures:
            raise failures.pop()
        hand_out(self, *args)

    monkeypatch.setattr(Followers, "_hand_out", failing_once)
    with capture_logs() as logs:
        async with followers(redis) as shared, shared.watch("summaries", job, "0-0") as watcher:
            events.publish("summaries", job, "status", {"status": "running"})
            await events.drain()
            assert (await next_event(watcher)).data == {"status": "running"}
    names_logged = [e["event"] for e in logs]
    assert "live.reader_failed" in names_logged and "live.reader_restarted" in names_logged
    failed = next(e for e in logs if e["event"] == "live.reader_failed")
    assert failed["error"] == "RuntimeError" and "a bug" not in json.dumps(failed)


# -- 3: slow readers are bounded ---------------------------------------------------


async def test_a_watcher_too_far_behind_is_cut_off_at_its_limit(redis) -> None:
    events = JobEvents(redis)
    job = str(uuid.uuid4())
    with capture_logs() as logs:
        async with followers(redis, limit=3) as shared, shared.watch("summaries", job, "0-0") as w:
            for n in range(5):
                events.publish("summaries", job, "progress", {"data": n, "step": None})
            await events.drain()

            async def cut() -> bool:
                return w.cut

            await wait_for(cut, what="the watcher cut off")
            held = [w.queue.get_nowait() for _ in range(w.queue.qsize())]
    assert [e.data["data"] for e in held[:-1]] == [0, 1, 2] and held[-1] is None
    assert "live.watch_overflowed" in [e["event"] for e in logs]


async def test_a_long_history_is_sent_whole_and_in_order_a_page_at_a_time(served) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        job_id = await served.post(http)
        for n in range(345):
            served.events.publish("summaries", job_id, "progress", {"data": n, "step": None})
        await served.events.drain()
        url = f"{served.base}/v1/summaries/{job_id}/stream"
        opened = asyncio.Event()
        reading = asyncio.create_task(read(http, url, served.auth, opened=opened))
        await asyncio.wait_for(opened.wait(), 30)
        await served.run_jobs()
        events = await asyncio.wait_for(reading, 30)
    got = [d["data"] for _, kind, d in events if kind == "progress"]
    assert got == list(range(345))
    assert events[-1][1] == "end"


def stalled_client(base: str, path: str, headers: dict[str, str]) -> socket.socket:
    """A client that asks for ``path`` and never reads a byte of the answer."""
    host, port = base.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n{head}\r\n".encode())
    return sock


def answered(sock: socket.socket) -> bool:
    """Whether a stalled client's stream began (``HTTP/1.1 200`` is in its
    socket), read without taking it, so the client stays stalled."""
    try:
        head = sock.recv(12, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False
    return head.startswith(b"HTTP/1.1 200")


@contextlib.contextmanager
def closing_all(socks: list[socket.socket]) -> Iterator[list[socket.socket]]:
    try:
        yield socks
    finally:
        for sock in socks:
            sock.close()


async def long_history(events: JobEvents, job_id: str, count: int, size: int) -> None:
    """``count`` progress events of about ``size`` bytes each."""
    for n in range(count):
        events.publish("summaries", job_id, "progress", {"data": "x" * size, "step": str(n)})
        if n % 1000 == 999:
            await events.drain()
    await events.drain()


def stream_app(settings: Any, redis: Any, pool: Any, config: StreamConfig) -> Any:
    app = asgi_app(settings, redis, pool)
    app.state.oncely.live.config = config
    return app


async def held(redis: Any, tenant: str = "acme") -> list[tuple[str, float]]:
    key = names.open_streams(names.tenant_digest(tenant))
    return [(str(m), float(s)) for m, s in await redis.zrange(key, 0, -1, withscores=True)]


async def test_a_client_that_reads_nothing_keeps_its_place_counted(
    settings, redis, pool, auth
) -> None:
    """Its writes blocked behind a long history, the stream's place in its
    tenant's set is still renewed (by a timer): past the moment it would
    have lapsed, the tenant at its limit still gets 429."""
    # Stalled writes end the stream only after a minute here: this test is
    # about the place, not the bound.
    config = StreamConfig(per_tenant=1, heartbeat_s=0.3, stall_after_s=60.0)
    app = stream_app(settings, redis, pool, config)
    events = JobEvents(redis)
    async with serving(app) as base, httpx.AsyncClient(timeout=30) as http:
        job_id = await post_job(http, base, auth)
        await long_history(events, job_id, 4000, 2000)
        path = f"/v1/summaries/{job_id}/stream"
        with closing_all([stalled_client(base, path, auth)]):

            async def admitted() -> bool:
                return len(await held(redis)) == 1

            await wait_for(admitted, what="the stalled stream's place")
            [(_, first_lapse)] = await held(redis)

            async def lapsed_unless_renewed() -> bool:
                return time.time() * 1000 > first_lapse

            await wait_for(lapsed_unless_renewed, what="the first lapse")
            [(_, lapse_now)] = await held(redis)
            second = await http.get(f"{base}{path}", headers=auth)
    assert lapse_now > first_lapse, "renewed while its writes were blocked"
    assert second.status_code == 429, second.text


async def test_a_stream_whose_writes_stall_is_closed_and_gives_its_place_back(
    settings, redis, pool, auth
) -> None:
    config = StreamConfig(per_tenant=5, heartbeat_s=0.3)
    app = stream_app(settings, redis, pool, config)
    live = app.state.oncely.live
    events = JobEvents(redis)
    with capture_logs() as logs:
        async with serving(app) as base, httpx.AsyncClient(timeout=30) as http:
            job_id = await post_job(http, base, auth)
            await long_history(events, job_id, 4000, 2000)
            path = f"/v1/summaries/{job_id}/stream"
            with closing_all([stalled_client(base, path, auth)]) as [sock]:

                async def opened() -> bool:
                    return live.open == 1

                await wait_for(opened, what="the stalled stream open")

                async def closed() -> bool:
                    return live.open == 0 and not await held(redis)

                await wait_for(closed, what="the stalled stream closed")
                assert await asyncio.to_thread(read_to_eof, sock) > 0
    assert "stream.stalled" in [e["event"] for e in logs]


def read_to_eof(sock: socket.socket) -> int:
    """Bytes read until the server closed the connection."""
    sock.settimeout(30)
    total = 0
    while chunk := sock.recv(65536):
        total += len(chunk)
    return total


async def test_past_the_process_cap_a_stream_is_503_and_a_streamed_post_accepts_nothing(
    settings, redis, pool, auth
) -> None:
    capped = served_with_a_job(settings, redis, pool, auth, streams_per_process=1)
    async with capped as (base, http, url), http.stream("GET", url, headers=auth) as first:
        assert first.status_code == 200
        second = await http.get(url, headers=auth)
        key = {"Idempotency-Key": "over-the-process-cap"}
        streamed = await post_streamed(http, base, {**auth, **key})
        jobs = await count(pool, "SELECT count(*) FROM jobs")
    assert second.status_code == 503 and second.json()["type"].endswith("/unavailable")
    assert second.headers["retry-after"]
    assert streamed.status_code == 503 and jobs == 1


# -- 10: a streamed POST refused at the stream cap is not accepted ---------------------


async def test_a_streamed_post_refused_at_the_tenant_cap_creates_no_job(
    settings, redis, pool, auth
) -> None:
    capped = served_with_a_job(settings, redis, pool, auth, streams_per_tenant=1)
    async with capped as (base, http, url):
        headers = {**auth, "Idempotency-Key": "refused-at-the-cap-01"}
        async with http.stream("GET", url, headers=auth) as first:
            assert first.status_code == 200
            refused = await post_streamed(http, base, headers)
            jobs_at_cap = await count(pool, "SELECT count(*) FROM jobs")
        # The key was never claimed: the same request later is a new job.
        later = await http.post(f"{base}/v1/summaries", json=BODY, headers=headers)
    assert refused.status_code == 429 and refused.json()["type"].endswith("/rate-limited")
    assert jobs_at_cap == 1
    assert later.status_code == 202 and "idempotent-replayed" not in later.headers
    assert await count(pool, "SELECT count(*) FROM jobs") == 2


async def test_a_streamed_post_with_a_malformed_resume_id_creates_no_job(served, pool) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        headers = {"Idempotency-Key": "malformed-resume-01", "Last-Event-ID": "$"}
        r = await post_streamed(http, served.base, {**served.auth, **headers})
    assert r.status_code == 400 and r.json()["type"].endswith("/bad-request")
    assert await count(pool, "SELECT count(*) FROM jobs") == 0


# -- 11: stream tokens die with their key ------------------------------------------


async def stream_token(http: httpx.AsyncClient, base: str, job_id: str, auth: Any) -> str:
    r = await http.post(f"{base}/v1/summaries/{job_id}/stream-token", headers=auth)
    assert r.status_code == 200, r.text
    return str(r.json()["token"])


async def opens(http: httpx.AsyncClient, url: str) -> int:
    async with http.stream("GET", url) as response:
        return response.status_code


async def test_a_stream_token_dies_with_its_key_revoked_or_erased(settings, redis, pool) -> None:
    """A key cache of an hour: only the revocation's announcement can close
    the token, as it closes the key."""
    app = asgi_app(settings.model_copy(update={"api_key_cache_s": 3600}), redis, pool)
    revoked, kept, erased = [await create_api_key(pool, t) for t in ("acme", "acme", "globex")]
    async with serving(app) as base, httpx.AsyncClient(timeout=30) as http:
        tokens = {}
        for key in (revoked, kept, erased):
            auth = {"Authorization": f"Bearer {key}"}
            job_id = await post_job(http, base, auth)
            token = await stream_token(http, base, job_id, auth)
            tokens[key] = f"{base}/v1/summaries/{job_id}/stream?token={token}"
            assert await opens(http, tokens[key]) == 200
        await revoke_api_key(pool, revoked)
        await erase_tenant_api_keys(pool, "globex")
        await announce_revocation(redis)

        async def refused() -> bool:
            codes = [await opens(http, tokens[k]) for k in (revoked, erased)]
            return codes == [401, 401]

        await wait_for(refused, what="both tokens refused")
        still = await opens(http, tokens[kept])
    assert still == 200, "a token of a key still active still opens"


async def test_a_token_that_names_no_key_opens_nothing(served, redis) -> None:
    """Tokens given before they named their key (or forged without one,
    with the shared secret) are refused."""
    async with httpx.AsyncClient(timeout=30) as http:
        job_id = await served.post(http)
        # Signed with the secret every API process shares: genuine, but keyless.
        token, _ = await StreamTokens(redis).issue("summaries", job_id, "acme")
        status = await opens(http, f"{served.base}/v1/summaries/{job_id}/stream?token={token}")
    assert status == 401


async def test_open_streams_end_when_their_key_is_revoked(settings, redis, pool) -> None:
    """Streams opened with a key, or with a token given for it, end within a
    heartbeat once the key is revoked; a stream of another key goes on."""
    update = {"api_key_cache_s": 3600, "stream_heartbeat_s": 0.3}
    app = asgi_app(settings.model_copy(update=update), redis, pool)
    revoked, kept = [await create_api_key(pool, "acme") for _ in range(2)]
    with capture_logs() as logs:
        async with serving(app) as base, httpx.AsyncClient(timeout=30) as http:
            auth = {"Authorization": f"Bearer {revoked}"}
            job_id = await post_job(http, base, auth)
            url = f"{base}/v1/summaries/{job_id}/stream"
            token = await stream_token(http, base, job_id, auth)
            follows = [
                (url, auth),
                (f"{url}?token={token}", {}),
                (url, {"Authorization": f"Bearer {kept}"}),
            ]
            readers = [asyncio.create_task(until_closed(http, u, h)) for u, h in follows]

            async def all_open() -> bool:
                return app.state.oncely.live.open == 3

            await wait_for(all_open, what="three streams open")
            await revoke_api_key(pool, revoked)
            await announce_revocation(redis)
            await asyncio.wait_for(asyncio.gather(*readers[:2]), 30)
            still_open = not readers[2].done()
            readers[2].cancel()
    assert still_open, "the other key's stream goes on"
    assert [e["event"] for e in logs].count("stream.key_revoked") == 2


async def until_closed(http: httpx.AsyncClient, url: str, headers: dict[str, str]) -> None:
    """Follow the stream until the server ends it (however it does)."""
    with contextlib.suppress(httpx.TransportError):
        async with http.stream("GET", url, headers=headers) as response:
            assert response.status_code == 200
            async for _ in response.aiter_bytes():
                pass
