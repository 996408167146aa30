"""Calls that answer (docs/agents.md): ``ctx.call`` writes its outbox row with
its checkpoint, the job waits holding nothing, the relay delivers once and
stores the receiver's answer as the checkpoint's value in the statement that
marks the row sent, and the job resumes with it. In process, on real Redis,
PostgreSQL and the fake webhook receiver over HTTP."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest
from aiohttp import web
from pydantic import BaseModel
from structlog.testing import capture_logs

from oncely import App, CallFailed, Context, Workflow, webhook
from oncely.fakes.mail import FakeMailServer
from oncely.outbox.relay import Relay, RelayConfig
from oncely.outbox.store import OutboxStore
from oncely.senders import SendersConfig, build_router
from oncely.senders.base import SendResult
from oncely.senders.webhook import verify
from tests.durable import Harness, Said, Text, drain, pending, until_async, wait_until_due
from tests.helpers import posts_served

SECRET = "whsec_" + "Y2FsbHMtdGhhdC1hbnN3ZXItdGVzdHM="


class Quote(BaseModel):
    ok: bool
    id: str
    data: dict[str, Any]


class Priced(BaseModel):
    price: int


async def quoted(request: Text, ctx: Context) -> Said:
    try:
        answer = await ctx.call("quote.request", {"text": request.text})
    except CallFailed as failed:
        return Said(said=f"failed:{failed.reason}:{failed.status}")
    # Code after the call runs on the resume; a replay gets the same answer.
    return Said(said=f"{answer.id}:{answer.data['text']}")


@dataclass
class Calls:
    harness: Harness
    relay: Relay
    mail: FakeMailServer
    workflow: str

    async def submit(self, text: str) -> str:
        return await self.harness.submit(f"/v1/{self.workflow}", {"text": text})

    async def run_worker(self) -> None:
        await drain(self.harness.worker(self.workflow))

    async def get(self, job_id: str) -> dict[str, Any]:
        return await self.harness.get(f"/v1/{self.workflow}", job_id)

    async def requests(self, job_id: str) -> dict[str, int]:
        by_key = (await self.mail.deliveries())["by_key"]
        return {k: n for k, n in by_key.items() if job_id in k}


def call_app(name: str, step: Callable[[Text, Context], Awaitable[Said]], returns: Any) -> App:
    return App(
        [
            Workflow(
                name=name,
                route=f"/v1/{name}",
                request=Text,
                result=Said,
                step=step,
                effects=[webhook("quote.request", returns=returns), webhook(f"{name}.plain")],
            )
        ]
    )


@pytest.fixture
async def calls(custom, pool, tmp_path) -> AsyncIterator[Callable[..., Awaitable[Calls]]]:
    opened: list[Any] = []

    async def make(
        step: Callable[[Text, Context], Awaitable[Said]] = quoted,
        returns: Any = Quote,
        url: str | None = None,
    ) -> Calls:
        name = f"calls{len(opened)}"
        app = call_app(name, step, returns)
        harness = await custom(app)
        mail = FakeMailServer(tmp_path / f"mailbox{len(opened)}.jsonl")
        await mail.__aenter__()
        config = SendersConfig(webhook_secret=SECRET, default_webhook_url=url or mail.events_url)
        router = build_router(app.effects(), config)
        opened.append((mail, router))

        async def resume(ids: list[str]) -> None:
            await harness.checkpoints.resume_due(len(ids), ids)

        relay = Relay(
            OutboxStore(pool),
            router,
            RelayConfig(batch=10, concurrency=4, backoff_base_s=0.01, backoff_max_s=0.02),
            resume=resume,
            rand=lambda: 1.0,
        )
        return Calls(harness, relay, mail, name)

    yield make
    for mail, router in opened:
        await router.aclose()
        await mail.__aexit__(None, None, None)


async def sent_once_and_resumed(c: Calls, job_id: str) -> None:
    """Relay until the call's row is sent or failed (retries due at once)."""
    for _ in range(50):
        await c.relay.run_once()
        rows = await c.harness.rows(
            "SELECT sent_at IS NOT NULL OR failed_at IS NOT NULL FROM outbox WHERE job_id = %s",
            job_id,
        )
        if rows and rows[0][0]:
            return
        async with c.harness.pool.connection() as conn:
            await conn.execute(
                "UPDATE outbox SET next_attempt_at = now() WHERE job_id = %s", (job_id,)
            )
    raise AssertionError("the call was never settled")


async def through_the_call(c: Calls, text: str) -> tuple[str, dict[str, Any]]:
    """A job of ``text`` run to its call, the call settled by the relay,
    and the job run again: its id, and the job as GET shows it."""
    job_id = await c.submit(text)
    await c.run_worker()
    await sent_once_and_resumed(c, job_id)
    await c.run_worker()
    return job_id, await c.get(job_id)


async def test_a_call_is_sent_once_and_its_answer_resumes_the_job(calls) -> None:
    c = await calls()
    job_id = await c.submit("Quote me a price.")
    await c.run_worker()

    # The job waits for the answer, holding no stream entry and no slot.
    view = await c.get(job_id)
    assert view["status"] == "waiting"
    assert view["waiting"]["call"] == "quote.request"
    assert view["waiting"].get("event") is None
    assert await pending(c.harness, c.workflow) == 0
    [(topic, key, call_key, sent)] = await c.harness.rows(
        "SELECT topic, dedupe_key, call_key, sent_at FROM outbox WHERE job_id = %s", job_id
    )
    assert (topic, key, call_key, sent) == (
        "quote.request",
        f"quote.request:{job_id}:quote.request",
        "quote.request",
        None,
    )

    # The relay delivers it once, stores the answer and resumes the job.
    await sent_once_and_resumed(c, job_id)
    assert await c.harness.status(job_id) == "queued"
    await c.run_worker()
    view = await c.get(job_id)
    assert view["status"] == "done"
    [event] = [e for e in await c.mail.events() if job_id in e["idempotency_key"]]
    assert view["result"]["said"] == f"{event['id']}:Quote me a price."
    assert [s["kind"] for s in view["steps"]] == ["call"]
    assert await c.requests(job_id) == {f"quote.request:{job_id}:quote.request": 1}
    # Signed per Standard Webhooks, Idempotency-Key the dedupe key too.
    assert verify(SECRET, event["headers"], event["body"].encode())
    assert await c.relay.run_once() == 0
    assert (await c.mail.deliveries())["effects"] == 1


async def test_a_refused_call_fails_without_a_retry_and_the_step_sees_why(calls) -> None:
    c = await calls()
    job_id, view = await through_the_call(c, "Refuse this one. [[fake:400]]")
    assert view["status"] == "done"
    assert view["result"]["said"] == "failed:refused:400"
    assert list((await c.requests(job_id)).values()) == [1], "a 4xx is not tried again"
    assert [s["status"] for s in view["steps"]] == ["failed"]
    [(error,)] = await c.harness.rows(
        "SELECT last_error FROM outbox WHERE job_id = %s AND failed_at IS NOT NULL", job_id
    )
    assert "400" in error


async def test_a_call_that_fails_transiently_is_tried_again_with_the_same_key(calls) -> None:
    c = await calls()
    job_id, view = await through_the_call(c, "Busy at first. [[fake:503*2]]")
    assert view["status"] == "done"
    assert view["result"]["said"].endswith("Busy at first. [[fake:503*2]]")
    assert await c.requests(job_id) == {f"quote.request:{job_id}:quote.request": 3}
    assert (await c.mail.deliveries())["effects"] == 1


async def test_an_answer_that_does_not_validate_fails_the_call(calls) -> None:
    c = await calls(returns=Priced)
    job_id, view = await through_the_call(c, "No price in the answer.")
    assert view["result"]["said"] == "failed:invalid_answer:None"
    assert list((await c.requests(job_id)).values()) == [1]


async def test_a_call_with_no_answer_in_its_time_fails_and_is_never_sent(calls) -> None:
    async def hurried(request: Text, ctx: Context) -> Said:
        try:
            await ctx.call("quote.request", {"text": request.text}, timeout=0.2)
        except CallFailed as failed:
            return Said(said=f"failed:{failed.reason}")
        return Said(said="answered")

    c = await calls(hurried)
    job_id = await c.submit("Nobody relays this.")
    await c.run_worker()
    await wait_until_due(c.harness, job_id)
    assert await c.harness.checkpoints.resume_due(10) != []
    await c.run_worker()
    assert (await c.get(job_id))["result"]["said"] == "failed:timeout"
    assert await c.relay.run_once() == 0, "a call that timed out is not sent any more"
    assert await c.requests(job_id) == {}


async def test_emit_on_a_call_and_call_on_a_plain_topic_are_type_errors(calls) -> None:
    async def confused(request: Text, ctx: Context) -> Said:
        if request.text == "emit":
            ctx.emit("quote.request", {"text": "x"})
        else:
            await ctx.call(f"{ctx.workflow}.plain", {"text": "x"})
        return Said(said="never")

    c = await calls(confused)
    ids = [await c.submit("emit"), await c.submit("call")]
    await c.run_worker()
    for job_id in ids:
        assert await c.harness.status(job_id) == "dead"
    [(first,), (second,)] = [
        (await c.harness.rows("SELECT error FROM jobs WHERE job_id = %s", i))[0] for i in ids
    ]
    assert "ctx.call" in first and "ctx.emit" in second
    assert await c.harness.outbox(ids[0]) == [] and await c.harness.outbox(ids[1]) == []


async def test_two_calls_in_one_run_each_wait_and_answer_in_turn(calls) -> None:
    async def twice(request: Text, ctx: Context) -> Said:
        first = await ctx.call("quote.request", {"text": "one"})
        second = await ctx.call("quote.request", {"text": "two"})
        return Said(said=f"{first.data['text']}+{second.data['text']}")

    c = await calls(twice)
    job_id = await c.submit("Two calls.")
    for _ in range(2):
        await c.run_worker()
        await sent_once_and_resumed(c, job_id)
        await until_async(lambda: _queued(c, job_id))
    await c.run_worker()
    view = await c.get(job_id)
    assert view["result"]["said"] == "one+two"
    assert [s["key"] for s in view["steps"]] == ["quote.request", "quote.request#2"]
    assert sorted((await c.requests(job_id)).values()) == [1, 1]


class HostileReceiver:
    """Answers every POST 200 with ``answer``, or (None) with a JSON body
    that never ends; counts the POSTs."""

    def __init__(self, answer: bytes | None) -> None:
        self.answer = answer
        self.posts = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.posts += 1
        await request.read()
        if self.answer is not None:
            return web.Response(body=self.answer, content_type="application/json")
        endless = web.StreamResponse(headers={"Content-Type": "application/json"})
        await endless.prepare(request)
        with contextlib.suppress(ConnectionError):  # the reader hung up: the test's point
            await endless.write(b'{"ok":true,"id":"h-1","data":{"text":"' + HOSTILE)
            while True:
                await endless.write(b"x" * 65536)
        return endless


@contextlib.asynccontextmanager
async def receiving(answer: bytes | None) -> AsyncIterator[tuple[HostileReceiver, str]]:
    receiver = HostileReceiver(answer)
    async with posts_served("/calls", receiver.handle) as url:
        yield receiver, url


async def any_answer(request: Text, ctx: Context) -> Said:
    try:
        await ctx.call("quote.request", {"text": request.text})
    except CallFailed as failed:
        return Said(said=f"failed:{failed.reason}:{failed.status}")
    return Said(said="answered")


# Text a hostile answer carries, which no log line may quote.
HOSTILE = b"HOSTILE-ANSWER-TEXT"


@pytest.mark.parametrize(
    "answer",
    [
        b'{"ok":true,"id":"h-1","data":{"text":"' + HOSTILE + b'\\u0000"}}',
        b'{"ok":true,"id":"h-1","data":{"' + HOSTILE + b'\\ud800":"a lone surrogate key"}}',
        b'{"ok":true,"id":"h-1","data":{"text":"' + HOSTILE + b'","n":1e400}}',
        None,  # endless: past ONCELY_CALL_ANSWER_MAX_BYTES (1 MiB) it is not read
    ],
    ids=["nul", "lone-surrogate-in-a-key", "number-out-of-range", "endless"],
)
async def test_an_answer_too_large_or_unstorable_fails_the_call_at_once(calls, answer) -> None:
    """A 2xx whose answer PostgreSQL could not store, or too large to read,
    ends the call after one POST as ``invalid_answer`` (never resent, never
    ``undeliverable``); the job resumes with the CallFailed, and no log
    line quotes the answer."""
    async with receiving(answer) as (receiver, url):
        c = await calls(any_answer, returns=True, url=url)
        job_id = await c.submit("Answer me badly.")
        await c.run_worker()
        with capture_logs() as logs:
            await sent_once_and_resumed(c, job_id)
            await c.run_worker()
        assert receiver.posts == 1, "a 2xx is never sent again"
    view = await c.get(job_id)
    assert view["status"] == "done"
    assert view["result"]["said"] == "failed:invalid_answer:None"
    assert [s["status"] for s in view["steps"]] == ["failed"]
    [(answered, failed, error)] = await c.harness.rows(
        "SELECT answer, failed_at IS NOT NULL, last_error FROM outbox WHERE job_id = %s", job_id
    )
    assert (answered, failed) == (None, True), "the failure is recorded, the answer is not"
    assert "bytes" in error
    assert [e for e in logs if e["event"] == "outbox.gave_up"] != []
    assert not [e for e in logs if HOSTILE.decode() in repr(e)], "no log line quotes the answer"


class Unchecked:
    """The router, but every answer is one the parse would have refused:
    the relay's own guard must hold if a check ever lets one through."""

    def __init__(self, router: Any) -> None:
        self.router = router

    async def send(self, topic: str, payload: dict[str, Any], dedupe_key: str) -> SendResult:
        sent = await self.router.send(topic, payload, dedupe_key)
        return replace(sent, answer={"text": HOSTILE.decode() + "\x00"})

    async def aclose(self) -> None:
        await self.router.aclose()


async def test_an_answer_postgresql_refuses_ends_the_call_once_even_past_the_parse(calls) -> None:
    c = await calls(any_answer, returns=True)
    c.relay.sender = Unchecked(c.relay.sender)
    job_id = await c.submit("Stored nowhere.")
    await c.run_worker()
    with capture_logs() as logs:
        await sent_once_and_resumed(c, job_id)
        await c.run_worker()
    assert list((await c.requests(job_id)).values()) == [1]
    view = await c.get(job_id)
    assert view["result"]["said"] == "failed:invalid_answer:None"
    [(error,)] = await c.harness.rows(
        "SELECT last_error FROM outbox WHERE job_id = %s AND failed_at IS NOT NULL", job_id
    )
    assert "SQLSTATE" in error and HOSTILE.decode() not in error
    assert not [e for e in logs if HOSTILE.decode() in repr(e)], "no log line quotes the answer"


async def _queued(c: Calls, job_id: str) -> bool:
    return await c.harness.status(job_id) in ("queued", "done")


def test_a_returns_that_is_neither_a_model_nor_true_is_refused() -> None:
    with pytest.raises(ValueError, match="returns"):
        webhook("x.y", returns=dict)  # type: ignore[arg-type]


async def test_a_replayed_call_asking_to_send_another_payload_ends_nondeterministic(
    calls,
) -> None:
    """Replay never lies: code that asks a stored call with another payload
    (here a counter that changes between deliveries) is not handed the
    stored answer of the first question; the job is dead, nondeterministic,
    naming the call and both payloads, and nothing is sent a second time."""
    asked = {"n": 0}

    async def drifting(request: Text, ctx: Context) -> Said:
        asked["n"] += 1
        answer = await ctx.call("quote.request", {"text": request.text, "n": asked["n"]})
        return Said(said=answer.id)

    c = await calls(drifting)
    counted = _divergence(c.workflow, "call")
    job_id = await c.submit("Quote me a price.")
    await c.run_worker()
    await sent_once_and_resumed(c, job_id)
    await c.run_worker()

    view = await c.get(job_id)
    assert view["status"] == "dead", view
    assert _divergence(c.workflow, "call") == counted + 1
    assert view["error"] == "nondeterministic"
    [(error,)] = await c.harness.rows("SELECT error FROM jobs WHERE job_id = %s", job_id)
    assert error is not None and "quote.request" in error
    assert '"n":1' in error and '"n":2' in error
    # One call went out: the first; the replay sent nothing.
    assert await c.requests(job_id) == {f"quote.request:{job_id}:quote.request": 1}
    [(rows,)] = await c.harness.rows("SELECT count(*) FROM outbox WHERE job_id = %s", job_id)
    assert rows == 1


async def test_a_replayed_model_turn_asked_otherwise_is_answered_as_stored_and_flagged(
    calls,
) -> None:
    """A model turn a replay asks with another prompt gets the stored answer
    (never paid again), and is counted and flagged on its step."""
    asked = {"n": 0}

    async def drifting(request: Text, ctx: Context) -> Said:
        asked["n"] += 1
        summary = await ctx.model.complete(f"{request.text} (run {asked['n']})")
        answer = await ctx.call("quote.request", {"text": request.text})
        return Said(said=f"{answer.id}:{summary}")

    c = await calls(drifting)
    counted = _divergence(c.workflow, "model")
    job_id = await c.submit("Quote me a price.")
    await c.run_worker()
    paid = c.harness.fake.stats().total
    await sent_once_and_resumed(c, job_id)
    await c.run_worker()

    view = await c.get(job_id)
    assert view["status"] == "done", view
    assert "(run 1)" in view["result"]["said"]
    assert c.harness.fake.stats().total == paid == 1
    [model] = [s for s in view["steps"] if s["kind"] == "model"]
    assert model["diverged"] is True
    assert all(not s["diverged"] for s in view["steps"] if s["kind"] != "model")
    assert _divergence(c.workflow, "model") == counted + 1


def _divergence(workflow: str, kind: str) -> float:
    """``oncely_replay_divergence_total`` for the workflow and kind, so far."""
    from prometheus_client import REGISTRY

    found = REGISTRY.get_sample_value(
        "oncely_replay_divergence_total", {"workflow": workflow, "kind": kind}
    )
    return found or 0.0
