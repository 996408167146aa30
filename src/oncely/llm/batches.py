"""The batch lane (docs/lanes.md): model calls answered through a
provider's batch API (OpenAI's Files and Batches, for the ``chat`` and
``responses`` dialects; Anthropic's Message Batches, for ``anthropic``:
``oncely.llm.anthropic_batches``), about half the price, hours not
seconds. Only this module runs SQL on ``batch_lines``.

A batch holds lines of one model and dialect: ``chat`` lines ask
``/v1/chat/completions``, ``responses`` lines ``/v1/responses``,
``anthropic`` lines the Messages API.

A call's life, each step durable before the next can be lost:

1. *Intent.* The job's call stores its line (``BatchLines.intend``): its
   ``custom_id`` (``oncely.llm.lines.line_id``: a digest of its job id and
   its call's checkpoint key, in the one format every provider takes; the
   row keeps both, so nothing maps it back), model, dialect and request
   body, one statement, then the job waits holding no slot
   (``ResumeLater``) and looks again every ``poll_s``.
2. *Gathered.* A ``Batcher`` (one per worker process; they share the work
   through leases) takes the waiting lines of a model once there are
   ``max_calls`` of them or the oldest waited ``gather_s``, and stores the
   batch's oncely id and the time on them, leased to itself, before
   anything is sent. Lines of jobs that ended meanwhile (a cancel) are
   dropped, never sent.
3. *Created.* The batch is created at the provider; where the provider
   keeps metadata (OpenAI) it carries ``metadata.oncely_batch`` = that
   oncely id.
4. *Recorded.* The provider's id is stored on the lines. A process killed
   between 2 and 4 leaves lines gathered with no provider id: once their
   lease runs out, a recovery pass asks the provider's API for the batches
   that may be theirs (``BatchAPI.find``: OpenAI's by the metadata;
   Anthropic's, which keep none, by their size and creation time) and
   adopts the first that no other oncely batch recorded; only when there
   is none (the kill came before 3) is the batch created, with the same
   lines and id. A wrong adoption costs time, never a wrong answer: see 5.
5. *Answered.* Polled every ``poll_s``; once ended, each line's answer or
   error is stored, a result changing only a line of the batch that
   carried it (by its custom id). An expired batch's unanswered lines go
   back in line once (a line submitted twice fails instead); a cancelled
   or failed batch's lines, and those a batch that ended left unanswered,
   fail transiently, and go back in line when their jobs look.
6. *Resumed.* The job's next look finds its line answered: the answer
   becomes the call's model checkpoint and its ledger row (lane ``batch``).
   A line that failed is classified as any call's status: transient, it
   goes back in line for the next batch; permanent, the call fails. A job
   cancelled once its line is out never resumes: its answer is discarded.

Settled lines are kept ``keep_s`` (7 days: ``oncely batches`` shows them),
then deleted once their job ended, an hourly pass at most.

Provider ids and custom ids are untrusted: a provider id is checked before
it is stored or put in a path, and a result's custom id changes only a
line of the batch that carried it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any, Protocol

import structlog
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from oncely.llm import wire
from oncely.metrics import BATCH_LINES, BATCHES
from oncely.sql import query
from oncely.sql.bounded import StatementResult, run_statement

log = structlog.get_logger(__name__)

# The metadata key a batch carries its oncely id under.
METADATA_KEY = "oncely_batch"
# The endpoint a line of each dialect asks.
ENDPOINTS = {"chat": "/v1/chat/completions", "responses": "/v1/responses"}
# How often a batcher deletes settled lines past their keep, at most, and
# how many a statement.
_PRUNE_EVERY_S = 3600.0
_PRUNE_BATCH = 10_000
# A batch's statuses that end it.
_ENDED = frozenset({"completed", "expired", "cancelled", "failed"})
# The namespace of a settled line's ledger id (``Line.call_id``).
_LEDGER_IDS = uuid.UUID("0b6f3f0e-2c1d-4a57-8e7b-5d1c9a40b2e6")


@dataclass(frozen=True)
class Line:
    """A call's line as its job finds it: ``status`` ``waiting``,
    ``gathered``, ``answered`` (``answer``: the provider's response body),
    ``failed`` (``error``: ``{"status", "code"}``) or ``dropped``;
    ``waited_s``: from its intent to its last change."""

    custom_id: str
    status: str
    answer: dict[str, Any] | None
    error: dict[str, Any] | None
    submissions: int
    waited_s: float

    @property
    def call_id(self) -> str:
        """The ledger's id of this submission's answer or failure: the same
        at every look, so a job that reads it again (its delivery died
        before the call's checkpoint was stored) records it once."""
        return str(uuid.uuid5(_LEDGER_IDS, f"{self.custom_id}#{self.submissions}"))


@dataclass(frozen=True)
class BatchRow:
    """One batch as ``oncely batches list|show`` shows it."""

    batch_id: str
    # ``gathered`` (not created, or not recorded yet), ``out`` (at the
    # provider), ``ended`` (every line settled).
    status: str
    provider_id: str | None
    model: str
    dialect: str
    lines: int
    answered: int
    failed: int
    waiting: int
    created_at: datetime
    updated_at: datetime

    def to_json(self) -> dict[str, Any]:
        return {
            "batch_id": self.batch_id,
            "status": self.status,
            "provider_id": self.provider_id,
            "model": self.model,
            "dialect": self.dialect,
            "lines": self.lines,
            "answered": self.answered,
            "failed": self.failed,
            "jobs_waiting": self.waiting,
            "created_at": self.created_at.isoformat(),
            "updated_at": self.updated_at.isoformat(),
        }


@dataclass(frozen=True)
class LineRow:
    """One line of a batch as ``oncely batches show`` names it: its custom
    id, and the job and call (checkpoint key) it stands for."""

    custom_id: str
    job_id: str
    key: str
    status: str

    def to_json(self) -> dict[str, str]:
        return {"custom_id": self.custom_id, "job_id": self.job_id, "key": self.key,
                "status": self.status}  # fmt: skip


class BatchLines:
    """The ``batch_lines`` table: the lines' intents, their batches, their answers."""

    def __init__(
        self,
        pool: AsyncConnectionPool,
        *,
        poll_s: float = 30.0,
        statement_timeout_s: float = 10.0,
    ) -> None:
        self.pool = pool
        # How often a waiting job looks for its answer, and a batch is polled.
        self.poll_s = poll_s
        self.timeout_s = statement_timeout_s

    async def _run(self, name: str, params: Any = None) -> StatementResult:
        return await run_statement(self.pool, query(name), params, timeout_s=self.timeout_s)

    async def intend(
        self,
        custom_id: str,
        *,
        job_id: str,
        key: str,
        workflow: str,
        tenant: str,
        model: str,
        dialect: str,
        body: dict[str, Any],
    ) -> None:
        """A call's line, stored before any batch exists (once: a
        redelivery's intent is the same row)."""
        await self._run(
            "intend_batch_line",
            {
                "custom_id": custom_id,
                "job_id": job_id,
                "call_key": key,
                "workflow": workflow,
                "tenant": tenant,
                "model": model,
                "dialect": dialect,
                "body": Jsonb(body),
            },
        )
        BATCH_LINES.labels(outcome="intended").inc()

    async def line(self, custom_id: str) -> Line | None:
        rows = (await self._run("batch_line", (custom_id,))).rows
        if not rows:
            return None
        status, answer, error, submissions, waited_s = rows[0]
        return Line(custom_id, status, answer, error, int(submissions), float(waited_s or 0.0))

    async def retry(self, custom_id: str) -> None:
        """A line that failed transiently (or was dropped with a job that
        runs again), back in line for the next batch."""
        await self._run("retry_batch_line", (custom_id,))

    async def lines_of(self, batch_id: str, *, limit: int = 1000) -> list[LineRow]:
        """A batch's lines, oldest first: the jobs behind its custom ids."""
        result = await self._run("lines_of_batch", {"batch_id": batch_id, "limit": limit})
        return [LineRow(*row) for row in result.rows]

    async def batches(self, batch_id: str | None = None, *, limit: int = 50) -> list[BatchRow]:
        result = await self._run("list_batches", {"batch_id": batch_id, "limit": limit})
        return [
            BatchRow(str(b), s, p, m, d, int(n), int(a), int(f), int(w), c, u)
            for b, s, p, m, d, n, a, f, w, c, u in result.rows
        ]


@dataclass(frozen=True)
class Outcome:
    """What a batch's result makes of its line: ``answered`` with the
    provider's answer (a response body, a message), or ``failed`` with
    ``{"status", "code"}`` (never the error's message)."""

    custom_id: str
    status: str
    answer: dict[str, Any] | None = None
    error: dict[str, Any] | None = None


@dataclass(frozen=True)
class Unrecorded:
    """A batch gathered but not recorded (module doc, step 4): what its
    lines tell of the batch a process may have created before it died."""

    batch_id: str
    dialect: str
    lines: list[tuple[str, Any]]
    # When its lines were gathered, by PostgreSQL's clock: a batch created
    # for them was created after that.
    gathered_at: datetime


class BatchAPI(Protocol):
    """A provider's batch API for one dialect."""

    async def create(self, batch_id: str, lines: Sequence[tuple[str, Any]]) -> str:
        """Create a batch of ``lines`` (custom id, body), marked with
        ``batch_id`` where the provider keeps metadata; the provider's id."""
        ...

    async def find(self, lost: Unrecorded) -> list[str]:
        """The provider's ids of the batches that may be the one created
        for ``lost``, likeliest first (none: it was never created)."""
        ...

    async def poll(self, provider_id: str) -> tuple[str, list[Outcome]]:
        """The batch's status (``completed``, ``expired``, ``cancelled``,
        ``failed`` once it ended; any other while it runs) and, once it
        ended, its lines' outcomes (a line with none is left unanswered)."""
        ...


class OpenAIBatches:
    """OpenAI's Files and Batches API through the openai SDK (its retries
    off), for the lines of one dialect (``chat``; ``for_dialect`` gives
    the same client for another). A batch carries its oncely id in its
    metadata: the recovery finds it by that id alone."""

    def __init__(self, client: Any, dialect: str = "chat") -> None:
        self._client = client
        self._endpoint = ENDPOINTS[dialect]

    @classmethod
    def connect(cls, base_url: str, api_key: str) -> OpenAIBatches:
        import openai

        return cls(openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0))

    def for_dialect(self, dialect: str) -> OpenAIBatches:
        """The same client, for lines of ``dialect`` (closed with this one)."""
        return OpenAIBatches(self._client, dialect)

    async def aclose(self) -> None:
        await self._client.close()

    async def create(self, batch_id: str, lines: Sequence[tuple[str, Any]]) -> str:
        url = self._endpoint
        data = b"".join(
            json.dumps(
                {"custom_id": custom_id, "method": "POST", "url": url, "body": body}
            ).encode()
            + b"\n"
            for custom_id, body in lines
        )
        uploaded = await self._client.files.create(
            file=(f"oncely-{batch_id}.jsonl", data), purpose="batch"
        )
        created = await self._client.batches.create(
            input_file_id=wire.provider_id(uploaded.id),
            endpoint=url,
            completion_window="24h",
            metadata={METADATA_KEY: batch_id},
        )
        return wire.provider_id(created.id)

    async def find(self, lost: Unrecorded) -> list[str]:
        # The provider lists newest first: a lost batch is a recent one.
        page = await self._client.batches.list(limit=100)
        for batch in page.data:
            metadata = batch.metadata or {}
            if metadata.get(METADATA_KEY) == lost.batch_id:
                return [wire.provider_id(batch.id)]
        return []

    async def poll(self, provider_id: str) -> tuple[str, list[Outcome]]:
        batch = await self._client.batches.retrieve(wire.provider_id(provider_id))
        status = str(batch.status)
        if status not in _ENDED:
            return status, []
        results: list[dict[str, Any]] = []
        for file_id in (batch.output_file_id, batch.error_file_id):
            if file_id:
                content = await self._client.files.content(wire.provider_id(file_id))
                results += jsonl(content.content)
        return status, _outcomes(results)


def jsonl(data: bytes) -> list[dict[str, Any]]:
    """A results file's lines (one JSON document each; others skipped)."""
    found = []
    for raw in data.splitlines():
        try:
            item = json.loads(raw)
        except ValueError:
            continue
        if isinstance(item, dict):
            found.append(item)
    return found


def _outcomes(results: Sequence[dict[str, Any]]) -> list[Outcome]:
    """Each result as its line's new state: answered with the body of a
    200, else failed with the status and the error's code (never its message)."""
    rows = []
    for result in results:
        custom_id = result.get("custom_id")
        response = result.get("response")
        if not isinstance(custom_id, str) or not isinstance(response, dict):
            continue
        status = response.get("status_code")
        body = response.get("body")
        if status == 200 and isinstance(body, dict):
            rows.append(Outcome(custom_id, "answered", answer=body))
            continue
        error = body.get("error") if isinstance(body, dict) else None
        code = error.get("code") if isinstance(error, dict) else None
        status = status if isinstance(status, int) else 500
        rows.append(Outcome(custom_id, "failed", error=failure(status, code)))
    return rows


def failure(status: int, code: object) -> dict[str, Any]:
    """A failed line's error: its status and a short code, never a message."""
    return {"status": status, "code": wire.plain_code(code)}


class Batcher:
    """Gathers waiting lines into batches, creates and records them,
    recovers the ones created but not recorded, and stores their answers
    (module doc). One per worker process; ``apis`` by dialect."""

    def __init__(
        self,
        lines: BatchLines,
        apis: dict[str, BatchAPI],
        *,
        gather_s: float = 60.0,
        max_calls: int = 10_000,
        lease_s: float = 300.0,
        keep_s: float = 7 * 86400.0,
    ) -> None:
        self.lines = lines
        self.keep_s = keep_s
        self._pruned_at = float("-inf")
        self.apis = apis
        self.gather_s = gather_s
        self.max_calls = max_calls
        self.lease_s = lease_s
        self._stopping = asyncio.Event()

    async def run(self) -> None:
        while not self._stopping.is_set():
            try:
                await self.tick()
            except Exception as exc:  # a provider or PostgreSQL down: the next tick
                log.warning("batch.tick_failed", error=type(exc).__name__)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.lines.poll_s)

    def stop(self) -> None:
        self._stopping.set()

    async def tick(self) -> None:
        """One pass: recover, gather and create, poll; prune now and then."""
        await self.recover()
        await self.gather()
        await self.poll()
        if time.monotonic() - self._pruned_at >= _PRUNE_EVERY_S:
            self._pruned_at = time.monotonic()
            await self.prune()

    async def prune(self) -> int:
        """Delete settled lines past their keep whose job ended; how many."""
        total = 0
        while True:
            deleted = (
                await self.lines._run(
                    "prune_batch_lines", {"keep_s": self.keep_s, "limit": _PRUNE_BATCH}
                )
            ).rowcount
            total += deleted
            if deleted < _PRUNE_BATCH:
                return total

    async def gather(self) -> None:
        await self.lines._run("drop_ended_batch_lines")
        ready = (
            await self.lines._run(
                "ready_batch_groups", {"max_calls": self.max_calls, "gather_s": self.gather_s}
            )
        ).rows
        for model, dialect in ready:
            api = self.apis.get(dialect)
            if api is None:
                continue
            batch_id = str(uuid.uuid4())
            gathered = (
                await self.lines._run(
                    "gather_batch",
                    {
                        "model": model,
                        "dialect": dialect,
                        "max_calls": self.max_calls,
                        "batch_id": batch_id,
                        "lease_s": self.lease_s,
                    },
                )
            ).rows
            if not gathered:
                continue
            log.info("batch.gathered", batch_id=batch_id, model=model, lines=len(gathered))
            provider_id = await self.submit(api, batch_id, gathered)
            await self.record(batch_id, provider_id)

    async def submit(self, api: BatchAPI, batch_id: str, lines: Sequence[Any]) -> str:
        """Create the gathered batch at the provider (its lines' intents and
        its id are stored already)."""
        provider_id = await api.create(batch_id, [(c, b) for c, b in lines])
        BATCHES.labels(event="created").inc()
        return provider_id

    async def record(self, batch_id: str, provider_id: str) -> None:
        """The provider's id on the batch's lines: polled from now on."""
        await self.lines._run("record_batch", {"batch_id": batch_id, "provider_id": provider_id})
        log.info("batch.recorded", batch_id=batch_id)

    async def recover(self) -> None:
        """Batches gathered but not recorded whose lease ran out: each
        adopts the likeliest batch the provider has for it that no other
        oncely batch recorded, else is created (module doc)."""
        for lost in await self._claim_unrecorded():
            api = self.apis.get(lost.dialect)
            if api is None:
                continue
            if await self._adopt(lost, await api.find(lost)):
                continue
            log.warning("batch.created_after_crash", batch_id=lost.batch_id, lines=len(lost.lines))
            await self.record(lost.batch_id, await self.submit(api, lost.batch_id, lost.lines))

    async def _claim_unrecorded(self) -> list[Unrecorded]:
        claimed = (
            await self.lines._run("claim_unrecorded_batches", {"lease_s": self.lease_s})
        ).rows
        lost: dict[str, Unrecorded] = {}
        for batch_id, dialect, gathered_at, custom_id, body in claimed:
            batch = lost.setdefault(
                str(batch_id), Unrecorded(str(batch_id), dialect, [], gathered_at)
            )
            batch.lines.append((custom_id, body))
        return list(lost.values())

    async def _adopt(self, lost: Unrecorded, candidates: Sequence[str]) -> bool:
        """The first candidate no other oncely batch recorded, recorded as
        ``lost``'s; False when there is none."""
        for provider_id in candidates:
            params = {"batch_id": lost.batch_id, "provider_id": provider_id}
            if (await self.lines._run("adopt_batch", params)).rowcount:
                BATCHES.labels(event="adopted").inc()
                log.warning("batch.adopted", batch_id=lost.batch_id)
                return True
        return False

    async def poll(self) -> None:
        due = (await self.lines._run("claim_submitted_batches", {"poll_s": self.lines.poll_s})).rows
        for batch_id, provider_id, dialect in due:
            api = self.apis.get(dialect)
            if api is None:
                continue
            status, outcomes = await api.poll(provider_id)
            if status not in _ENDED:
                continue
            await self.settle(str(batch_id), status, outcomes)

    async def settle(self, batch_id: str, status: str, outcomes: Sequence[Outcome]) -> None:
        """An ended batch's results into its lines; those left unanswered
        go back in line (expired) or fail (module doc)."""
        rows = [asdict(outcome) for outcome in outcomes]
        if rows:
            await self.lines._run("answer_batch_lines", {"batch_id": batch_id, "rows": Jsonb(rows)})
        for outcome in outcomes:
            BATCH_LINES.labels(outcome=outcome.status).inc()
        # A line expired twice fails for good (410); a batch the provider
        # cancelled or failed fails its lines transiently (500): they go in
        # the next batch when their jobs look again.
        error = {"status": 410 if status == "expired" else 500, "code": f"batch_{status}"}
        await self.lines._run(
            "end_batch",
            {"batch_id": batch_id, "resubmit": status == "expired", "error": Jsonb(error)},
        )
        BATCHES.labels(event=status).inc()
        log.info("batch.ended", batch_id=batch_id, status=status, results=len(outcomes))
