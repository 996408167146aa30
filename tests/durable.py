"""Multi-step workflows in process, for tests: a test app's API and job
stores, its workers on demand, and waits on state (``harness`` and
``custom`` are fixtures of tests/conftest.py)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel

from oncely import App, Context, Workflow, webhook
from oncely.api.auth import create_api_key
from oncely.bootstrap import connect_llm, step_config
from oncely.fakes.llm import FakeLLMServer
from oncely.fakes.mail import FakeMailServer
from oncely.jobs.checkpoints import Checkpoints
from oncely.jobs.handler import WorkflowHandler
from oncely.jobs.store import Jobs
from oncely.live.events import JobEvents
from oncely.llm.base import LLM
from oncely.outbox.relay import Relay, RelayConfig
from oncely.outbox.store import OutboxStore
from oncely.outbox.wakeup import OutboxWakeUp
from oncely.queue.stream import Stream
from oncely.queue.worker import Worker, WorkerConfig
from oncely.redis_client import RedisClient
from oncely.senders import SendersConfig, build_router
from oncely.settings import Settings
from tests import steps_app
from tests.helpers import Refunded, asgi_app
from tests.processes import wait_for
from tests.steps_app import SIDE_CALLS


@dataclass
class Harness:
    """A test app's API (in process), its job stores, and workers on demand."""

    app: App
    pool: AsyncConnectionPool
    redis: RedisClient
    jobs: Jobs
    checkpoints: Checkpoints
    api: httpx.AsyncClient
    auth: dict[str, str]
    llm: LLM
    settings: Settings
    fake: FakeLLMServer
    side_file: Path

    def __post_init__(self) -> None:
        # As a worker process wires it: a map child's end counted in its map.
        self.jobs.transitions.when_ended(self.checkpoints.children.on_end)

    def worker(self, workflow: str, *, events: JobEvents | None = None, **config: Any) -> Worker:
        """A worker of ``workflow``, publishing its jobs' live events to
        ``events`` when given."""
        handler = WorkflowHandler(
            self.app[workflow],
            self.jobs,
            self.llm,
            step_config(self.settings),
            OutboxWakeUp(self.pool),
            checkpoints=self.checkpoints,
            events=events,
        )
        return Worker(
            self.jobs.streams[workflow],
            handler,
            WorkerConfig(**{"block_ms": 10, "claim_idle_ms": 60_000, **config}),
            workflow=workflow,
            on_dead=self.mark_dead,
            on_failed=self.jobs.record_deliveries,
            is_cancelled=self.checkpoints.is_cancelled,
        )

    async def mark_dead(self, job_id: str, error: str, generation: int | None) -> None:
        """What the worker process does with a dead job: its row, then its
        end counted in its map if it is a child (bootstrap)."""
        if await self.jobs.mark_dead(job_id, error, generation):
            await self.checkpoints.children.ended([job_id])

    async def submit(self, route: str, body: dict[str, Any], key: str | None = None) -> str:
        headers = {**self.auth, "Idempotency-Key": key or f"key-{uuid.uuid4()}"}
        r = await self.api.post(route, json=body, headers=headers)
        assert r.status_code == 202, r.text
        return str(r.json()["job_id"])

    async def get(self, route: str, job_id: str) -> dict[str, Any]:
        r = await self.api.get(f"{route}/{job_id}", headers=self.auth)
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body

    async def send_event(
        self, route: str, job_id: str, name: str, body: Any, *, key: str | None = None, **h: str
    ) -> httpx.Response:
        headers = {**self.auth, "Idempotency-Key": key or f"event-{uuid.uuid4()}", **h}
        return await self.api.post(f"{route}/{job_id}/events/{name}", json=body, headers=headers)

    async def rows(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        async with self.pool.connection() as conn:
            cur = await conn.execute(sql, args)
            return await cur.fetchall()

    async def keys(self, job_id: str) -> list[str]:
        """The job's checkpoints in order: the rows and those kept with the result."""
        return [c.key for c in await self.checkpoints.of_job(uuid.UUID(job_id))]

    async def rows_kept(self, job_id: str) -> list[str]:
        """The checkpoints kept as rows (not with the result)."""
        rows = await self.rows(
            "SELECT key FROM checkpoints WHERE job_id = %s ORDER BY ordinal", job_id
        )
        return [str(r[0]) for r in rows]

    async def outbox(self, job_id: str) -> list[str]:
        rows = await self.rows("SELECT topic FROM outbox WHERE job_id = %s ORDER BY id", job_id)
        return [str(r[0]) for r in rows]

    async def status(self, job_id: str) -> str:
        return str((await self.rows("SELECT status FROM jobs WHERE job_id = %s", job_id))[0][0])

    def calls(self, contains: str) -> int:
        return sum(p.count for p in self.fake.stats(contains).prompts)


@pytest.fixture
async def harness(
    pool: AsyncConnectionPool,
    redis: RedisClient,
    worker_settings: Settings,
    fake_llm: FakeLLMServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[Harness]:
    side_file = tmp_path / "side-calls.jsonl"
    monkeypatch.setenv(SIDE_CALLS, str(side_file))
    app = steps_app.app
    jobs = Jobs(pool, {w.name: Stream(redis, w.keys) for w in app})
    for stream in jobs.streams.values():
        await stream.ensure_group()
    settings = worker_settings.model_copy(update={"app": "tests.steps_app:app"})
    llm = connect_llm(settings)
    key = await create_api_key(pool, "acme")
    transport = httpx.ASGITransport(app=asgi_app(settings, redis, pool, app))
    async with httpx.AsyncClient(transport=transport, base_url="http://oncely.test") as api:
        yield Harness(
            app,
            pool,
            redis,
            jobs,
            Checkpoints(jobs),
            api,
            {"Authorization": f"Bearer {key}"},
            llm,
            settings,
            fake_llm,
            side_file,
        )
    await llm.aclose()  # type: ignore[attr-defined]


async def drain(worker: Worker, rounds: int = 1) -> None:
    for _ in range(rounds):
        await worker.run_once()
        await worker.wait_idle()


# -- checkpoints and replays -------------------------------------------------------


async def redeliver_until(
    harness: Harness, worker: Worker, workflow: str, done: Callable[[], Awaitable[bool]]
) -> None:
    """Run ``worker`` and promote its deferred jobs until ``done``."""
    stream = harness.jobs.streams[workflow]
    for _ in range(200):
        await drain(worker)
        if await done():
            return
        await stream.promote_due()
        await asyncio.sleep(0.02)
    raise AssertionError("the job did not get there")


class Text(BaseModel):
    text: str


class Said(BaseModel):
    said: str


def one_off(name: str, step: Callable[[Text, Context], Awaitable[Said]], **extra: Any) -> App:
    workflow = Workflow(
        name=name,
        route=f"/v1/{name}",
        request=Text,
        result=Said,
        step=step,
        effects=[webhook(f"{name}.said"), webhook(f"{name}.early")],
        **extra,
    )
    return App([workflow])


def agent_desk(
    name: str, route: str, request: type[Any], result: type[Any], step: Any, agent: object
) -> App:
    """The app of one workflow whose agent refunds through a call that
    answers (``refund.issue``) and asks people's approval
    (``approval.requested``): the agent and framework tests' desk."""
    refunds = webhook("refund.issue", returns=Refunded)
    effects = [refunds, webhook("approval.requested")]
    workflow = Workflow(name, route, request, result, step, effects, agents=[agent])
    return App([workflow])


@pytest.fixture
async def custom(harness: Harness, redis: RedisClient) -> Callable[[App], Awaitable[Harness]]:
    """A harness for a workflow declared in the test."""

    async def make(app: App) -> Harness:
        jobs = Jobs(harness.pool, {w.name: Stream(redis, w.keys) for w in app})
        for stream in jobs.streams.values():
            await stream.ensure_group()
        transport = httpx.ASGITransport(app=asgi_app(harness.settings, redis, harness.pool, app))
        api = httpx.AsyncClient(transport=transport, base_url="http://oncely.test")
        return Harness(
            app,
            harness.pool,
            redis,
            jobs,
            Checkpoints(jobs),
            api,
            harness.auth,
            harness.llm,
            harness.settings,
            harness.fake,
            harness.side_file,
        )

    return make


async def entry_of(harness: Harness, workflow: str, job_id: str) -> str | None:
    stream = harness.jobs.streams[workflow]
    found = await stream.redis.hget(stream.index, job_id)
    return None if found is None else str(found)


async def pending(harness: Harness, workflow: str) -> int:
    stream = harness.jobs.streams[workflow]
    info: Any = await stream.redis.xpending(stream.stream, stream.group)
    return int(info["pending"])


async def run_once(
    harness: Harness, workflow: str, body: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    """``body`` posted to ``workflow``'s route (``/v1/<workflow>``), its
    worker drained once: the job's id and the job as GET shows it."""
    job_id = await harness.submit(f"/v1/{workflow}", body)
    await drain(harness.worker(workflow))
    return job_id, await harness.get(f"/v1/{workflow}", job_id)


async def streamed(
    harness: Harness, workflow: str, route: str, text: str
) -> tuple[dict[str, Any], dict[str, str]]:
    """A job of ``text`` posted to ``route``, its ``workflow`` worker
    drained once with live events, the job done: its view, and the token
    events' text by the step that sent them."""
    events = JobEvents(harness.redis)
    job_id = await harness.submit(route, {"text": text})
    await drain(harness.worker(workflow, events=events))
    await events.drain()
    view = await harness.get(route, job_id)
    assert view["status"] == "done", view
    tokens: dict[str, str] = {}
    for event in await events.after(workflow, job_id, None):
        if event.type == "token":
            tokens[event.data["step"]] = tokens.get(event.data["step"], "") + event.data["text"]
    return view, tokens


async def wait_until_due(harness: Harness, job_id: str) -> None:
    """Until the job's wait_until has passed on PostgreSQL's clock."""
    for _ in range(500):
        rows = await harness.rows("SELECT wait_until <= now() FROM jobs WHERE job_id = %s", job_id)
        if rows and rows[0][0]:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the wait never came due")


async def cancel_mid_call(h: Harness, workflow: str, job_id: str) -> None:
    """Once the job's ``slow:`` model call is in flight, cancel the job
    through its workflow's route."""
    await until(lambda: h.fake.stats("slow:").in_flight == 1)
    r = await h.api.post(f"/v1/{workflow}/{job_id}/cancel", headers=h.auth)
    assert r.status_code == 202


async def until(check: Callable[[], bool], within_s: float = 20.0) -> None:
    """Wait until ``check()`` holds (an AssertionError after ``within_s``)."""

    async def holds() -> bool:
        return check()

    await wait_for(holds, within_s)


async def until_async(check: Callable[[], Awaitable[bool]], within_s: float = 20.0) -> None:
    await wait_for(check, within_s)


async def pending_is(h: Harness, workflow: str, n: int) -> bool:
    return await pending(h, workflow) == n


@contextlib.asynccontextmanager
async def relayed(harness: Harness, mail: FakeMailServer, secret: str) -> AsyncIterator[Relay]:
    """A relay sending the harness's app's effects and calls, signed with
    ``secret``, to the fake receiver ``mail``, and resuming the jobs whose
    calls ended (as the relay process does)."""
    config = SendersConfig(webhook_secret=secret, default_webhook_url=mail.events_url)
    router = build_router(harness.app.effects(), config)

    async def resume(ids: list[str]) -> None:
        await harness.checkpoints.resume_due(len(ids), ids)

    try:
        yield Relay(OutboxStore(harness.pool), router, RelayConfig(batch=10), resume=resume)
    finally:
        await router.aclose()
