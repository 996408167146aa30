"""Live job streams (docs/streaming.md), read with an SSE client library
(httpx-sse, not our own parser) from the real API served by uvicorn in
this process, the jobs run by the real worker loop on real Redis and
PostgreSQL: ids that only increase, an end that is exactly GET's answer,
resumes that repeat nothing, a stream that survives Redis losing every
event, tokens that open one job only, the intake's own stream, and the
bound on open streams."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn
from httpx_sse import aconnect_sse

from oncely.api.auth import create_api_key
from oncely.bootstrap import connect_llm, step_config
from oncely.builtin.summaries import summaries
from oncely.jobs.handler import WorkflowHandler
from oncely.jobs.records import JobSpec
from oncely.live.events import JobEvents
from oncely.outbox.wakeup import OutboxWakeUp
from oncely.queue.worker import Worker
from tests.helpers import asgi_app, make_worker
from tests.processes import free_port, wait_for

BODY = {"text": "Streams show the job. Each event once. The end is GET.", "notify": "a@example.com"}


@dataclass
class Served:
    base: str
    auth: dict[str, str]
    worker: Worker
    events: JobEvents

    async def post(self, http: httpx.AsyncClient, key: str | None = None) -> str:
        headers = {**self.auth, "Idempotency-Key": key or f"stream-{uuid.uuid4()}"}
        r = await http.post(f"{self.base}/v1/summaries", json=BODY, headers=headers)
        assert r.status_code == 202, r.text
        return str(r.json()["job_id"])

    async def run_jobs(self) -> None:
        await self.worker.run_once()
        await self.worker.wait_idle()
        await self.events.drain()


@contextlib.asynccontextmanager
async def serving(app: Any) -> AsyncIterator[str]:
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, lifespan="off")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        app.state.oncely.live.stop()
        server.should_exit = True
        await task


@pytest.fixture
async def served(settings, redis, pool, jobs, worker_settings) -> AsyncIterator[Served]:
    key = await create_api_key(pool, "acme")
    app = asgi_app(settings, redis, pool)
    events = JobEvents(redis)
    llm = connect_llm(worker_settings)
    handler = WorkflowHandler(
        summaries, jobs, llm, step_config(worker_settings), OutboxWakeUp(pool), events=events
    )
    stream = jobs.streams["summaries"]
    await stream.ensure_group()
    worker = make_worker(stream, handler, pool)
    async with serving(app) as base:
        yield Served(base, {"Authorization": f"Bearer {key}"}, worker, events)
    await llm.aclose()  # type: ignore[attr-defined]


async def read(
    http: httpx.AsyncClient,
    url: str,
    headers: dict[str, str],
    until_end: bool = True,
    opened: asyncio.Event | None = None,
) -> list[tuple[str, str, Any]]:
    """Every event of the stream at ``url`` until ``end`` (or it closes);
    ``opened`` is set at the first event (the reader is following)."""
    found = []
    async with aconnect_sse(http, "GET", url, headers=headers) as source:
        assert source.response.status_code == 200, await source.response.aread()
        async for sse in source.aiter_sse():
            found.append((sse.id, sse.event, json.loads(sse.data)))
            if opened is not None:
                opened.set()
            if until_end and sse.event == "end":
                break
    return found


async def follow_then_run(
    served: Served, http: httpx.AsyncClient, job_id: str
) -> list[tuple[str, str, Any]]:
    """Open the job's stream, run the queue once it is followed, and read
    the stream to its end."""
    url = f"{served.base}/v1/summaries/{job_id}/stream"
    opened = asyncio.Event()
    reading = asyncio.create_task(read(http, url, served.auth, opened=opened))
    await asyncio.wait_for(opened.wait(), 30)
    await served.run_jobs()
    return await asyncio.wait_for(reading, 30)


def streamed_text(events: list[tuple[str, str, Any]]) -> str:
    """The tokens a client keeps: those after the last ``reset``."""
    kept: list[str] = []
    for _, kind, data in events:
        if kind == "reset":
            kept = []
        elif kind == "token":
            kept.append(data["text"])
    return "".join(kept)


def ids(events: list[tuple[str, str, Any]]) -> list[tuple[int, int]]:
    return [tuple(int(p) for p in i.split("-")) for i, _, _ in events if i]  # type: ignore[misc]


async def test_a_job_streams_its_status_and_steps_then_ends_with_what_get_answers(served) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        job_id = await served.post(http)
        events = await follow_then_run(served, http, job_id)
        got = (await http.get(f"{served.base}/v1/summaries/{job_id}", headers=served.auth)).json()

    kinds = [kind for _, kind, _ in events]
    assert kinds[0] == "snapshot" and kinds[-1] == "end"
    assert ("status", "running") in [(k, d.get("status")) for _, k, d in events]
    assert [d["key"] for _, k, d in events if k == "step"] == ["model"]
    assert events[-1][2] == got, "end is exactly what GET answers"
    assert ids(events) == sorted(set(ids(events))), "ids strictly increase"
    # The built-in summaries stream their model call: the tokens are the answer.
    assert "token" in kinds and "reset" not in kinds
    assert kinds.index("token") < kinds.index("step")
    assert streamed_text(events) == got["result"]["summary"]


@pytest.mark.parametrize("door", ["api", "cli"])
async def test_an_operator_cancel_reaches_an_open_stream_whichever_door(
    served, settings, door: str
) -> None:
    """A page follows a queued job; a person cancels it through the API or
    ``oncely jobs cancel``: the stream hears ``cancelled`` at once (not at
    its next heartbeat's look at PostgreSQL), then ends with GET's answer."""
    from oncely.cli.ops import cancel_job

    async with httpx.AsyncClient(timeout=30) as http:
        job_id = await served.post(http)
        url = f"{served.base}/v1/summaries/{job_id}/stream"
        opened = asyncio.Event()
        reading = asyncio.create_task(read(http, url, served.auth, opened=opened))
        await asyncio.wait_for(opened.wait(), 30)
        if door == "api":
            r = await http.post(f"{served.base}/v1/summaries/{job_id}/cancel", headers=served.auth)
            assert r.status_code == 202, r.text
        else:
            found = await cancel_job(settings, uuid.UUID(job_id), workflow=None)
            assert found is not None and found.status == "queued"
        events = await asyncio.wait_for(reading, 30)
        got = (await http.get(f"{served.base}/v1/summaries/{job_id}", headers=served.auth)).json()

    # A finishing status event ends the stream under its own id; the
    # heartbeat's look at PostgreSQL would end it under the last id seen
    # ("0-0" here: the job never ran, so it has no event).
    end_id, kind, data = events[-1]
    assert kind == "end" and data == got and got["status"] == "cancelled", events
    assert end_id not in ("", "0-0"), "ended at its heartbeat: nobody told it of the cancel"


async def test_a_stream_cut_mid_answer_sends_reset_and_the_kept_tokens_are_the_answer(
    served,
) -> None:
    body = {**BODY, "text": "[[fake:cut*1]] [[fake:typing=0.01]] " + BODY["text"]}
    async with httpx.AsyncClient(timeout=30) as http:
        headers = {**served.auth, "Idempotency-Key": f"cut-{uuid.uuid4()}"}
        r = await http.post(f"{served.base}/v1/summaries", json=body, headers=headers)
        job_id = r.json()["job_id"]
        events = await follow_then_run(served, http, job_id)
        got = (await http.get(f"{served.base}/v1/summaries/{job_id}", headers=served.auth)).json()

    assert got["status"] == "done"
    kinds = [kind for _, kind, _ in events]
    first_reset = kinds.index("reset")
    assert "token" in kinds[:first_reset], "the cut attempt streamed before it was cut"
    assert [d["attempt"] for _, k, d in events if k == "reset"] == [2]
    assert streamed_text(events) == got["result"]["summary"]
    half = "".join(d["text"] for _, k, d in events[:first_reset] if k == "token")
    assert half != got["result"]["summary"], "the cut attempt did not stream it all"


async def test_a_resume_after_an_id_repeats_nothing_and_a_finished_job_ends_at_once(
    served,
) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        job_id = await served.post(http)
        await served.run_jobs()
        url = f"{served.base}/v1/summaries/{job_id}/stream"
        finished = await read(http, url, served.auth)
        assert [k for _, k, _ in finished] == ["snapshot", "end"]

        # From the first event on: only what came after it.
        history = await served.events.after("summaries", job_id, None)
        first = history[0].id
        resumed = await read(http, url, {**served.auth, "Last-Event-ID": first})
        assert all(
            i is None or i == "" or ids([(i, "", None)])[0] > ids([(first, "", None)])[0]
            for i, _, _ in resumed
        )
        by_query = await read(http, f"{url}?after={first}", served.auth)
        assert [k for _, k, _ in by_query] == [k for _, k, _ in resumed]


async def test_redis_losing_every_event_mid_job_still_ends_with_get(
    settings, redis, pool, jobs, worker_settings
) -> None:
    """Every event lost, the terminal one included (the worker publishes
    nothing here): the stream's heartbeat reads the row and ends it. After
    the end, a new stream is the snapshot and the end from PostgreSQL."""
    key = await create_api_key(pool, "acme")
    auth = {"Authorization": f"Bearer {key}"}
    app = asgi_app(settings.model_copy(update={"stream_heartbeat_s": 0.3}), redis, pool)
    llm = connect_llm(worker_settings)
    handler = WorkflowHandler(
        summaries, jobs, llm, step_config(worker_settings), OutboxWakeUp(pool)
    )
    await jobs.streams["summaries"].ensure_group()
    worker = make_worker(jobs.streams["summaries"], handler, pool)
    async with serving(app) as base, httpx.AsyncClient(timeout=30) as http:
        r = await http.post(
            f"{base}/v1/summaries",
            json=BODY,
            headers={**auth, "Idempotency-Key": "lost-events-00001"},
        )
        job_id = r.json()["job_id"]
        url = f"{base}/v1/summaries/{job_id}/stream"
        opened = asyncio.Event()
        reading = asyncio.create_task(read(http, url, auth, opened=opened))
        await asyncio.wait_for(opened.wait(), 30)
        await redis.flushdb()
        await jobs.streams["summaries"].ensure_group()
        # Redis lost the job's message too: restored as the reconciler would.
        await jobs.restore(JobSpec(job_id, "acme", "summaries", BODY))
        await worker.run_once()
        await worker.wait_idle()
        events = await asyncio.wait_for(reading, 30)
        got = (await http.get(f"{base}/v1/summaries/{job_id}", headers=auth)).json()
        assert events[-1][1] == "end" and events[-1][2] == got
        after = await read(http, url, auth)
    await llm.aclose()  # type: ignore[attr-defined]
    assert [k for _, k, _ in after] == ["snapshot", "end"] and after[-1][2] == got


async def test_a_stream_token_opens_its_job_only_and_keys_are_checked(served, pool) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        job_id = await served.post(http)
        other = await served.post(http)
        await served.run_jobs()
        r = await http.post(
            f"{served.base}/v1/summaries/{job_id}/stream-token", headers=served.auth
        )
        assert r.status_code == 200, r.text
        token = r.json()["token"]
        assert isinstance(r.json()["expires_at"], int)  # whole unix seconds, as documented
        own = await read(http, f"{served.base}/v1/summaries/{job_id}/stream?token={token}", {})
        assert own[-1][1] == "end"
        wrong = await http.get(f"{served.base}/v1/summaries/{other}/stream?token={token}")
        assert wrong.status_code == 401
        forged = await http.get(f"{served.base}/v1/summaries/{job_id}/stream?token={token[:-2]}xx")
        assert forged.status_code == 401
        assert (await http.get(f"{served.base}/v1/summaries/{job_id}/stream")).status_code == 401
        stranger = {"Authorization": f"Bearer {await create_api_key(pool, 'globex')}"}
        foreign = await http.get(f"{served.base}/v1/summaries/{job_id}/stream", headers=stranger)
        assert foreign.status_code == 404
        unknown = await http.get(
            f"{served.base}/v1/summaries/{uuid.uuid4()}/stream", headers=served.auth
        )
        assert unknown.status_code == 404


async def test_a_post_that_accepts_a_stream_streams_its_job_and_a_retry_streams_it_again(
    served,
) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        headers = {
            **served.auth,
            "Idempotency-Key": "streamed-intake-0001",
            "Accept": "text/event-stream",
        }
        first: list[tuple[str, str, Any]] = []
        opened = asyncio.Event()

        async def post_and_read() -> None:
            async with aconnect_sse(
                http, "POST", f"{served.base}/v1/summaries", json=BODY, headers=headers
            ) as source:
                assert source.response.status_code == 200
                assert source.response.headers["location"].startswith("/v1/summaries/")
                async for sse in source.aiter_sse():
                    first.append((sse.id, sse.event, json.loads(sse.data)))
                    opened.set()
                    if sse.event == "end":
                        return

        reading = asyncio.create_task(post_and_read())
        await asyncio.wait_for(opened.wait(), 30)
        await served.run_jobs()
        await asyncio.wait_for(reading, 30)
        job_id = first[-1][2]["job_id"]
        again: list[str] = []
        async with aconnect_sse(
            http, "POST", f"{served.base}/v1/summaries", json=BODY, headers=headers
        ) as source:
            assert source.response.headers["idempotent-replayed"] == "true"
            async for sse in source.aiter_sse():
                again.append(sse.event)
                if sse.event == "end":
                    break
        got = (await http.get(f"{served.base}/v1/summaries/{job_id}", headers=served.auth)).json()
    assert first[-1][2] == got and again[-1] == "end"


async def test_the_tenant_past_its_open_streams_gets_429(settings, redis, pool) -> None:
    key = await create_api_key(pool, "acme")
    auth = {"Authorization": f"Bearer {key}"}
    app = asgi_app(settings.model_copy(update={"streams_per_tenant": 2}), redis, pool)
    async with serving(app) as base, httpx.AsyncClient(timeout=30) as http:
        r = await http.post(
            f"{base}/v1/summaries",
            json=BODY,
            headers={**auth, "Idempotency-Key": "bounded-streams-000001"},
        )
        assert r.status_code == 202, r.text
        job_id = r.json()["job_id"]
        url = f"{base}/v1/summaries/{job_id}/stream"
        opened = [http.stream("GET", url, headers=auth) for _ in range(2)]
        responses = [await o.__aenter__() for o in opened]
        assert [r.status_code for r in responses] == [200, 200]
        third = await http.get(url, headers=auth)
        assert third.status_code == 429, third.text
        assert third.json()["type"].endswith("/rate-limited")
        for o in opened:
            await o.__aexit__(None, None, None)


async def test_the_clients_follow_a_stream_and_reopen_it_after_the_last_event(served) -> None:
    from oncely.client import AsyncClient, Client

    async with httpx.AsyncClient(timeout=30) as http:
        job_id = await served.post(http)
    key = served.auth["Authorization"].removeprefix("Bearer ")
    async with AsyncClient(served.base, key) as client:
        opened = asyncio.Event()
        reading = asyncio.create_task(_collect(client.stream("/v1/summaries", job_id), opened))
        await asyncio.wait_for(opened.wait(), 30)
        await served.run_jobs()
        events = await asyncio.wait_for(reading, 30)
        job = await client.get("/v1/summaries", job_id)
    assert events[0].type == "snapshot" and events[-1].type == "end"
    assert (
        events[-1].data == json.loads(job.model_dump_json()) or events[-1].data["status"] == "done"
    )

    # The sync client, resuming after the first event with an id: only what followed.
    first = next(e.id for e in events if e.id)

    def resumed() -> list[str]:
        with Client(served.base, key) as client:
            return [e.type for e in client.stream("/v1/summaries", job_id, after=first)]

    after = await asyncio.to_thread(resumed)
    assert after[-1] == "end" and "snapshot" not in after
    assert len(after) == len([e for e in events if e.id]) - 1


async def _collect(stream: Any, opened: asyncio.Event) -> list[Any]:
    found = []
    async for event in stream:
        found.append(event)
        opened.set()
    return found


async def test_the_typing_example_leaves_the_stored_summary_on_screen(served) -> None:
    from examples.watch_summary import watch

    from oncely.client import AsyncClient

    key = served.auth["Authorization"].removeprefix("Bearer ")
    screen = io.StringIO()
    body = {**BODY, "text": "[[fake:cut*1]] The example types. A cut starts over. Only this."}
    async with httpx.AsyncClient(timeout=30) as http, AsyncClient(served.base, key) as client:
        headers = {**served.auth, "Idempotency-Key": f"typing-{uuid.uuid4()}"}
        job_id = (
            await http.post(f"{served.base}/v1/summaries", json=body, headers=headers)
        ).json()["job_id"]
        watching = asyncio.create_task(watch(client, job_id, screen))

        async def following() -> bool:
            return "[queued]" in screen.getvalue()

        await wait_for(following, within_s=30, what="the example follows the job")
        await served.run_jobs()
        shown = await asyncio.wait_for(watching, 30)
        job = await client.get("/v1/summaries", job_id)
    assert "[the model starts over]" in screen.getvalue()
    assert job.result is not None
    assert shown == job.result["summary"] == "The example types. A cut starts over."


def test_the_typing_example_finds_the_dev_stack_or_says_how(tmp_path, monkeypatch) -> None:
    import os

    from examples.watch_summary import where

    from oncely.cli import dev_address

    for name in ("ONCELY_URL", "ONCELY_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ONCELY_DATA_DIR", str(tmp_path))
    with pytest.raises(SystemExit, match="no oncely dev running from"):
        where()
    stack = dev_address.DevAddress(
        os.getpid(), "http://127.0.0.1:8123", "redis://r", "pg://p", "a:b"
    )
    dev_address.publish(tmp_path, stack)
    (tmp_path / "dev-api-key").write_text("dev-key\n")
    assert where() == ("http://127.0.0.1:8123", "dev-key")
