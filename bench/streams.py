"""Live job streams (docs/streaming.md): what does streaming a model call's
tokens cost a worker, and how fast does one API process fan events out to
many open streams?

Two parts, in one run:

- **Worker, streaming on and off.** The same one-call summary
  (``bench/streams_app.py``) as ``streamed`` (``Workflow(stream=True)``: the
  call is made with ``stream: true``, its text read chunk by chunk and sent
  to the job's live stream, coalesced to one Redis write per 50 ms) and
  ``plain``, side by side, round-robin, each a real ``oncely worker`` at
  concurrency 64 on the fake model, which paces both alike: a word every
  5 ms (``[[fake:typing=0.005]]``, about 60 ms an answer), so coalescing
  has something to coalesce. Reported: jobs/s, CPU per job, and for the
  streamed one the ``token`` events per call (what the 50 ms coalescing
  made of about twelve chunks). Checks: every job done, one model call each,
  every streamed job's tokens equal to its stored summary.
- **API fan-out.** One ``oncely api`` process holding N open streams (1,000;
  50 in a smoke run) of N jobs, read with an SSE client library (httpx-sse)
  from this process. Reported: the API's RSS per open stream (after the
  streams opened, against before), and the delay from an event's write to
  Redis (the time is in the event, written as a worker would, with
  ``JobEvents``) to the client reading it, p50, p99 and max, over five
  rounds of one event per stream spread over a second each. Checks: every
  stream got every event, and its snapshot first.

``ONCELY_STREAMS_PER_TENANT`` and ``ONCELY_STREAMS_PER_PROCESS`` are raised
for the API above N (their defaults, 100 and 1,000, are the bounds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import time
import uuid
from dataclasses import dataclass
from typing import Any

import httpx
import psutil
from httpx_sse import aconnect_sse
from psycopg.types.json import Jsonb

from bench import streams_app
from bench.harness import jobs
from bench.harness.drain import JobsTrial
from bench.harness.fakes import API_KEY, FakeModel
from bench.harness.measure import Headline, Noise, ratio, ratio_json, say, summary
from bench.harness.processes import clean_env, free_port, wait_http
from bench.harness.report import Context, main, parser
from bench.harness.servers import count, fresh_state, migrate_and_key
from bench.steps import Bench as StepsBench
from oncely import names
from oncely.bootstrap.clients import make_redis
from oncely.live.events import JobEvents
from oncely.queue.stream import JobMessage, Stream
from oncely.sql import query
from oncely.workflow import Workflow

APP = "bench.streams_app:app"
SHOWN = ("jobs", "jobs_per_s", "cpu_ms_per_job", "token_events_per_call", "machine_busy_cores")
OURS, THEIRS = "streamed", "plain"
SLOTS = 64
TENANT = "bench"
PACE = "[[fake:typing=0.005]]"
ROUNDS_OF_EVENTS = 5


@dataclass(frozen=True)
class Trial(JobsTrial):
    @property
    def workflow(self) -> Workflow[Any, Any]:
        return streams_app.streamed if self.kind == OURS else streams_app.plain


def text(i: int) -> str:
    return (
        f"{PACE} Ticket {i} reports a charge made twice on one invoice. Support refunded the "
        "second charge the same day and apologised. The customer confirmed and closed it."
    )


# -- the worker, streaming on and off ------------------------------------------------


class Bench(StepsBench):
    """``bench.steps``' course over the two workflows."""

    shown = SHOWN

    async def load(self, trial: Trial) -> None:  # type: ignore[override]
        await fresh_state(self.redis, self.db)
        await self.fake.reset()
        self.counted = {}
        self.workflow = trial.workflow
        messages = [
            JobMessage.new(str(uuid.uuid4()), TENANT, {"text": text(i)}) for i in range(trial.items)
        ]
        async with self.db.cursor() as cur:
            rows = [(m.job_id, m.tenant, trial.workflow.name, Jsonb(m.payload)) for m in messages]
            await cur.executemany(query("insert_job"), rows)
        await self.db.execute("ANALYZE jobs")
        stream = Stream(self.redis, trial.workflow.keys)
        await stream.ensure_group()
        for i in range(0, len(messages), 50):
            await asyncio.gather(*(stream.enqueue(m) for m in messages[i : i + 50]))
        self.job_ids = [m.job_id for m in messages]

    def spawn(self, trial: Trial) -> subprocess.Popen[bytes]:  # type: ignore[override]
        s = self.ctx.servers
        env = clean_env(
            app=APP,
            redis_url=s.redis_url,
            database_url=s.database_url,
            llm_base_url=self.fake.url,
            llm_api_key=API_KEY,
            worker_concurrency=str(SLOTS),
            llm_client=str(self.ctx.args.client),
            log_level="WARNING",
        )
        argv = ["-m", "oncely", "worker", "--workflow", trial.workflow.name]
        return self.ctx.children.python(trial.name, argv, env)

    async def drained(self, proc: subprocess.Popen[bytes], trial: Trial, within_s: float) -> None:  # type: ignore[override]
        await jobs.all_done(self.db, proc, trial.items, within_s)

    async def checks(self, trial: Trial) -> dict[str, Any]:  # type: ignore[override]
        n = trial.items
        calls = await self.fake.calls()
        c: dict[str, Any] = {
            "jobs": n,
            "done": await count(self.db, jobs.DONE),
            "model_calls": int(calls["total"]),
        }
        ok = c["done"] == n and c["model_calls"] == n
        if trial.kind == OURS:
            tokens, faithful = await self._tokens(trial)
            c["token_events_per_call"] = round(statistics.mean(tokens), 2) if tokens else 0
            c["token_events_max"] = max(tokens, default=0)
            c["tokens_equal_the_summary"] = faithful
            self.counted = {"token_events_per_call": c["token_events_per_call"]}
            ok = ok and faithful == len(tokens) > 0
        c["ok"] = ok
        return c

    async def _tokens(self, trial: Trial) -> tuple[list[int], int]:
        """Per job (a sample of 200): its token events, and whether their
        text is its stored summary."""
        sample = self.job_ids[:200]
        cur = await self.db.execute(
            "SELECT job_id::text, result->>'summary' FROM results WHERE job_id = ANY(%s::uuid[])",
            (sample,),
        )
        stored = {str(j): str(s) for j, s in await cur.fetchall()}
        counts, faithful = [], 0
        for job_id in sample:
            entries: Any = await self.redis.xrange(names.job_events(trial.workflow.name, job_id))
            tokens = [json.loads(f["data"]) for _, f in entries if f.get("type") == "token"]
            counts.append(len(tokens))
            faithful += "".join(t["text"] for t in tokens) == stored.get(job_id)
        return counts, faithful


# -- one API, many streams ---------------------------------------------------------


@dataclass
class Reader:
    job_id: str
    opened: asyncio.Event
    delays_ms: list[float]
    first: str = ""


async def fan_out(ctx: Context, n: int) -> dict[str, Any]:
    """N streams on one API process; the delay from each event's write to
    its reader, and the API's memory per open stream."""
    s = ctx.servers
    key = await migrate_and_key(s.database_url, TENANT)
    redis = make_redis(s.redis_url)
    db = await jobs_db(s.database_url)
    await fresh_state(redis, db)  # type: ignore[arg-type]
    ids = [str(uuid.uuid4()) for _ in range(n)]
    async with db.cursor() as cur:
        rows = [(j, TENANT, streams_app.streamed.name, Jsonb({"text": "x"})) for j in ids]
        await cur.executemany(query("insert_job"), rows)
    port = free_port()
    env = clean_env(
        app=APP,
        redis_url=s.redis_url,
        database_url=s.database_url,
        streams_per_tenant=str(n + 100),
        streams_per_process=str(n + 100),
        log_level="WARNING",
    )
    api = ctx.children.python("api", ["-m", "oncely", "api", "--port", str(port)], env)
    base = f"http://127.0.0.1:{port}"
    try:
        await wait_http(f"{base}/readyz", api, "api", ctx.children)
        rss_before = psutil.Process(api.pid).memory_info().rss
        readers = [Reader(j, asyncio.Event(), []) for j in ids]
        limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
        timeout = httpx.Timeout(None, connect=30.0)
        headers = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(base_url=base, limits=limits, timeout=timeout) as http:
            tasks = [asyncio.create_task(_read(http, r, headers)) for r in readers]
            await asyncio.wait_for(asyncio.gather(*(r.opened.wait() for r in readers)), 120)
            await asyncio.sleep(1.0)  # let the API settle before it is weighed
            rss_after = psutil.Process(api.pid).memory_info().rss
            events = JobEvents(redis)
            for _ in range(ROUNDS_OF_EVENTS):
                await _publish_over_a_second(events, ids)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and any(
                len(r.delays_ms) < ROUNDS_OF_EVENTS for r in readers
            ):
                await asyncio.sleep(0.1)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        ctx.children.kill(api)
        await redis.aclose()
        await db.close()
    delays = sorted(d for r in readers for d in r.delays_ms)
    got_all = sum(len(r.delays_ms) == ROUNDS_OF_EVENTS for r in readers)
    return {
        "streams": n,
        "events": len(delays),
        "readers_with_every_event": got_all,
        "snapshot_first": sum(r.first == "snapshot" for r in readers),
        "delay_p50_ms": _pct(delays, 50),
        "delay_p99_ms": _pct(delays, 99),
        "delay_max_ms": round(delays[-1], 2) if delays else None,
        "rss_before_mb": round(rss_before / 2**20, 1),
        "rss_after_mb": round(rss_after / 2**20, 1),
        "rss_per_stream_kb": round((rss_after - rss_before) / 1024 / n, 1),
        "ok": got_all == n and sum(r.first == "snapshot" for r in readers) == n,
    }


async def jobs_db(database_url: str) -> Any:
    import psycopg

    return await psycopg.AsyncConnection.connect(database_url, autocommit=True)


async def _read(http: httpx.AsyncClient, reader: Reader, headers: dict[str, str]) -> None:
    url = f"/v1/streamed/{reader.job_id}/stream"
    async with aconnect_sse(http, "GET", url, headers=headers) as source:
        async for sse in source.aiter_sse():
            now = time.time()
            if not reader.first:
                reader.first = sse.event
                reader.opened.set()
            if sse.event == "progress":
                sent = json.loads(sse.data)["data"]["t"]
                reader.delays_ms.append((now - sent) * 1000)


async def _publish_over_a_second(events: JobEvents, ids: list[str]) -> None:
    """One ``progress`` event per job, in ten waves 100 ms apart, each
    stamped with the moment it is written."""
    wave = max(1, len(ids) // 10)
    for start in range(0, len(ids), wave):
        for job_id in ids[start : start + wave]:
            events.publish(
                streams_app.streamed.name, job_id, "progress", {"data": {"t": time.time()}}
            )
        await events.drain()
        await asyncio.sleep(0.1)


def _pct(values: list[float], p: int) -> float | None:
    if not values:
        return None
    return round(values[min(len(values) - 1, int(len(values) * p / 100))], 2)


# -- the run ------------------------------------------------------------------------


async def bench_main(ctx: Context) -> tuple[list[Headline], dict[str, Any], bool]:
    model = FakeModel.start(ctx.children)
    bench = Bench(ctx, model, None)
    await bench.open()
    n = 100 if ctx.smoke else 2000
    try:
        trials: list[Any] = [Trial(OURS, n), Trial(THEIRS, n)]
        runs = await bench.run_rounds(trials, "streams ")
    finally:
        await bench.close()
    streams = 50 if ctx.smoke else 1000
    say(f"fan-out: {streams} streams on one API process")
    fanned = await fan_out(ctx, streams)
    say(json.dumps(fanned))
    ok = all(r.ok for rs in runs.values() for r in rs) and bool(fanned["ok"])
    ours, theirs = runs[OURS], runs[THEIRS]
    headline = [
        Headline.of(
            f"streams: a worker ({ctx.args.client} client) streaming tokens / not, jobs/s",
            ratio(ours, theirs, "jobs_per_s"),
            at_least=0.9,
        ),
        Headline(
            f"streams: {streams} open streams on one API, event to client p99",
            fanned["delay_p99_ms"],
            "ms",
            at_most=50.0,
        ),
        Headline(
            f"streams: {streams} open streams, API RSS per stream",
            fanned["rss_per_stream_kb"],
            "KB",
        ),
    ]
    detail = {
        "client": ctx.args.client,
        "worker_jobs": n,
        "results": {key: summary(rs) for key, rs in runs.items()},
        "ratios": {
            f"{OURS}_vs_{THEIRS}": {
                "throughput": ratio_json(ours, theirs, "jobs_per_s"),
                "cpu_per_job": ratio_json(ours, theirs, "cpu_ms_per_job"),
            }
        },
        "fan_out": fanned,
    }
    return headline, detail, ok


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser("streams", __doc__ or "", rounds=3, noise=Noise(0.3, 30.0, 2, 90.0))
    p.add_argument(
        "--client",
        choices=("openai", "lean"),
        default="openai",
        help="the workers' ONCELY_LLM_CLIENT (default %(default)s)",
    )
    return p.parse_args(argv)


if __name__ == "__main__":
    main("streams", "live streams: the worker's cost, one API's fan-out", parse_args(), bench_main)
