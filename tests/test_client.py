"""oncely.client against the real API (in-process ASGI, or uvicorn on a real
port for the blocking client), real Redis and real PostgreSQL. Faults are
injected by transports that wrap the real one: they answer for the server,
or let the server answer and then cut the connection."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import httpx
import pytest

from oncely.api.problems import PROBLEM_BASE
from oncely.api.store import IdempotencyStore, new_token
from oncely.bootstrap import ApiServer, Resources, WorkerGroup, connect_llm
from oncely.builtin import app as builtin_app
from oncely.builtin.triage import Triage
from oncely.client import (
    AsyncClient,
    Backoff,
    Client,
    GaveUp,
    KeyReused,
    NotFound,
    OncelyClientError,
    PayloadTooLarge,
    Unauthorized,
    Unavailable,
    ValidationFailed,
    WaitTimedOut,
    retry_delay_s,
)
from oncely.client import errors as client_errors
from oncely.client.policy import retry_after_of
from oncely.identity import Scope, fingerprint
from tests.helpers import asgi_app, count
from tests.processes import free_port

SUMMARY = {"text": "Retries are safe. Effects happen once.", "notify": "ada@example.com"}
TICKET = {"subject": "Urgent: charged twice", "body": "My billing page shows two charges."}
BASE = "http://oncely.test"
FAST = Backoff(base_s=0.01, max_s=0.05)

# -- fault injection ------------------------------------------------------------------

Fault = int | str  # a status answered for the server, or "cut"


def synthetic(status: int) -> httpx.Response:
    """What the server says when busy (409) or its stores are down (503), but
    with ``Retry-After: 0`` so the test does not wait."""
    slug = {409: "idempotency-key-in-progress", 503: "unavailable"}.get(status, "internal")
    body = {"type": PROBLEM_BASE + slug, "title": "injected", "status": status}
    headers = {"Retry-After": "0", "Content-Type": "application/problem+json"}
    return httpx.Response(status, headers=headers, json=body)


class Script:
    """Records every request; the first ones get ``faults`` in turn."""

    def __init__(self, faults: list[Fault]) -> None:
        self.faults = list(faults)
        self.requests: list[httpx.Request] = []
        self.cut: list[httpx.Response] = []  # answers the client never saw
        self.seen: list[int] = []  # statuses the client did see

    def next_fault(self, request: httpx.Request) -> Fault | None:
        self.requests.append(request)
        return self.faults.pop(0) if self.faults else None

    def cut_off(self, request: httpx.Request, response: httpx.Response) -> httpx.ReadError:
        self.cut.append(response)
        return httpx.ReadError("connection reset after the server answered", request=request)

    def keys(self) -> list[str]:
        return [r.headers["idempotency-key"] for r in self.requests]


class AsyncFaults(httpx.AsyncBaseTransport):
    def __init__(self, inner: httpx.AsyncBaseTransport, *faults: Fault) -> None:
        self.inner = inner
        self.script = Script(list(faults))

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        fault = self.script.next_fault(request)
        if isinstance(fault, int):
            response = synthetic(fault)
        else:
            response = await self.inner.handle_async_request(request)
            await response.aread()
            if fault == "cut":
                raise self.script.cut_off(request, response)
        self.script.seen.append(response.status_code)
        return response


class SyncFaults(httpx.BaseTransport):
    def __init__(self, *faults: Fault) -> None:
        self.inner = httpx.HTTPTransport()
        self.script = Script(list(faults))

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        fault = self.script.next_fault(request)
        if isinstance(fault, int):
            response = synthetic(fault)
        else:
            response = self.inner.handle_request(request)
            response.read()
            if fault == "cut":
                raise self.script.cut_off(request, response)
        self.script.seen.append(response.status_code)
        return response

    def close(self) -> None:
        self.inner.close()


def always(answer: Callable[[httpx.Request], httpx.Response]) -> httpx.MockTransport:
    return httpx.MockTransport(answer)


# -- fixtures -------------------------------------------------------------------------


@pytest.fixture
def api(settings, redis, pool) -> httpx.ASGITransport:
    return httpx.ASGITransport(app=asgi_app(settings, redis, pool))


@pytest.fixture
def faults(api) -> Callable[..., AsyncFaults]:
    return lambda *f: AsyncFaults(api, *f)


@pytest.fixture
async def worker(worker_settings, redis, pool) -> AsyncIterator[None]:
    """A real worker group (fake model over HTTP) serving the built-in app."""
    settings = worker_settings.model_copy(update={"block_ms": 50})
    llm = connect_llm(settings)
    group = WorkerGroup(builtin_app, Resources(settings, redis, pool), llm)
    task = asyncio.create_task(group.run())
    yield
    group.stop()
    await task
    await llm.aclose()


@pytest.fixture
async def server(settings, redis, pool) -> AsyncIterator[str]:
    """The API on a real port (uvicorn in this event loop), for the blocking client."""
    port = free_port()
    api_server = ApiServer(
        builtin_app, Resources(settings, redis, pool), host="127.0.0.1", port=port
    )
    task = asyncio.create_task(api_server.run())
    base_url = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient() as probe:
        for _ in range(200):
            try:
                if (await probe.get(f"{base_url}/healthz")).status_code == 200:
                    break
            except httpx.TransportError:
                await asyncio.sleep(0.02)
    yield base_url
    api_server.stop()
    await task


async def jobs_and_entries(pool, redis, workflow: str = "summaries") -> tuple[int, int]:
    rows = await count(pool, "SELECT count(*) FROM jobs WHERE kind = %s", workflow)
    return rows, await redis.xlen(f"oncely:{{{workflow}}}:stream")


# -- the backoff math -----------------------------------------------------------------


def test_backoff_grows_exponentially_up_to_its_cap():
    backoff = Backoff(base_s=0.25, max_s=5.0)
    top = [retry_delay_s(n, remaining_s=60, backoff=backoff, rand=lambda: 1.0) for n in (1, 3, 9)]
    assert top == [0.25, 1.0, 5.0]
    assert retry_delay_s(4, remaining_s=60, backoff=backoff, rand=lambda: 0.5) == 1.0


def test_retry_after_is_a_floor_under_the_jitter():
    backoff = Backoff(base_s=0.25, max_s=5.0)
    low, high = (lambda: 0.0), (lambda: 1.0)
    assert retry_delay_s(1, remaining_s=60, backoff=backoff, retry_after_s=2, rand=low) == 2
    assert retry_delay_s(6, remaining_s=60, backoff=backoff, retry_after_s=2, rand=high) == 5.0
    assert retry_delay_s(1, remaining_s=60, backoff=backoff, retry_after_s=0, rand=low) == 0.0


def test_no_wait_reaches_into_the_last_try_before_the_deadline():
    backoff = Backoff(base_s=0.25, max_s=5.0)
    # Cut short so the next try has base_s left; that try is the last.
    assert retry_delay_s(9, remaining_s=1.25, backoff=backoff, rand=lambda: 1.0) == 1.0
    assert retry_delay_s(1, remaining_s=0.2, backoff=backoff, rand=lambda: 0.0) is None
    # The server asks for longer than the deadline allows: give up now.
    assert retry_delay_s(1, remaining_s=10, backoff=backoff, retry_after_s=30) is None


def test_retry_after_is_read_as_seconds_or_an_http_date():
    assert retry_after_of(httpx.Response(503, headers={"Retry-After": "3"})) == 3.0
    when = format_datetime(datetime.now(UTC) + timedelta(seconds=30), usegmt=True)
    parsed = retry_after_of(httpx.Response(503, headers={"Retry-After": when}))
    assert parsed is not None and 27 < parsed <= 30
    assert retry_after_of(httpx.Response(503)) is None
    assert retry_after_of(httpx.ConnectError("refused")) is None


def test_problem_base_is_the_servers():
    assert client_errors.PROBLEM_BASE == PROBLEM_BASE


# -- happy paths ----------------------------------------------------------------------


async def test_submit_to_both_workflows_and_read_them_queued(api, api_key, pool, redis):
    async with AsyncClient(BASE, api_key, transport=api) as client:
        summary = await client.submit("/v1/summaries", SUMMARY)
        ticket = await client.submit("/v1/triage", TICKET, "ticket-5678-triage-key")
        again = await client.submit("/v1/triage", TICKET, "ticket-5678-triage-key")
        read = await client.get("/v1/summaries", summary.job_id)

    assert (summary.status, summary.replayed) == ("queued", False)
    assert summary.location == f"/v1/summaries/{summary.job_id}"
    assert (again.job_id, again.replayed) == (ticket.job_id, True)
    assert (read.job_id, read.status, read.result, read.finished) == (
        summary.job_id,
        "queued",
        None,
        False,
    )
    assert await jobs_and_entries(pool, redis, "summaries") == (1, 1)
    assert await jobs_and_entries(pool, redis, "triage") == (1, 1)


async def test_wait_returns_the_done_job_with_its_result_parsed_into_the_model(
    api, api_key, worker
):
    async with AsyncClient(BASE, api_key, transport=api) as client:
        accepted = await client.submit("/v1/triage", TICKET)
        job = await client.wait("/v1/triage", accepted.job_id, timeout_s=20, result_type=Triage)
        summary = await client.submit("/v1/summaries", SUMMARY)
        summary_job = await client.wait("/v1/summaries", summary.job_id, timeout_s=20)

    assert job.status == "done"
    assert isinstance(job.result, Triage)
    assert (job.result.category, job.result.priority) == ("billing", "urgent")
    assert job.usage is not None and job.usage.model_calls == 1
    assert summary_job.status == "done"
    assert isinstance(summary_job.result, dict) and summary_job.result["summary"]
    assert summary_job.model_extra == {"summary": summary_job.result["summary"]}


async def test_wait_gives_up_on_a_job_still_queued(api, api_key):
    async with AsyncClient(BASE, api_key, transport=api, poll=FAST) as client:
        accepted = await client.submit("/v1/summaries", SUMMARY)
        started = time.monotonic()
        with pytest.raises(WaitTimedOut) as timed_out:
            # Long enough for the first read to answer on a loaded machine
            # (a first read that does not is the error it is, not a wait's).
            await client.wait("/v1/summaries", accepted.job_id, timeout_s=3.0)
    # Waited out its 3 s (the job stays queued: only the timeout ends it).
    assert time.monotonic() - started > 2.5
    assert timed_out.value.job.status == "queued"
    assert isinstance(timed_out.value, GaveUp)


async def test_a_wait_whose_last_read_runs_out_of_time_is_a_wait_timeout(api, api_key):
    """The first read answers (queued); the next ones hang until the wait's
    time is spent: the wait timed out on the job as last seen, the same
    error as when its time ends between reads."""
    reads: list[str] = []

    async def slow_after_the_first(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            reads.append(request.url.path)
            if len(reads) > 1:
                await asyncio.sleep(30)
        return await api.handle_async_request(request)

    transport = httpx.MockTransport(slow_after_the_first)
    async with AsyncClient(BASE, api_key, transport=transport, poll=FAST) as client:
        accepted = await client.submit("/v1/summaries", SUMMARY)
        with pytest.raises(WaitTimedOut) as timed_out:
            await client.wait("/v1/summaries", accepted.job_id, timeout_s=0.5)
    assert timed_out.value.job.status == "queued"
    assert isinstance(timed_out.value.__cause__, GaveUp)
    assert len(reads) >= 2


# -- retries keep one key and make one job --------------------------------------------


async def test_first_attempt_cut_after_the_server_accepted_still_makes_one_job(
    faults, api_key, pool, redis
):
    transport = faults("cut")
    async with AsyncClient(BASE, api_key, transport=transport, backoff=FAST) as client:
        accepted = await client.submit("/v1/summaries", SUMMARY)

    [lost] = transport.script.cut
    assert lost.status_code == 202
    assert str(accepted.job_id) == lost.json()["job_id"]
    assert accepted.replayed
    keys = transport.script.keys()
    assert len(keys) == 2 and len(set(keys)) == 1
    assert await jobs_and_entries(pool, redis) == (1, 1)


async def test_503_and_409_are_retried_with_the_same_key(faults, api_key, pool, redis, caplog):
    transport = faults(503, 409)
    caplog.set_level("INFO", logger="oncely.client")
    async with AsyncClient(BASE, api_key, transport=transport, backoff=FAST) as client:
        accepted = await client.submit("/v1/summaries", SUMMARY, "order-1234-confirmation")
    logs = [{"event": r.getMessage(), **r.__dict__} for r in caplog.records]

    assert transport.script.seen == [503, 409, 202]
    assert transport.script.keys() == ["order-1234-confirmation"] * 3
    assert not accepted.replayed
    assert await jobs_and_entries(pool, redis) == (1, 1)
    retries = [e for e in logs if e["event"] == "client.retrying"]
    assert [e["reason"] for e in retries] == ["503", "409"]
    assert api_key not in repr(logs)
    assert "order-1234-confirmation" not in repr(logs)


async def held_for(redis: Any, key: str, seconds: float) -> tuple[IdempotencyStore, Any]:
    """Another request holding ``key`` on the server for ``seconds``: the
    store (to close) and the timer that lets go (to cancel)."""
    store = IdempotencyStore(redis, lock_ttl_s=30, result_ttl_s=60)
    digest, token = Scope("acme", "POST", "/v1/summaries", key).digest, new_token()
    await store.claim(digest, fingerprint(SUMMARY), token)
    release = asyncio.get_running_loop().call_later(
        seconds, lambda: asyncio.ensure_future(store.release(digest, token))
    )
    return store, release


async def test_a_real_in_progress_key_is_retried_until_its_holder_lets_go(
    faults, api_key, pool, redis
):
    """Another request holds the key on the server: 409 with Retry-After: 1,
    honoured, then the key is free and this request is the one accepted."""
    key = "held-by-another-request"
    store, release = await held_for(redis, key, 0.5)
    transport = faults()
    started = time.monotonic()
    try:
        async with AsyncClient(BASE, api_key, transport=transport) as client:
            accepted = await client.submit("/v1/summaries", SUMMARY, key)
    finally:
        release.cancel()
        await store.aclose()

    assert time.monotonic() - started >= 1.0, "Retry-After: 1 was honoured"
    assert transport.script.seen[0] == 409 and transport.script.seen[-1] == 202
    assert set(transport.script.keys()) == {key}
    assert not accepted.replayed
    assert await jobs_and_entries(pool, redis) == (1, 1)


async def test_prefer_wait_lets_the_server_wait_out_the_duplicate(faults, api_key, pool, redis):
    key = "held-by-another-request"
    store, release = await held_for(redis, key, 0.3)
    transport = faults()
    try:
        async with AsyncClient(BASE, api_key, transport=transport) as client:
            accepted = await client.submit("/v1/summaries", SUMMARY, key, prefer_wait_s=5)
    finally:
        release.cancel()
        await store.aclose()

    assert transport.script.seen == [202], "one request, no 409"
    assert transport.script.requests[0].headers["prefer"] == "wait=5"
    assert await jobs_and_entries(pool, redis) == (1, 1)
    assert accepted.status == "queued"


# -- what is not retried --------------------------------------------------------------


async def test_a_reused_key_raises_key_reused_at_once(faults, api_key, pool, redis):
    key = "order-1234-confirmation"
    transport = faults()
    async with AsyncClient(BASE, api_key, transport=transport) as client:
        await client.submit("/v1/summaries", SUMMARY, key)
        with pytest.raises(KeyReused) as reused:
            await client.submit("/v1/summaries", {**SUMMARY, "text": "Another text."}, key)

    assert len(transport.script.requests) == 2, "no retry of the 422"
    error = reused.value
    assert (error.status, error.type) == (422, PROBLEM_BASE + "idempotency-key-reused")
    assert error.idempotency_key == key and key in str(error)
    assert api_key not in str(error)
    assert await jobs_and_entries(pool, redis) == (1, 1)


async def test_an_invalid_body_raises_validation_failed_with_the_errors(faults, api_key):
    transport = faults()
    async with AsyncClient(BASE, api_key, transport=transport) as client:
        with pytest.raises(ValidationFailed) as invalid:
            await client.submit("/v1/summaries", {"text": "", "notify": "ada@example.com"})
    assert len(transport.script.requests) == 1
    assert [e["loc"] for e in invalid.value.errors] == [["body", "text"]]
    assert "body.text: " in str(invalid.value)  # which field, where a person reads it


async def test_an_unknown_api_key_raises_unauthorized_without_showing_it(faults):
    secret = "sk-not-a-real-key-0123456789"
    transport = faults()
    async with AsyncClient(BASE, secret, transport=transport) as client:
        with pytest.raises(Unauthorized) as refused:
            await client.submit("/v1/summaries", SUMMARY)
    assert len(transport.script.requests) == 1
    assert refused.value.status == 401
    assert secret not in str(refused.value) and secret not in repr(refused.value)
    assert secret not in repr(client)


async def test_another_tenants_or_unknown_job_is_not_found(api, api_key):
    async with AsyncClient(BASE, api_key, transport=api) as client:
        with pytest.raises(NotFound):
            await client.get("/v1/summaries", "5b0c8e3e-7d0a-4f4e-9a53-0c7e1f7d2a61")


async def test_a_body_over_the_limit_raises_payload_too_large(settings, redis, pool, api_key):
    small = settings.model_copy(update={"max_body_bytes": 1000})
    api = httpx.ASGITransport(app=asgi_app(small, redis, pool))
    async with AsyncClient(BASE, api_key, transport=api) as client:
        with pytest.raises(PayloadTooLarge) as too_large:
            await client.submit("/v1/summaries", {**SUMMARY, "text": "x" * 2000})
    assert too_large.value.status == 413


def test_a_malformed_key_is_refused_before_sending():
    transport = always(lambda r: httpx.Response(500))
    with Client(BASE, "k", transport=transport) as client, pytest.raises(ValueError):
        client.submit("/v1/summaries", SUMMARY, "short")
    with Client(BASE, "k", transport=transport) as client, pytest.raises(ValueError):
        client.submit("/v1/summaries", SUMMARY, "sixteen-chars-but-not-ascii-é")


# -- the deadline ---------------------------------------------------------------------


async def test_a_server_that_stays_unavailable_is_given_up_on_at_the_deadline():
    transport = always(lambda r: synthetic(503))
    started = time.monotonic()
    async with AsyncClient(BASE, "k", transport=transport, deadline_s=1.0) as client:
        with pytest.raises(Unavailable) as gave_up:
            await client.submit("/v1/summaries", SUMMARY, "order-1234-confirmation")
    assert time.monotonic() - started > 0.5  # retried until the deadline, not given up sooner
    error = gave_up.value
    assert isinstance(error, GaveUp)
    assert error.status == 503 and error.attempts >= 2
    assert error.idempotency_key == "order-1234-confirmation"


async def test_no_answer_until_the_deadline_raises_deadline_exceeded():
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    async with AsyncClient(BASE, "k", transport=always(refuse), deadline_s=0.5) as client:
        with pytest.raises(GaveUp) as gave_up:
            await client.submit("/v1/summaries", SUMMARY)
    assert isinstance(gave_up.value.__cause__, httpx.ConnectError)
    assert gave_up.value.idempotency_key is not None


async def test_a_server_that_drips_its_answer_is_cut_at_the_attempt_timeout():
    async def drip(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(30)
        return httpx.Response(202)

    async with AsyncClient(
        BASE, "k", transport=httpx.MockTransport(drip), timeout=0.2, deadline_s=0.6
    ) as client:
        with pytest.raises(GaveUp):
            await client.submit("/v1/summaries", SUMMARY)
    # The server drips for 30 s, past the test's timeout: it was cut.


async def test_a_retry_after_past_the_deadline_gives_up_at_once():
    busy = {"Retry-After": "120"}
    transport = always(lambda r: httpx.Response(429, headers=busy))
    async with AsyncClient(BASE, "k", transport=transport, deadline_s=5) as client:
        with pytest.raises(GaveUp) as gave_up:
            await client.submit("/v1/summaries", SUMMARY)
    # Not the 120 s asked for: that is past the test's timeout.
    assert (gave_up.value.status, gave_up.value.attempts) == (429, 1)


# -- the blocking client, over a real socket ------------------------------------------


async def test_blocking_client_submits_and_waits_for_the_result(server, api_key, worker):
    def run() -> tuple[Any, Any]:
        with Client(server, api_key) as client:
            accepted = client.submit("/v1/triage", TICKET)
            return accepted, client.wait(
                "/v1/triage", accepted.job_id, timeout_s=20, result_type=Triage
            )

    accepted, job = await asyncio.to_thread(run)
    assert job.job_id == accepted.job_id
    assert job.status == "done" and isinstance(job.result, Triage)


async def test_blocking_client_retries_a_cut_first_attempt_and_a_503(server, api_key, pool, redis):
    transport = SyncFaults("cut", 503)

    def run() -> Any:
        with Client(server, api_key, transport=transport, backoff=FAST) as client:
            return client.submit("/v1/summaries", SUMMARY)

    accepted = await asyncio.to_thread(run)
    [lost] = transport.script.cut
    assert str(accepted.job_id) == lost.json()["job_id"]
    assert transport.script.seen == [503, 202] and accepted.replayed
    assert len(set(transport.script.keys())) == 1 and len(transport.script.keys()) == 3
    assert await jobs_and_entries(pool, redis) == (1, 1)


async def test_blocking_client_waits_for_an_api_that_is_not_up_yet(settings, redis, pool, api_key):
    """Connection refused is retried until the API listens."""
    port = free_port()
    api_server = ApiServer(
        builtin_app, Resources(settings, redis, pool), host="127.0.0.1", port=port
    )

    def run() -> Any:
        with Client(f"http://127.0.0.1:{port}", api_key, backoff=FAST, deadline_s=20) as client:
            return client.submit("/v1/summaries", SUMMARY)

    submitting = asyncio.create_task(asyncio.to_thread(run))
    await asyncio.sleep(0.5)
    assert not submitting.done()
    serving = asyncio.create_task(api_server.run())
    try:
        accepted = await asyncio.wait_for(submitting, 20)
    finally:
        api_server.stop()
        await serving
    assert accepted.status == "queued"
    assert await jobs_and_entries(pool, redis) == (1, 1)


def test_every_client_error_shares_one_base():
    for cls in (KeyReused, ValidationFailed, Unauthorized, NotFound, PayloadTooLarge):
        assert issubclass(cls, OncelyClientError)
    assert issubclass(Unavailable, GaveUp)
