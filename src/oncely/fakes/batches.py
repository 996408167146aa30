"""The fake model's batch APIs: OpenAI's Files and Batches, and
Anthropic's Message Batches, for the batch lane (docs/lanes.md,
docs/fakes.md), mounted on the fake model's app.

- ``POST /v1/files`` (multipart ``purpose``, ``file``) keeps a file;
  ``GET /v1/files/{id}/content`` gives it back.
- ``POST /v1/batches`` (``input_file_id``, ``endpoint``
  ``/v1/chat/completions`` or ``/v1/responses``, ``completion_window``,
  ``metadata``) creates a
  batch, ``validating`` at once, ``in_progress`` then, and after
  ``--batch-delay S`` ``completed`` with its output file (one line per
  answered request: ``{"custom_id", "response": {"status_code", "body"}}``)
  and its error file (the lines that failed). ``GET /v1/batches/{id}`` reads
  one, ``GET /v1/batches`` lists them newest first (with their metadata, as
  a client looking for a batch it created but did not record does),
  ``POST /v1/batches/{id}/cancel`` cancels one not done.
- ``POST /v1/messages/batches`` (``{"requests": [{"custom_id",
  "params"}]}``, custom ids as Anthropic takes them) creates a Message
  Batch, ``in_progress`` until ``--batch-delay S`` passed, then ``ended``
  with ``request_counts`` and its results at ``GET
  /v1/messages/batches/{id}/results`` (one line per request: ``{"custom_id",
  "result": {"type": "succeeded", "message"}}``, ``errored`` with the
  error, ``expired``). ``GET /v1/messages/batches/{id}`` reads one, ``GET
  /v1/messages/batches`` lists them newest first (``limit``, ``after_id``),
  ``POST /v1/messages/batches/{id}/cancel`` cancels one not ended (its lines
  ``canceled``).
- Each line is answered as a call of the fake model in its batch's dialect
  (``FakeModel.answer_line``), the same way for both APIs: its prompt's
  directives hold, so ``[[fake:400]]`` fails the line with 400,
  ``[[fake:503*1]]`` with 503 once. ``[[fake:expire*N]]`` in a line's
  prompt: the first N batches that carry that line (by ``custom_id``)
  expire, that line left unanswered (out of OpenAI's output, ``expired``
  in Anthropic's results).

``GET /_batches`` counts batches created (both APIs), files uploaded, and
each ``custom_id``'s lines submitted (``lines``): a line sent twice shows
as 2.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from aiohttp import web


class FakeModel(Protocol):
    """What answers a line: the fake model (``oncely.fakes.llm``)."""

    async def answer_line(self, body: object, dialect: str) -> tuple[int, dict[str, Any]]: ...


# How long a batch takes to answer unless ``--batch-delay`` says otherwise.
DEFAULT_BATCH_DELAY_S = 1.0
# The largest request the fake takes: a batch's file, as OpenAI's limit.
MAX_BATCH_FILE_BYTES = 200 * 1024 * 1024
_EXPIRE = re.compile(r"\[\[fake:expire(?:\*(?P<times>\d+))?\]\]")
# The endpoints a batch may ask, and the dialect of each.
_ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/responses": "responses"}
# Anthropic's custom ids.
_CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# A line left unanswered (its batch expired, or was cancelled).
_EXPIRED = -1
_CANCELED = -2


@dataclass(frozen=True)
class _Line:
    custom_id: str
    body: Any


@dataclass(frozen=True)
class _Answer:
    """A line's answer: its status (``_EXPIRED``, ``_CANCELED``: none) and body."""

    custom_id: str
    status: int
    body: dict[str, Any]


@dataclass
class _Batch:
    """A batch of either API: ``api`` ``openai`` (``endpoint``,
    ``metadata``, files) or ``anthropic`` (``results``)."""

    id: str
    api: str
    dialect: str
    lines: list[_Line]
    created_at: float
    endpoint: str = ""
    input_file_id: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    # Where Anthropic's results are (the fake's own origin).
    origin: str = ""
    # ``validating``, ``in_progress``, then how it ended: OpenAI's words
    # (``completed``, ``expired``, ``cancelled``); Anthropic's batch is
    # ``ended`` for each of them.
    status: str = "validating"
    answers: list[_Answer] = field(default_factory=list)
    output_file_id: str | None = None
    error_file_id: str | None = None
    ended_at: float | None = None
    task: asyncio.Task[None] | None = None

    @property
    def ended(self) -> bool:
        return self.status in ("completed", "expired", "cancelled")

    def to_json(self) -> dict[str, Any]:
        return self._anthropic() if self.api == "anthropic" else self._openai()

    def _openai(self) -> dict[str, Any]:
        ok = sum(1 for a in self.answers if a.status == 200)
        failed = sum(1 for a in self.answers if a.status not in (200, _EXPIRED, _CANCELED))
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "input_file_id": self.input_file_id,
            "completion_window": "24h",
            "status": self.status,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": int(self.created_at),
            "request_counts": {"total": len(self.lines), "completed": ok, "failed": failed},
            "metadata": dict(self.metadata),
        }

    def _anthropic(self) -> dict[str, Any]:
        counts = {"processing": 0, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
        for answer in self.answers:
            counts[_result_type(answer.status)] += 1
        counts["processing"] = len(self.lines) - len(self.answers)
        return {
            "id": self.id,
            "type": "message_batch",
            "processing_status": "ended" if self.ended else "in_progress",
            "request_counts": counts,
            "created_at": _rfc3339(self.created_at),
            "expires_at": _rfc3339(self.created_at + 86400),
            "ended_at": _rfc3339(self.ended_at) if self.ended_at is not None else None,
            "archived_at": None,
            "cancel_initiated_at": None,
            "results_url": (
                f"{self.origin}/v1/messages/batches/{self.id}/results" if self.ended else None
            ),
        }


def _rfc3339(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat().replace("+00:00", "Z")


def _result_type(status: int) -> str:
    if status == _EXPIRED:
        return "expired"
    if status == _CANCELED:
        return "canceled"
    return "succeeded" if status == 200 else "errored"


class FakeBatches:
    """The batch APIs' state. All in the fake's one event loop, no locks."""

    def __init__(self, model: FakeModel, delay_s: float) -> None:
        self.model = model
        self.delay_s = delay_s
        self.reset()

    def reset(self) -> None:
        for batch in getattr(self, "_batches", {}).values():
            if batch.task is not None:
                batch.task.cancel()
        self._files: dict[str, bytes] = {}
        self._batches: dict[str, _Batch] = {}
        # Lines submitted per custom_id, over every batch of both APIs.
        self.lines: dict[str, int] = {}
        self.created = 0
        self.uploaded = 0
        self._number = 0

    def stats(self) -> dict[str, Any]:
        return {
            "created": self.created,
            "uploaded": self.uploaded,
            "lines": dict(self.lines),
            "statuses": {b.id: b.status for b in self._batches.values()},
        }

    def _next(self, prefix: str) -> str:
        self._number += 1
        return f"{prefix}_fake_{self._number}"

    def _start(self, batch: _Batch) -> web.Response:
        """A new batch's lines counted and its work begun."""
        for line in batch.lines:
            self.lines[line.custom_id] = self.lines.get(line.custom_id, 0) + 1
        self._batches[batch.id] = batch
        self.created += 1
        batch.task = asyncio.create_task(self._work(batch))
        return web.json_response(batch.to_json())

    def _find(self, request: web.Request, api: str) -> _Batch | None:
        batch = self._batches.get(request.match_info["id"])
        return batch if batch is not None and batch.api == api else None

    # --- OpenAI's Files and Batches -------------------------------------------------

    async def upload(self, request: web.Request) -> web.Response:
        form = await request.post()
        upload = form.get("file")
        if form.get("purpose") != "batch" or not isinstance(upload, web.FileField):
            return _error(400, "expected purpose=batch and a file")
        file_id = self._next("file")
        self._files[file_id] = upload.file.read()
        self.uploaded += 1
        return web.json_response(
            {
                "id": file_id,
                "object": "file",
                "purpose": "batch",
                "bytes": len(self._files[file_id]),
            }
        )

    async def content(self, request: web.Request) -> web.Response:
        data = self._files.get(request.match_info["id"])
        if data is None:
            return _error(404, "No such file")
        return web.Response(body=data, content_type="application/jsonl")

    async def create(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            file_id = body["input_file_id"]
            metadata = body.get("metadata") or {}
            endpoint = body.get("endpoint")
            if endpoint not in _ENDPOINTS or not isinstance(metadata, dict):
                raise ValueError(endpoint)
            raw = [json.loads(line) for line in self._files[file_id].splitlines() if line]
            lines = [_Line(str(line.get("custom_id")), line.get("body")) for line in raw]
        except (ValueError, KeyError, TypeError, AttributeError):
            return _error(400, "expected input_file_id of an uploaded file and a known endpoint")
        batch = _Batch(
            self._next("batch"),
            "openai",
            _ENDPOINTS[endpoint],
            lines,
            time.time(),
            endpoint=endpoint,
            input_file_id=file_id,
            metadata=metadata,
        )
        return self._start(batch)

    async def retrieve(self, request: web.Request) -> web.Response:
        batch = self._find(request, "openai")
        if batch is None:
            return _error(404, "No such batch")
        return web.json_response(batch.to_json())

    async def listed(self, request: web.Request) -> web.Response:
        batches = [b for b in reversed(self._batches.values()) if b.api == "openai"]
        data = [b.to_json() for b in batches]
        return web.json_response({"object": "list", "data": data, "has_more": False})

    async def cancel(self, request: web.Request) -> web.Response:
        batch = self._find(request, "openai")
        if batch is None:
            return _error(404, "No such batch")
        self._cancel(batch)
        return web.json_response(batch.to_json())

    # --- Anthropic's Message Batches ------------------------------------------------

    async def create_messages(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            lines = [_Line(r["custom_id"], r["params"]) for r in body["requests"]]
            if not lines or not all(
                isinstance(line.custom_id, str) and _CUSTOM_ID.fullmatch(line.custom_id)
                for line in lines
            ):
                raise ValueError("custom_id")
        except (ValueError, KeyError, TypeError):
            message = "expected requests of a custom_id ([a-zA-Z0-9_-]{1,64}) and params"
            return _anthropic_error(400, message)
        batch = _Batch(
            self._next("msgbatch"), "anthropic", "anthropic", lines, time.time(),
            origin=f"{request.scheme}://{request.host}",
        )  # fmt: skip
        return self._start(batch)

    async def retrieve_messages(self, request: web.Request) -> web.Response:
        batch = self._find(request, "anthropic")
        if batch is None:
            return _anthropic_error(404, "No such message batch")
        return web.json_response(batch.to_json())

    async def list_messages(self, request: web.Request) -> web.Response:
        """Newest first, ``limit`` a page (20 unless it says), the page after
        ``after_id``'s batch when it says one."""
        batches = [b for b in reversed(self._batches.values()) if b.api == "anthropic"]
        after = request.query.get("after_id")
        if after is not None:
            ids = [b.id for b in batches]
            batches = batches[ids.index(after) + 1 :] if after in ids else []
        try:
            limit = max(1, min(1000, int(request.query.get("limit", "20"))))
        except ValueError:
            return _anthropic_error(400, "limit must be a number")
        page = batches[:limit]
        return web.json_response(
            {
                "data": [b.to_json() for b in page],
                "has_more": len(batches) > limit,
                "first_id": page[0].id if page else None,
                "last_id": page[-1].id if page else None,
            }
        )

    async def results_messages(self, request: web.Request) -> web.Response:
        batch = self._find(request, "anthropic")
        if batch is None:
            return _anthropic_error(404, "No such message batch")
        if not batch.ended:
            return _anthropic_error(400, "the batch is still processing")
        data = b"".join(json.dumps(_result(a)).encode() + b"\n" for a in batch.answers)
        return web.Response(body=data, content_type="application/binary")

    async def cancel_messages(self, request: web.Request) -> web.Response:
        batch = self._find(request, "anthropic")
        if batch is None:
            return _anthropic_error(404, "No such message batch")
        self._cancel(batch)
        return web.json_response(batch.to_json())

    # --- both -------------------------------------------------------------------------

    async def calls(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats())

    def _cancel(self, batch: _Batch) -> None:
        """A batch not ended, cancelled: its lines left unanswered."""
        if batch.ended:
            return
        if batch.task is not None:
            batch.task.cancel()
        batch.answers = [_Answer(line.custom_id, _CANCELED, {}) for line in batch.lines]
        self._end(batch, "cancelled")

    async def _work(self, batch: _Batch) -> None:
        """Answer the batch's lines after the delay; an expiring line is
        left unanswered and ends the batch ``expired``."""
        try:
            batch.status = "in_progress"
            await asyncio.sleep(self.delay_s)
            answers = [await self._answer(batch, line) for line in batch.lines]
            batch.answers = answers
            expired = any(a.status == _EXPIRED for a in answers)
            self._end(batch, "expired" if expired else "completed")
        finally:
            batch.task = None

    async def _answer(self, batch: _Batch, line: _Line) -> _Answer:
        if self._expires(line):
            return _Answer(line.custom_id, _EXPIRED, {})
        status, body = await self.model.answer_line(line.body, batch.dialect)
        return _Answer(line.custom_id, status, body)

    def _end(self, batch: _Batch, status: str) -> None:
        batch.status = status
        batch.ended_at = time.time()
        if batch.api == "openai":
            given = [a for a in batch.answers if a.status not in (_EXPIRED, _CANCELED)]
            batch.output_file_id = self._keep([a for a in given if a.status == 200])
            batch.error_file_id = self._keep([a for a in given if a.status != 200])

    def _expires(self, line: _Line) -> bool:
        match = _EXPIRE.search(json.dumps(line.body))
        if match is None:
            return False
        times = int(match["times"]) if match["times"] is not None else None
        return times is None or self.lines.get(line.custom_id, 0) <= times

    def _keep(self, answers: list[_Answer]) -> str | None:
        """OpenAI's results file of ``answers``: its id (None: no answers)."""
        if not answers:
            return None
        file_id = self._next("file")
        self._files[file_id] = b"".join(
            json.dumps(
                {
                    "id": self._next("batch_req"),
                    "custom_id": a.custom_id,
                    "response": {"status_code": a.status, "body": a.body},
                    "error": None,
                }
            ).encode()
            + b"\n"
            for a in answers
        )
        return file_id


def _result(answer: _Answer) -> dict[str, Any]:
    """An answer as a line of Anthropic's results."""
    kind = _result_type(answer.status)
    result: dict[str, Any] = {"type": kind}
    if kind == "succeeded":
        result["message"] = answer.body
    elif kind == "errored":
        result["error"] = answer.body
    return {"custom_id": answer.custom_id, "result": result}


def _error(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "code": None}}
    return web.json_response(body, status=status)


def _anthropic_error(status: int, message: str) -> web.Response:
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return web.json_response(body, status=status)


FAKE_BATCHES = web.AppKey("fake_batches", FakeBatches)


def mount_batches(app: web.Application, model: FakeModel, delay_s: float) -> FakeBatches:
    """The batch APIs' routes on the fake model's ``app``."""
    batches = FakeBatches(model, delay_s)
    app[FAKE_BATCHES] = batches
    app.router.add_post("/v1/files", batches.upload)
    app.router.add_get("/v1/files/{id}/content", batches.content)
    app.router.add_post("/v1/batches", batches.create)
    app.router.add_get("/v1/batches", batches.listed)
    app.router.add_get("/v1/batches/{id}", batches.retrieve)
    app.router.add_post("/v1/batches/{id}/cancel", batches.cancel)
    app.router.add_post("/v1/messages/batches", batches.create_messages)
    app.router.add_get("/v1/messages/batches", batches.list_messages)
    app.router.add_get("/v1/messages/batches/{id}", batches.retrieve_messages)
    app.router.add_get("/v1/messages/batches/{id}/results", batches.results_messages)
    app.router.add_post("/v1/messages/batches/{id}/cancel", batches.cancel_messages)
    app.router.add_get("/_batches", batches.calls)
    return batches
