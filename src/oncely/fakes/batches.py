"""The fake model's batch API: OpenAI's Files and Batches, for the batch
lane (docs/lanes.md, docs/fakes.md), mounted on the fake model's app.

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
- Each line is answered as a call of the fake model in its endpoint's dialect
  (``FakeModel.answer_line``): its prompt's directives hold, so
  ``[[fake:400]]`` fails the line with 400, ``[[fake:503*1]]`` with 503
  once. ``[[fake:expire*N]]`` in a line's prompt: the first N batches that
  carry that line (by ``custom_id``) expire, its line and every line not
  answered yet left out of the output.

``GET /_batches`` counts batches created, files uploaded, and each
``custom_id``'s lines submitted (``lines``): a line sent twice shows as 2.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field
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


@dataclass
class _Batch:
    id: str
    input_file_id: str
    metadata: dict[str, str]
    created_at: int
    endpoint: str
    status: str = "validating"
    output_file_id: str | None = None
    error_file_id: str | None = None
    counts: dict[str, int] = field(
        default_factory=lambda: {"total": 0, "completed": 0, "failed": 0}
    )
    task: asyncio.Task[None] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "input_file_id": self.input_file_id,
            "completion_window": "24h",
            "status": self.status,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": self.created_at,
            "request_counts": dict(self.counts),
            "metadata": dict(self.metadata),
        }


class FakeBatches:
    """The batch API's state. All in the fake's one event loop, no locks."""

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
        # Lines submitted per custom_id, over every batch.
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
            lines = [json.loads(line) for line in self._files[file_id].splitlines() if line]
        except (ValueError, KeyError, TypeError):
            return _error(400, "expected input_file_id of an uploaded file and a known endpoint")
        batch = _Batch(self._next("batch"), file_id, metadata, int(time.time()), endpoint)
        batch.counts["total"] = len(lines)
        for line in lines:
            custom_id = str(line.get("custom_id"))
            self.lines[custom_id] = self.lines.get(custom_id, 0) + 1
        self._batches[batch.id] = batch
        self.created += 1
        batch.task = asyncio.create_task(self._work(batch, lines))
        return web.json_response(batch.to_json())

    async def retrieve(self, request: web.Request) -> web.Response:
        batch = self._batches.get(request.match_info["id"])
        if batch is None:
            return _error(404, "No such batch")
        return web.json_response(batch.to_json())

    async def listed(self, request: web.Request) -> web.Response:
        data = [b.to_json() for b in reversed(self._batches.values())]
        return web.json_response({"object": "list", "data": data, "has_more": False})

    async def cancel(self, request: web.Request) -> web.Response:
        batch = self._batches.get(request.match_info["id"])
        if batch is None:
            return _error(404, "No such batch")
        if batch.status in ("validating", "in_progress"):
            if batch.task is not None:
                batch.task.cancel()
            batch.status = "cancelled"
        return web.json_response(batch.to_json())

    async def calls(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats())

    async def _work(self, batch: _Batch, lines: list[dict[str, Any]]) -> None:
        """Answer the batch's lines after the delay; an expiring line ends
        the batch ``expired`` with what was answered before it."""
        try:
            batch.status = "in_progress"
            await asyncio.sleep(self.delay_s)
            output: list[dict[str, Any]] = []
            errors: list[dict[str, Any]] = []
            expired = False
            for line in lines:
                custom_id = str(line.get("custom_id"))
                if self._expires(custom_id, line):
                    expired = True
                    continue
                dialect = _ENDPOINTS[batch.endpoint]
                status, body = await self.model.answer_line(line.get("body"), dialect)
                result = {
                    "id": self._next("batch_req"),
                    "custom_id": custom_id,
                    "response": {"status_code": status, "body": body},
                    "error": None,
                }
                (output if status == 200 else errors).append(result)
            batch.counts["completed"] = len(output)
            batch.counts["failed"] = len(errors)
            batch.output_file_id = self._keep(output)
            batch.error_file_id = self._keep(errors)
            batch.status = "expired" if expired else "completed"
        finally:
            batch.task = None

    def _expires(self, custom_id: str, line: dict[str, Any]) -> bool:
        match = _EXPIRE.search(json.dumps(line.get("body")))
        if match is None:
            return False
        times = int(match["times"]) if match["times"] is not None else None
        return times is None or self.lines.get(custom_id, 0) <= times

    def _keep(self, results: list[dict[str, Any]]) -> str | None:
        if not results:
            return None
        file_id = self._next("file")
        self._files[file_id] = b"".join(json.dumps(r).encode() + b"\n" for r in results)
        return file_id


def _error(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "code": None}}
    return web.json_response(body, status=status)


FAKE_BATCHES = web.AppKey("fake_batches", FakeBatches)


def mount_batches(app: web.Application, model: FakeModel, delay_s: float) -> FakeBatches:
    """The batch API's routes on the fake model's ``app``."""
    batches = FakeBatches(model, delay_s)
    app[FAKE_BATCHES] = batches
    app.router.add_post("/v1/files", batches.upload)
    app.router.add_get("/v1/files/{id}/content", batches.content)
    app.router.add_post("/v1/batches", batches.create)
    app.router.add_get("/v1/batches", batches.listed)
    app.router.add_get("/v1/batches/{id}", batches.retrieve)
    app.router.add_post("/v1/batches/{id}/cancel", batches.cancel)
    app.router.add_get("/_batches", batches.calls)
    return batches
