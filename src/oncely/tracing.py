"""OpenTelemetry, when installed (the ``otel`` extra): spans and the trace
context that travels with a job. Without it every function here is a cheap
no-op, so the rest of oncely never checks.

The trace started at the POST continues through the stream entry (its
``traceparent`` field), the worker's delivery and model calls, and the
outbox row (its ``trace_context`` column) to the provider request.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

try:
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace
except ImportError:  # the otel extra is not installed
    trace = None  # type: ignore[assignment]

_TRACER = trace.get_tracer("oncely") if trace is not None else None


def enabled() -> bool:
    return _TRACER is not None


# What ``span`` gives while nothing records: one shared context, no generator.
_NO_SPAN: contextlib.AbstractContextManager[None] = contextlib.nullcontext()


def span(
    name: str,
    *,
    parent: str | None = None,
    kind: str = "internal",
    attributes: Mapping[str, Any] | None = None,
) -> contextlib.AbstractContextManager[Any]:
    """A span named ``name`` (child of ``parent``, a ``traceparent``, when
    given; else of the current span). Yields the span, or None without otel
    or while no tracer provider is configured (a span then records nothing
    and carries no context: skipping it saves every request its cost)."""
    if _TRACER is None or isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return _NO_SPAN
    return _recording(name, parent, kind, attributes)


@contextlib.contextmanager
def _recording(
    name: str, parent: str | None, kind: str, attributes: Mapping[str, Any] | None
) -> Iterator[Any]:
    assert _TRACER is not None  # span() checked
    ctx = propagate.extract({"traceparent": parent}) if parent else None
    span_kind = getattr(trace.SpanKind, kind.upper())
    with _TRACER.start_as_current_span(
        name, context=ctx, kind=span_kind, attributes=dict(attributes or {})
    ) as current:
        yield current


def traceparent() -> str | None:
    """The current span as a W3C ``traceparent`` value (None: no active span)."""
    if _TRACER is None:
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier.get("traceparent")


@contextlib.contextmanager
def resumed(parent: str | None) -> Iterator[None]:
    """Make ``parent`` (a ``traceparent``) the current context for a block."""
    if _TRACER is None or not parent:
        yield
        return
    token = otel_context.attach(propagate.extract({"traceparent": parent}))
    try:
        yield
    finally:
        otel_context.detach(token)


def current_ids() -> tuple[str, str] | None:
    """(trace id, span id) in hex of the active span, for log lines."""
    if _TRACER is None:
        return None
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"


def configure(service: str) -> None:
    """Export this process's spans over OTLP/HTTP (``ONCELY_OTEL=true``; the
    endpoint and headers come from the standard ``OTEL_EXPORTER_OTLP_*``
    variables). Needs the ``otel`` extra; says so plainly without it."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise RuntimeError("ONCELY_OTEL needs the otel extra: pip install 'oncely[otel]'") from exc
    name = os.environ.get("OTEL_SERVICE_NAME") or service
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
