"""One trace from the POST to the provider request, through the stream
entry, the worker's delivery and model call, and the outbox row."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk", reason="tracing needs the otel extra")

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)

from oncely.bootstrap import Resources, WorkerGroup, build_relay, connect_llm
from oncely.builtin import app as builtin_app
from oncely.fakes.mail import FakeMailServer
from tests.helpers import asgi_app, service_running

_EXPORTER = InMemorySpanExporter()


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """The process's tracer provider (set once: OpenTelemetry allows no other)."""
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
        trace.set_tracer_provider(provider)
    _EXPORTER.clear()
    yield _EXPORTER
    _EXPORTER.clear()


async def test_one_trace_from_the_post_to_the_provider_request(
    spans, worker_settings, redis, pool, auth, fake_llm, tmp_path
):
    async with FakeMailServer() as mail:
        settings = worker_settings.model_copy(update={"sender_url": mail.url, "block_ms": 20})
        res = Resources(settings, redis, pool)
        llm = connect_llm(settings)
        workers = WorkerGroup(builtin_app.only(["summaries"]), res, llm)
        relay, router = build_relay(builtin_app, res)
        transport = httpx.ASGITransport(app=asgi_app(settings, redis, pool))
        try:
            async with service_running(workers), service_running(relay):
                async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                    r = await client.post(
                        "/v1/summaries",
                        json={"text": "Traced. End to end.", "notify": "ada@example.com"},
                        headers={**auth, "Idempotency-Key": "traced-request-0001"},
                    )
                assert r.status_code == 202
                for _ in range(400):
                    if (await mail.deliveries())["effects"] == 1:
                        break
                    await asyncio.sleep(0.025)
                await asyncio.sleep(0.1)
        finally:
            await router.aclose()
            await llm.aclose()
    finished = spans.get_finished_spans()
    by_name = {s.name: s for s in finished}
    post = by_name["POST /v1/summaries"]
    job = by_name["oncely.job summaries"]
    chat = by_name[f"chat {settings.llm_model}"]
    store = by_name["oncely.store_result"]
    send = by_name["oncely.send email.summary_ready"]
    trace_ids = {s.context.trace_id for s in (post, job, chat, store, send)}
    assert trace_ids == {post.context.trace_id}, "one trace, POST to provider"
    assert job.parent is not None and job.parent.span_id != 0
    assert chat.parent.span_id == job.context.span_id
    assert chat.attributes["gen_ai.operation.name"] == "chat"
    assert chat.attributes["gen_ai.usage.input_tokens"] > 0
    assert send.kind == trace.SpanKind.CLIENT
