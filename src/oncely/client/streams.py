"""Following a job's live stream (docs/streaming.md): what both clients
share. A stream that drops (a proxy, a restarting API process, a broken
connection) is opened again with ``Last-Event-ID``, so nothing is repeated
and nothing missed; it ends after the ``end`` event. An answer that is not
the stream (401, 404, 429) raises its typed error; a run of failed
reconnects longer than ``deadline_s`` raises ``GaveUp``."""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx

from oncely.client.calls import route_path
from oncely.client.jobs import StreamEvent
from oncely.client.policy import RETRIED_TRANSPORT_ERRORS
from oncely.retry import retryable_status

# No event, not even a heartbeat (every 15 s by default), for this long: the
# connection is taken for dead and opened again.
READ_TIMEOUT_S = 60.0


def stream_path(route: str, job_id: str | uuid.UUID) -> str:
    return f"{route_path(route)}/{job_id}/stream"


def headers(base: dict[str, str], last: str | None) -> dict[str, str]:
    found = {**base, "Accept": "text/event-stream"}
    if last is not None:
        found["Last-Event-ID"] = last
    return found


def timeout(connect_s: float) -> httpx.Timeout:
    return httpx.Timeout(connect_s, read=READ_TIMEOUT_S)


def event_of(sse: Any) -> StreamEvent:
    """An httpx-sse event as the client's ``StreamEvent``."""
    return StreamEvent(id=sse.id or None, type=sse.event, data=json.loads(sse.data or "null"))


def reconnects(exc: BaseException | httpx.Response) -> bool:
    """Whether opening the stream again can help."""
    if isinstance(exc, httpx.Response):
        return retryable_status(exc.status_code) and exc.status_code != 429
    return isinstance(exc, RETRIED_TRANSPORT_ERRORS)
