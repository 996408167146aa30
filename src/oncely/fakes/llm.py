"""The fake model: an OpenAI-compatible chat endpoint whose faults are scripted
by the prompt itself (docs/fakes.md). This module is the server: it reads
requests in each dialect, counts calls and serves or fails them as the
prompt's script says (``oncely.fakes.script``: the directives and the
answer; ``oncely.fakes.schema``: the one instance of a response schema).

It answers an extractive summary of the last user message (its first two
sentences; for a model whose name contains ``v2``, the first sentence only),
or, for a ``json_schema`` response format, the schema's instance derived
from the same message. ``usage`` estimates four characters a token over
all messages.

Directives in the last user message, counted per distinct prompt (sha256), so
a job's fate is written in its own text and survives redeliveries:

- ``[[fake:429*N]]``, ``[[fake:503*N]]``, ``[[fake:400*N]]``: the next N calls
  answer that status (429 with ``Retry-After: 1``).
- ``[[fake:hang*N]]``: never answers. ``[[fake:drip*N]]``: a 200 whose body
  comes one byte a second, forever.
- ``[[fake:badjson*N]]``: a 200 whose content is not what was asked for:
  truncated JSON (``{"oops": ``) when a schema was asked for, else ``not json``.
- ``[[fake:cut*N]]``: the answer is generated (and billed), then the
  connection drops halfway through it: a stream after half its chunks, a
  whole answer after half its body.
- ``[[fake:sleep=S]]``: every call takes S seconds first.
- ``[[fake:typing=S]]``: a streamed answer waits S seconds between chunks;
  a whole answer waits as long, before it is sent.

The flex tier (docs/lanes.md): a request with ``service_tier: "flex"`` is
answered as any other, its answer saying ``service_tier: "flex"``
(``default`` otherwise); ``[[fake:busy*N]]`` makes the prompt's next N
flex calls answer 429 ``resource_unavailable`` (the flex tier out of
capacity, ``Retry-After: 1``) while its standard-tier calls answer.
``/_calls`` counts calls per tier (``tiers``) and the ``busy`` fault per
prompt.

Without ``*N`` a fault applies to every call. Faults run in the order written:
``[[fake:503*2]] [[fake:429*1]]`` answers 503, 503, 429, then a summary.

A request with ``stream: true`` gets the same answer as server-sent chunks,
as providers send them: the role, the content a word a chunk (or each tool
call's name, then its arguments), the finish reason, the usage in a last
chunk of its own, then ``data: [DONE]``.

Tool calls (docs/agents.md), when the request declares ``tools``: each
``[[fake:tool=NAME {json arguments}]]`` in the conversation's *first* user
message is one tool call, ``call_<n>`` for the n-th directive. The fake
answers, turn by turn, the first call not yet answered by a ``tool`` message
with that ``tool_call_id`` (``[[fake:tools=parallel]]``: all of them in one
turn), then its usual final answer (text, or JSON for the schema). A name
the request did not declare is called all the same (an agent must cope).
``[[fake:badargs]]`` sends the first unanswered call's arguments as text
that is not JSON. ``[[fake:tool_ids=repeat]]`` gives every call the id
``call_0`` and ``[[fake:tool_ids=none]]`` gives none, as some
OpenAI-compatible servers do: calls then count as answered in order, one per
``tool`` message. ``GET /_calls?messages=1`` adds ``requests``: the
messages of the last 100 requests, oldest first.

A whole-provider outage is switched by the test: ``POST /_outage {"fault":
"503"}`` makes every call answer that fault until ``DELETE /_outage``. With
``"model": M`` in either body, only calls asking for model ``M`` (a broken
shadow variant, say): ``POST /_outage {"fault": "400", "model": "fake-v2"}``.

Random faults, for soaks (``oncely fake-llm --faults 429=0.05,slow=0.05 --seed
S``): each call meets at most one, at its kind's rate: ``429`` (with
``Retry-After: 1``), ``503``, ``hang``, ``drip``, ``badjson`` as above, or
``slow`` (the answer takes ``slow_s``: a long generation).
Which call meets which is fixed by the seed, the prompt and the call's number
for that prompt (``oncely.fakes.faults``), so a rerun gives each job the same
fate. A scripted fault wins over a random one on the same call; an outage
over both. ``--fault-rate F`` is ``429=F/2,503=F/2``.

``GET /_calls`` counts calls per model name (``models``) and the tokens
each model's answers reported (``tokens``), the calls whose
client went away before the answer (``abandoned``: a cancelled call, in all
and per prompt), and per prompt the calls, the ones ``billed`` (the real
answer was generated, whether or not the client stayed to read it: what a
provider bills) with the client port each came from (which process paid),
and the faults met, by kind, with
their client ports too; with random faults on, ``random_faults`` totals them.

It must never be a benchmark's bottleneck: no middleware, no access log,
directives parsed and answers worked out once per distinct prompt (and schema),
O(1) work per call otherwise.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import re
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from types import TracebackType
from typing import Any, Literal, cast

import structlog
from aiohttp import web

from oncely.fakes import messages as messages_wire
from oncely.fakes import responses as responses_wire
from oncely.fakes.batches import (
    DEFAULT_BATCH_DELAY_S,
    FAKE_BATCHES,
    MAX_BATCH_FILE_BYTES,
    FakeBatches,
    mount_batches,
)
from oncely.fakes.faults import RandomFaults
from oncely.fakes.schema import InvalidSchema
from oncely.fakes.script import (
    CHARS_PER_TOKEN,
    NO_IDS,
    REPEATED_IDS,
    ChatRequest,
    Dialect,
    FaultKind,
    HttpFault,
    Prompt,
    excerpt,
    tool_script,
)

log = structlog.get_logger(__name__)

# What ``--faults`` may name, in the order rates are drawn.
RANDOM_FAULTS = ("429", "503", "hang", "drip", "slow", "badjson")
RandomFault = FaultKind | Literal["slow"]

# How many requests' messages ``/_calls?messages=1`` keeps.
_RECENT = 100
# What ``[[fake:refusal]]`` and ``[[fake:credit]]`` say.
_REFUSAL = "I can't help with that."
_NO_CREDIT = (
    "Your credit balance is too low to access the Anthropic API. Please go to Plans & Billing"
    " to upgrade or purchase credits."
)
_NO_QUOTA = "You exceeded your current quota, please check your plan and billing details."
# What ``[[fake:badjson]]`` answers: invalid for any schema, and not JSON at all.
_BAD_JSON = '{"oops": '
_NOT_JSON = "not json"
# The fake's rate limit window (``--rpm``).
_LIMIT_WINDOW_S = 60.0
# Fakes hold nothing worth waiting for; a hung call must not stall shutdown.
_SHUTDOWN_TIMEOUT_S = 0.1
# How long a random ``slow`` call takes to answer.
DEFAULT_SLOW_S = 2.0


@dataclass
class _Job:
    """A background response: its id, what it asks, the document GET
    answers, the task working on it (None once done), and its stream's
    events so far (``sequence_number`` = index), for every client that
    streams it, from any point."""

    id: str
    chat: ChatRequest
    document: dict[str, Any]
    task: asyncio.Task[None] | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    finished: bool = False
    _grown: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, event: dict[str, Any]) -> None:
        self.events.append({**event, "sequence_number": len(self.events)})
        self._wake()

    def finish(self, document: dict[str, Any]) -> None:
        self.document, self.finished = document, True
        self._wake()

    def _wake(self) -> None:
        self._grown.set()
        self._grown = asyncio.Event()

    async def follow(self, after: int) -> AsyncIterator[dict[str, Any]]:
        """The events after number ``after``, as they come, until it is done."""
        number = after + 1
        while True:
            grown = self._grown
            while number < len(self.events):
                yield self.events[number]
                number += 1
            if self.finished:
                return
            await grown.wait()


# Faults that still answer 200 (the answer itself is what is wrong).
_ANSWERED_FAULTS = frozenset({"badjson", "slow", "cut", "refusal", "pause"})
# Faults a background create answers at once: (status, message, code).
_CREATE_ERRORS = {
    "429": (429, "Rate limit reached (scripted)", "rate_limit_exceeded"),
    "400": (400, "Invalid request (scripted)", "invalid_request_error"),
    "credit": (429, _NO_QUOTA, "insufficient_quota"),
}


# What a batch's line answers for a fault that would be an HTTP status.
_LINE_ERRORS = {
    **_CREATE_ERRORS,
    "503": (503, "The server had an error (scripted)", "server_error"),
    "529": (529, "Overloaded (scripted)", "overloaded_error"),
}


@dataclass(frozen=True)
class PromptCalls:
    sha256: str
    count: int
    excerpt: str
    # Calls whose real answer was generated (billed), the client port of
    # each, and the faults met, by kind, with the client port of each.
    billed: int = 0
    billed_ports: list[int] = field(default_factory=list)
    faults: dict[str, int] = field(default_factory=dict)
    fault_ports: dict[str, list[int]] = field(default_factory=dict)
    # Calls whose client went away before the answer (a cancelled call).
    abandoned: int = 0


@dataclass(frozen=True)
class CallStats:
    """What ``GET /_calls`` answers. ``count`` excludes calls refused by rpm/tpm."""

    total: int
    in_flight: int
    max_in_flight: int
    prompts: list[PromptCalls]
    # Calls per requested model name (refused ones included).
    models: dict[str, int] = field(default_factory=dict)
    # Calls whose client went away before the answer.
    abandoned: int = 0
    # The usage each model's answers reported: {"prompt": n, "completion": m}.
    tokens: dict[str, dict[str, int]] = field(default_factory=dict)
    # Calls per dialect: ``chat`` (/v1/chat/completions), ``responses``
    # (POST /v1/responses: creates), ``anthropic`` (/v1/messages).
    dialects: dict[str, int] = field(default_factory=dict)
    # The Responses API's background responses: ``created`` (background
    # creates), ``retrieved`` (GET /v1/responses/{id}), ``cancelled``.
    background: dict[str, int] = field(default_factory=dict)
    rate_limited: int | None = None  # only when an rpm/tpm limit is on
    random_faults: dict[str, int] | None = None  # only when random faults are on
    # OpenAI calls per tier asked (``flex``, ``default``), busy ones included.
    tiers: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        body = asdict(self)
        for optional in ("rate_limited", "random_faults"):
            if body[optional] is None:
                del body[optional]
        return body


@dataclass
class _RateLimit:
    """A provider-style per-minute limit on requests and tokens, sliding window."""

    rpm: int
    tpm: int
    _admitted: deque[tuple[float, int]] = field(default_factory=deque)
    _tokens: int = 0

    def admit(self, tokens: int, now: float) -> float | None:
        """None if the call may proceed, else the seconds until it might."""
        while self._admitted and self._admitted[0][0] <= now - _LIMIT_WINDOW_S:
            self._tokens -= self._admitted.popleft()[1]
        over_rpm = self.rpm and len(self._admitted) >= self.rpm
        over_tpm = self.tpm and self._tokens + tokens > self.tpm
        if over_rpm or over_tpm:
            oldest = self._admitted[0][0] if self._admitted else now
            return max(0.0, oldest + _LIMIT_WINDOW_S - now)
        self._admitted.append((now, tokens))
        self._tokens += tokens
        return None


class FakeModel:
    """The fake's state and routes. One per app; all in one event loop, no locks."""

    def __init__(
        self,
        *,
        rpm: int = 0,
        tpm: int = 0,
        fault_rate: float = 0.0,
        seed: int = 0,
        faults: Mapping[str, float] | None = None,
        slow_s: float = DEFAULT_SLOW_S,
    ):
        self._limits = (rpm, tpm)
        self.random = RandomFaults(RANDOM_FAULTS, _with_fault_rate(faults or {}, fault_rate), seed)
        self.slow_s = slow_s
        self.in_flight = 0
        # A provider outage: while set, every call answers this fault
        # (``POST /_outage {"fault": "503"}``, ended by ``DELETE /_outage``).
        self.outage: HttpFault | None = None
        # The same for one model name only.
        self.model_outages: dict[str, HttpFault] = {}
        self.reset()

    def reset(self) -> None:
        self.total = 0
        self.abandoned = 0
        self.max_in_flight = self.in_flight
        self.rate_limited = 0
        self.random_faults: dict[str, int] = {}
        self.models: dict[str, int] = {}
        self.dialects: dict[str, int] = {}
        self.tokens: dict[str, dict[str, int]] = {}
        self.background = {"created": 0, "retrieved": 0, "cancelled": 0, "streamed": 0}
        # Each background stream asked for again: the ``starting_after`` it
        # gave (-1: none, from the first event).
        self.resumed_after: list[int] = []
        self.tiers: dict[str, int] = {}
        for job in getattr(self, "_jobs", {}).values():
            if job.task is not None:
                job.task.cancel()
        self._jobs: dict[str, _Job] = {}
        self._prompts: dict[str, Prompt] = {}
        self._tool_scripts: dict[str, tuple[list[dict[str, Any]], bool, bool]] = {}
        self.recent: deque[list[Any]] = deque(maxlen=_RECENT)
        self._limit = _RateLimit(*self._limits) if any(self._limits) else None

    def stats(self, contains: str | None = None) -> CallStats:
        prompts = [
            PromptCalls(
                p.sha256,
                p.count,
                excerpt(p.text),
                p.billed,
                list(p.billed_ports),
                dict(p.faults),
                {kind: list(ports) for kind, ports in p.fault_ports.items()},
                p.abandoned,
            )
            for p in self._prompts.values()
            if contains is None or contains in p.text
        ]
        rate_limited = self.rate_limited if self._limit is not None else None
        random_faults = dict(self.random_faults) if self.random else None
        return CallStats(
            self.total,
            self.in_flight,
            self.max_in_flight,
            prompts,
            dict(self.models),
            self.abandoned,
            {model: dict(kinds) for model, kinds in self.tokens.items()},
            dict(self.dialects),
            dict(self.background),
            rate_limited,
            random_faults,
            dict(self.tiers),
        )

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._call(request, "chat")

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """Anthropic's Messages API (``oncely.fakes.messages``)."""
        return await self._call(request, "anthropic")

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's Responses API (``oncely.fakes.responses``)."""
        return await self._call(request, "responses")

    async def retrieve_response(self, request: web.Request) -> web.StreamResponse:
        """``GET /v1/responses/{id}``: a background response as it stands;
        with ``stream=true`` its events after ``starting_after`` (from the
        first without it), as they come, to its end."""
        job = self._jobs.get(request.match_info["id"])
        if job is None:
            return _error(404, "No response found with that id", "not_found", "responses")
        if request.query.get("stream") != "true":
            self.background["retrieved"] += 1
            return web.json_response(job.document)
        try:
            after = int(request.query.get("starting_after", "-1"))
        except ValueError:
            return _error(400, "starting_after must be an integer", "invalid_value", "responses")
        self.background["streamed"] += 1
        self.resumed_after.append(after)
        return await _follow(request, job, after)

    async def cancel_response(self, request: web.Request) -> web.Response:
        """``POST /v1/responses/{id}/cancel``: a background response not done
        yet is cancelled (its generation stops, unbilled if not begun)."""
        job = self._jobs.get(request.match_info["id"])
        if job is None:
            return _error(404, "No response found with that id", "not_found", "responses")
        if job.document["status"] in ("queued", "in_progress"):
            self.background["cancelled"] += 1
            if job.task is not None:
                job.task.cancel()
            job.finish(responses_wire.cancelled(job.id, job.chat.model))
        return web.json_response(job.document)

    async def _call(self, request: web.Request, dialect: Dialect) -> web.StreamResponse:
        self.total += 1
        self.dialects[dialect] = self.dialects.get(dialect, 0) + 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        prompt: list[Prompt] = []
        try:
            return await self._complete(request, prompt, dialect)
        except asyncio.CancelledError:
            # The client went away first (its call was cancelled or cut off).
            self.abandoned += 1
            for p in prompt:
                p.abandoned += 1
            raise
        finally:
            self.in_flight -= 1

    async def _complete(
        self, request: web.Request, called: list[Prompt], dialect: Dialect
    ) -> web.StreamResponse:
        parsed = _parse_request(await request.read(), dialect)
        if isinstance(parsed, web.Response):
            return parsed
        chat, messages = parsed
        self.recent.append(messages)
        self.models[chat.model] = self.models.get(chat.model, 0) + 1
        refused = self._refuse_over_limit(chat.prompt_tokens, dialect)
        if refused is not None:
            return refused
        prompt = self._prompt(chat.text)
        called.append(prompt)
        prompt.count += 1
        call = prompt.count  # read before sleeping: concurrent calls each get their number
        port = _client_port(request)
        if chat.dialect != "anthropic":
            tier = chat.tier or "default"
            self.tiers[tier] = self.tiers.get(tier, 0) + 1
            if tier == "flex" and prompt.no_capacity():
                prompt.faults["busy"] = prompt.faults.get("busy", 0) + 1
                prompt.fault_ports.setdefault("busy", []).append(port)
                return _no_flex_capacity(dialect)
        if chat.background:
            return await self._start_background(request, chat, prompt, call, port)
        if prompt.sleep_s:
            await asyncio.sleep(prompt.sleep_s)
        fault = self._fault(chat, prompt, call, port)
        if fault is not None and fault not in _ANSWERED_FAULTS:
            return await _FAULTS[cast(HttpFault, fault)](request, dialect)
        try:
            answer = await self._answer(chat, prompt, fault, port)
        except InvalidSchema as exc:
            return _error(400, f"invalid json_schema: {exc}", "invalid_request_error", dialect)
        return await _respond(request, chat, answer, prompt, fault)

    def _fault(self, chat: ChatRequest, prompt: Prompt, call: int, port: int) -> str | None:
        """The fault the prompt's ``call``-th call meets (counted), if any."""
        fault = (
            self.outage
            or self.model_outages.get(chat.model)
            or prompt.fault_for(call)
            or self._random_fault(prompt.sha256, call)
        )
        if fault is not None:
            prompt.faults[fault] = prompt.faults.get(fault, 0) + 1
            prompt.fault_ports.setdefault(fault, []).append(port)
        return fault

    async def _answer(
        self, chat: ChatRequest, prompt: Prompt, fault: str | None, port: int
    ) -> dict[str, Any]:
        """The answer, as a chat completion (the dialect's shape is
        ``_document``'s), billed once generating starts, as a provider bills
        it, even if the client goes away before a slow answer is done."""
        if fault == "badjson":
            content = _BAD_JSON if chat.schema is not None else _NOT_JSON
        else:
            calls = self._tool_calls(chat)
            if calls:
                prompt.billed += 1
                prompt.billed_ports.append(port)
                return _tool_completion(chat, calls, self.total)
            content = _rest(prompt.answer(chat), chat.continued)
            prompt.billed += 1
            prompt.billed_ports.append(port)
            if fault == "slow":
                await asyncio.sleep(self.slow_s)
        used = self.tokens.setdefault(chat.model, {"prompt": 0, "completion": 0})
        used["prompt"] += chat.prompt_tokens
        used["completion"] += _completion_tokens(content)
        return _completion(chat, content, self.total, refused=fault == "refusal")

    async def _start_background(
        self, request: web.Request, chat: ChatRequest, prompt: Prompt, call: int, port: int
    ) -> web.StreamResponse:
        """A background response: created at once (``queued``), worked on by a
        task of its own (``_think``), its events streamed to the creator when
        asked (``stream: true``: the creator going away stops nothing). A
        fault the API answers at create time (429, 400, a dry account) is
        answered now; a 503 or 529 fails the response; a hang or a drip
        never ends it."""
        fault = self._fault(chat, prompt, call, port)
        if fault in ("429", "400", "credit"):
            return _error(*_CREATE_ERRORS[fault], "responses")
        self.background["created"] += 1
        response_id = f"resp_fake_{self.total}"
        job = _Job(response_id, chat, responses_wire.pending(response_id, chat.model))
        job.add({"type": "response.created", "response": job.document})
        self._jobs[response_id] = job
        job.task = asyncio.create_task(self._think(job, prompt, fault, port))
        if prompt.late_s:
            await asyncio.sleep(prompt.late_s)
        if chat.stream:
            return await _follow(request, job, -1)
        return web.json_response(job.document)

    async def _think(self, job: _Job, prompt: Prompt, fault: str | None, port: int) -> None:
        """Work a background response out: its events one by one (a
        ``typing`` pause between them), the document done with the last."""
        chat = job.chat
        job.document = responses_wire.pending(job.id, chat.model, "in_progress")
        try:
            if prompt.sleep_s:
                await asyncio.sleep(prompt.sleep_s)
            if fault in ("503", "529"):
                _fail(job, "server_error", "The server had an error (scripted)")
                return
            if fault in ("hang", "drip"):
                await asyncio.Event().wait()
            try:
                answer = await self._answer(chat, prompt, fault, port)
            except InvalidSchema as exc:
                _fail(job, "invalid_prompt", f"invalid json_schema: {exc}")
                return
            document, _ = _document(chat, answer, prompt, fault)
            document = {**document, "id": job.id}
            *events, _ = responses_wire.events(document)[1:]
            for event in events:
                if prompt.typing_s:
                    await asyncio.sleep(prompt.typing_s)
                job.add(event)
            job.add({"type": "response.completed", "response": document})
            job.finish(document)
        finally:
            job.task = None

    def _refuse_over_limit(self, tokens: int, dialect: Dialect) -> web.Response | None:
        if self._limit is None:
            return None
        wait_s = self._limit.admit(tokens, time.monotonic())
        if wait_s is None:
            return None
        self.rate_limited += 1
        retry_after = max(1, math.ceil(wait_s))
        return _error(
            429, "Rate limit reached", "rate_limit_exceeded", dialect, retry_after=retry_after
        )

    def _prompt(self, text: str) -> Prompt:
        sha = hashlib.sha256(text.encode()).hexdigest()
        prompt = self._prompts.get(sha)
        if prompt is None:
            prompt = self._prompts[sha] = Prompt.parse(sha, text)
        return prompt

    def _tool_calls(self, chat: ChatRequest) -> list[dict[str, Any]]:
        """The tool calls this turn answers (none: the final answer)."""
        if not chat.tools or "[[fake:tool" not in chat.first_user:
            return []
        script = self._tool_scripts.get(chat.first_user)
        if script is None:
            script = self._tool_scripts[chat.first_user] = tool_script(chat.first_user)
        calls, parallel, bad_args = script
        if REPEATED_IDS in chat.first_user or NO_IDS in chat.first_user:
            pending = calls[chat.tool_results :]
        else:
            pending = [c for c in calls if c["id"] not in chat.answered]
        if not pending:
            return []
        turn = pending if parallel else pending[:1]
        if REPEATED_IDS in chat.first_user:
            turn = [{**c, "id": "call_0"} for c in turn]
        elif NO_IDS in chat.first_user:
            turn = [{k: v for k, v in c.items() if k != "id"} for c in turn]
        if bad_args:
            first = turn[0]
            turn = [
                {**first, "function": {**first["function"], "arguments": "{not json"}},
                *turn[1:],
            ]
        return turn

    def _random_fault(self, sha256: str, call: int) -> RandomFault | None:
        kind = self.random.draw(sha256, call)
        if kind is not None:
            self.random_faults[kind] = self.random_faults.get(kind, 0) + 1
        return cast(RandomFault | None, kind)

    async def answer_line(self, body: object, dialect: str) -> tuple[int, dict[str, Any]]:
        """A ``chat``, ``responses`` or ``anthropic`` request's answer with
        no HTTP request of its own (a batch's line, ``oncely.fakes.batches``):
        its status and body in its dialect's shape, its prompt's directives
        and counts as for any call."""
        asked = cast(Dialect, dialect if dialect in ("responses", "anthropic") else "chat")
        parsed = _parse_request(json.dumps(body).encode(), asked)
        if isinstance(parsed, web.Response):
            return parsed.status, json.loads(cast(bytes, parsed.body))
        chat, _ = parsed
        self.total += 1
        self.dialects[asked] = self.dialects.get(asked, 0) + 1
        self.models[chat.model] = self.models.get(chat.model, 0) + 1
        prompt = self._prompt(chat.text)
        prompt.count += 1
        fault = self._fault(chat, prompt, prompt.count, 0)
        if fault == "credit" and asked == "anthropic":  # as _answer_credit says it
            return 400, _line_error(400, _NO_CREDIT, "invalid_request_error", asked)
        if fault in _LINE_ERRORS:
            status, message, code = _LINE_ERRORS[fault]
            return status, _line_error(status, message, code, asked)
        try:
            answer = await self._answer(chat, prompt, fault, 0)
        except InvalidSchema as exc:
            return 400, _line_error(400, f"invalid json_schema: {exc}", "invalid", asked)
        document, _ = _document(chat, answer, prompt, fault)
        return 200, document

    async def calls(self, request: web.Request) -> web.Response:
        body = self.stats(request.query.get("contains")).to_json()
        if request.query.get("messages"):
            body["requests"] = [{"messages": m} for m in self.recent]
        return web.json_response(body)

    async def reset_route(self, request: web.Request) -> web.Response:
        self.reset()
        return web.json_response({"reset": True})

    async def start_outage(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        fault, model = body.get("fault", "503"), body.get("model")
        if fault not in _FAULTS:
            return _error(
                400, f"fault must be one of {sorted(_FAULTS)}", "invalid_request_error", "chat"
            )
        if model is None:
            self.outage = fault
        else:
            self.model_outages[str(model)] = fault
        return web.json_response({"outage": fault, "model": model})

    async def end_outage(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        if body.get("model") is None:
            self.outage = None
        else:
            self.model_outages.pop(str(body["model"]), None)
        return web.json_response({"outage": None, "model": body.get("model")})


def _line_error(status: int, message: str, code: str, dialect: Dialect) -> dict[str, Any]:
    """A batch line's error body, as its dialect's API sends an error."""
    if dialect == "anthropic":
        return messages_wire.error_body(status, message)
    return {"error": {"message": message, "type": code, "code": code}}


def _client_port(request: web.Request) -> int:
    peer = request.transport.get_extra_info("peername") if request.transport else None
    return int(peer[1]) if isinstance(peer, tuple) and len(peer) >= 2 else 0


def _with_fault_rate(faults: Mapping[str, float], fault_rate: float) -> dict[str, float]:
    """``fault_rate`` (the older option) is half 429s and half 503s, on top of ``faults``."""
    rates = dict(faults)
    if fault_rate:
        for kind in ("429", "503"):
            rates[kind] = rates.get(kind, 0.0) + fault_rate / 2
    return rates


def _parse_request(raw: bytes, dialect: Dialect) -> tuple[ChatRequest, list[Any]] | web.Response:
    """What the fake needs from a request, with its messages as sent, or the
    400 a real provider would send."""
    try:
        body = json.loads(raw)
        if dialect == "anthropic":
            return _read_messages(body), body["messages"]
        if dialect == "responses":
            return replace(_read_responses(body), tier=_tier(body)), body["input"]
        messages = [(m["role"], _text(m.get("content"))) for m in body["messages"]]
        text = next(content for role, content in reversed(messages) if role == "user")
        schema = _response_schema(body.get("response_format"))
        tools = bool(body.get("tools"))
        first = next(content for role, content in messages if role == "user") if tools else ""
        answered = frozenset(
            str(m.get("tool_call_id")) for m in body["messages"] if m["role"] == "tool"
        )
        tool_results = sum(1 for m in body["messages"] if m["role"] == "tool")
        stream = body.get("stream") is True
    except (ValueError, KeyError, TypeError, AttributeError, StopIteration, IndexError):
        return _error(
            400, "expected a JSON body with a user message", "invalid_request_error", dialect
        )
    chars = sum(len(content) for _, content in messages)
    model = str(body.get("model", "oncely-fake"))
    chat = ChatRequest(
        model,
        text,
        chars,
        schema,
        _schema_key(schema),
        tools,
        first,
        answered,
        tool_results,
        stream,
        tier=_tier(body),
    )
    return chat, body["messages"]


def _tier(body: Mapping[str, Any]) -> str:
    """The ``service_tier`` a request asks for ("" for none)."""
    tier = body.get("service_tier")
    return tier if isinstance(tier, str) else ""


def _no_flex_capacity(dialect: Dialect) -> web.Response:
    """The flex tier out of capacity, as OpenAI says it."""
    return _error(
        429,
        "Resource unavailable: no flex capacity (scripted)",
        "resource_unavailable",
        dialect,
        retry_after=1,
    )


def _schema_key(schema: Mapping[str, Any] | None) -> str:
    # Interned: the answer caches of all prompts asked with one schema share one key.
    return "" if schema is None else sys.intern(json.dumps(schema, sort_keys=True))


def _read_messages(body: Any) -> ChatRequest:
    """A Messages API request (``oncely.fakes.messages``) as the fake reads a
    chat completion's; StopIteration without a user message."""
    read = messages_wire.read_request(body)
    texts = [(role, text) for role, text in read.roles if role == "user"]
    if not texts:
        raise ValueError("no user message")
    return ChatRequest(
        read.model,
        texts[-1][1],
        sum(len(text) for _, text in read.roles),
        read.schema,
        _schema_key(read.schema),
        read.tools,
        texts[0][1] if read.tools else "",
        read.answered,
        read.tool_results,
        read.stream,
        "anthropic",
        read.continued,
    )


def _read_responses(body: Any) -> ChatRequest:
    """A Responses API request (``oncely.fakes.responses``) as the fake
    reads a chat completion's."""
    read = responses_wire.read_request(body)
    texts = [text for role, text in read.roles if role == "user"]
    if not texts:
        raise ValueError("no user message")
    return ChatRequest(
        read.model,
        texts[-1],
        sum(len(text) for _, text in read.roles),
        read.schema,
        _schema_key(read.schema),
        read.tools,
        texts[0] if read.tools else "",
        read.answered,
        read.tool_results,
        read.stream,
        "responses",
        background=read.background,
        reasoning=read.reasoning,
    )


def _text(content: object) -> str:
    """Message content: a string, or a list of parts of which the text ones count
    (none for an assistant message that only calls tools)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and "text" in p)
    raise TypeError("message content must be a string or a list of parts")


def _response_schema(response_format: object) -> Mapping[str, Any] | None:
    """The schema a ``json_schema`` response format asks for; None for any other."""
    if not isinstance(response_format, dict) or response_format.get("type") != "json_schema":
        return None
    schema = response_format["json_schema"]["schema"]
    if not isinstance(schema, dict):
        raise TypeError("json_schema.schema must be an object")
    return schema


def _completion_tokens(content: str) -> int:
    return len(content) // CHARS_PER_TOKEN + 1


def _tool_completion(
    chat: ChatRequest, calls: list[dict[str, Any]], number: int
) -> dict[str, object]:
    completion_tokens = sum(len(c["function"]["arguments"]) for c in calls) // 4 + 1
    return {
        "id": f"chatcmpl-fake-{number}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": chat.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": None, "tool_calls": calls},
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {
            "prompt_tokens": chat.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": chat.prompt_tokens + completion_tokens,
        },
    }


def _completion(
    chat: ChatRequest, content: str, number: int, *, refused: bool = False
) -> dict[str, object]:
    """A chat completion answering ``content`` (``refused``: declining to),
    at the tier it was asked at."""
    completion_tokens = _completion_tokens(content)
    said: dict[str, Any] = {"role": "assistant", "content": content}
    if refused:
        said = {"role": "assistant", "content": None, "refusal": _REFUSAL}
    return {
        "id": f"chatcmpl-fake-{number}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": chat.model,
        "service_tier": chat.tier or "default",
        "choices": [
            {
                "index": 0,
                "message": said,
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": chat.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": chat.prompt_tokens + completion_tokens,
        },
    }


def _rest(content: str, continued: str) -> str:
    """The answer after what a paused turn already said."""
    return content[len(continued) :] if continued and content.startswith(continued) else content


def _document(
    chat: ChatRequest, answer: dict[str, Any], prompt: Prompt, fault: str | None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The answer in the request's dialect, whole and as its stream's
    events. A ``pause`` (Anthropic's) stops the turn halfway. A prompt's
    cacheable tokens are written by its first answer, read by the others."""
    cached = min(prompt.cache_tokens, max(0, chat.prompt_tokens - 1))
    written = cached if prompt.billed <= 1 else 0
    if chat.dialect == "anthropic":
        document = messages_wire.message(
            answer, cache_write=written, cache_read=cached - written, pause=fault == "pause"
        )
        return document, messages_wire.events(document)
    if chat.dialect == "responses":
        thought = responses_wire.REASONING_TOKENS.get(chat.reasoning, 16) if chat.reasoning else 0
        response_id = str(answer["id"]).replace("chatcmpl-fake", "resp_fake")
        document = responses_wire.response(
            answer, response_id, cached=cached - written, reasoning=thought
        )
        return document, responses_wire.events(document)
    if cached - written:
        details = {"cached_tokens": cached - written}
        answer = {**answer, "usage": {**answer["usage"], "prompt_tokens_details": details}}
    return answer, _chunks(answer)


async def _respond(
    request: web.Request,
    chat: ChatRequest,
    answer: dict[str, Any],
    prompt: Prompt,
    fault: str | None,
) -> web.StreamResponse:
    """The answer (``_document``), whole or (``stream: true``) as
    server-sent events, a ``typing`` pause between them (a whole answer waits
    as long, once: the same generation, not streamed). A ``cut`` drops the
    connection halfway."""
    document, chunks = _document(chat, answer, prompt, fault)
    cut = fault == "cut"
    if not chat.stream:
        if prompt.typing_s:
            await asyncio.sleep(prompt.typing_s * (len(chunks) - 1))
        if not cut:
            return web.json_response(document)
        body = json.dumps(document).encode()
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.content_length = len(body)
        await response.prepare(request)
        await response.write(body[: len(body) // 2])
        return _drop(request, response)
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    if cut:
        chunks = chunks[: max(1, len(chunks) // 2)]
    # Chunks on a schedule from the first (not a pause after each): a busy
    # loop's lateness does not add up over an answer, so a streamed answer
    # takes as long as the whole one.
    loop = asyncio.get_running_loop()
    started = loop.time()
    for number, chunk in enumerate(chunks):
        if number and prompt.typing_s:
            await asyncio.sleep(max(0.0, started + number * prompt.typing_s - loop.time()))
        await response.write(_event(chat.dialect, chunk))
    if cut:
        return _drop(request, response)
    if chat.dialect == "chat":
        await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _fail(job: _Job, code: str, message: str) -> None:
    """A background response failed: its last event and document say so."""
    document = responses_wire.failed(job.id, job.chat.model, code, message)
    job.add({"type": "response.failed", "response": document})
    job.finish(document)


async def _follow(request: web.Request, job: _Job, after: int) -> web.StreamResponse:
    """A background response's events after number ``after``, as server-sent
    events while they come; the stream ends with the response (a cancelled
    one's without an ending event)."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    async for event in job.follow(after):
        await response.write(responses_wire.sse(event))
    await response.write_eof()
    return response


def _event(dialect: Dialect, chunk: dict[str, Any]) -> bytes:
    """One server-sent event: Anthropic's named, OpenAI's data alone."""
    if dialect == "anthropic":
        return messages_wire.sse(chunk)
    if dialect == "responses":
        return responses_wire.sse(chunk)
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def _drop(request: web.Request, response: web.StreamResponse) -> web.StreamResponse:
    """Close the connection under an unfinished answer, as a crashed
    provider or a proxy's timeout does."""
    if request.transport is not None:
        request.transport.abort()
    return response


# A stream's pieces of text: a word and the space after it.
_PIECE = re.compile(r"\S+\s*|\s+")


def _chunks(answer: dict[str, Any]) -> list[dict[str, Any]]:
    """A completion as a provider streams it: the role, the content a word
    at a time (or each tool call, then its arguments), the finish reason,
    then the usage alone."""
    choice = answer["choices"][0]
    message = choice["message"]
    head = {k: answer[k] for k in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk"

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    chunks = [chunk({"role": "assistant", "content": ""})]
    chunks += [chunk({"content": piece}) for piece in _PIECE.findall(message["content"] or "")]
    if message.get("refusal"):
        chunks.append(chunk({"refusal": message["refusal"]}))
    for index, call in enumerate(message.get("tool_calls") or ()):
        function = call["function"]
        opening = {"index": index, "id": call.get("id"), "type": "function"}
        opening["function"] = {"name": function["name"], "arguments": ""}
        arguments = {"index": index, "function": {"arguments": function["arguments"]}}
        chunks += [chunk({"tool_calls": [opening]}), chunk({"tool_calls": [arguments]})]
    chunks.append(chunk({}, choice["finish_reason"]))
    chunks.append({**head, "choices": [], "usage": answer["usage"]})
    return chunks


def _error(
    status: int, message: str, kind: str, dialect: Dialect, *, retry_after: int | None = None
) -> web.Response:
    """An error in the dialect's shape: OpenAI's ``error.code`` ``kind``, or
    Anthropic's ``{"type": "error", "error": {"type", "message"}}``."""
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    body: dict[str, Any] = {
        "error": {"message": message, "type": kind, "param": None, "code": kind}
    }
    if dialect == "anthropic":
        body = messages_wire.error_body(status, message)
    return web.json_response(body, status=status, headers=headers)


async def _answer_429(request: web.Request, dialect: Dialect) -> web.StreamResponse:
    return _error(
        429, "Rate limit reached (scripted)", "rate_limit_exceeded", dialect, retry_after=1
    )


async def _answer_503(request: web.Request, dialect: Dialect) -> web.StreamResponse:
    return _error(503, "The server is overloaded (scripted)", "server_error", dialect)


async def _answer_529(request: web.Request, dialect: Dialect) -> web.StreamResponse:
    return _error(529, "Overloaded (scripted)", "overloaded_error", dialect)


async def _answer_400(request: web.Request, dialect: Dialect) -> web.StreamResponse:
    return _error(400, "Invalid request (scripted)", "invalid_request_error", dialect)


async def _answer_credit(request: web.Request, dialect: Dialect) -> web.StreamResponse:
    """A dry account, as each provider says it: Anthropic a 400 about the
    credit balance, OpenAI a 429 ``insufficient_quota``."""
    if dialect == "anthropic":
        return _error(400, _NO_CREDIT, "invalid_request_error", dialect)
    return _error(429, _NO_QUOTA, "insufficient_quota", dialect)


async def _hang(request: web.Request, dialect: Dialect) -> web.StreamResponse:
    # Never set: the runner cancels this handler when the client goes away.
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def _drip(request: web.Request, dialect: Dialect) -> web.StreamResponse:
    """Headers at once, then a byte a second: defeats per-read timeouts."""
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    await response.prepare(request)
    try:
        while True:
            await response.write(b" ")
            await asyncio.sleep(1.0)
    except ConnectionResetError:
        return response


_FAULTS: dict[HttpFault, Callable[[web.Request, Dialect], Awaitable[web.StreamResponse]]] = {
    "429": _answer_429,
    "503": _answer_503,
    "529": _answer_529,
    "400": _answer_400,
    "credit": _answer_credit,
    "hang": _hang,
    "drip": _drip,
}

FAKE_MODEL = web.AppKey("fake_model", FakeModel)


def make_app(
    *,
    rpm: int = 0,
    tpm: int = 0,
    fault_rate: float = 0.0,
    seed: int = 0,
    faults: Mapping[str, float] | None = None,
    slow_s: float = DEFAULT_SLOW_S,
    batch_delay_s: float = DEFAULT_BATCH_DELAY_S,
) -> web.Application:
    """The fake's aiohttp app; its ``FakeModel`` is at ``app[FAKE_MODEL]``,
    its batch APIs' state at ``app[FAKE_BATCHES]`` (``oncely.fakes.batches``)."""
    model = FakeModel(
        rpm=rpm, tpm=tpm, fault_rate=fault_rate, seed=seed, faults=faults, slow_s=slow_s
    )
    app = web.Application(client_max_size=MAX_BATCH_FILE_BYTES)
    app[FAKE_MODEL] = model
    mount_batches(app, model, batch_delay_s)
    app.router.add_post("/v1/chat/completions", model.chat_completions)
    app.router.add_post("/v1/messages", model.messages)
    app.router.add_post("/v1/responses", model.responses)
    app.router.add_get("/v1/responses/{id}", model.retrieve_response)
    app.router.add_post("/v1/responses/{id}/cancel", model.cancel_response)
    app.router.add_get("/_calls", model.calls)
    app.router.add_post("/_reset", model.reset_route)
    app.router.add_post("/_outage", model.start_outage)
    app.router.add_delete("/_outage", model.end_outage)
    return app


async def _start(app: web.Application, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(
        app,
        access_log=None,
        handler_cancellation=True,
        shutdown_timeout=_SHUTDOWN_TIMEOUT_S,
    )
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


async def serve_fake_llm(
    host: str,
    port: int,
    *,
    rpm: int = 0,
    tpm: int = 0,
    fault_rate: float = 0.0,
    seed: int = 0,
    faults: Mapping[str, float] | None = None,
    slow_s: float = DEFAULT_SLOW_S,
    batch_delay_s: float = DEFAULT_BATCH_DELAY_S,
) -> None:
    """Serve the fake model until cancelled."""
    app = make_app(
        rpm=rpm,
        tpm=tpm,
        fault_rate=fault_rate,
        seed=seed,
        faults=faults,
        slow_s=slow_s,
        batch_delay_s=batch_delay_s,
    )
    runner = await _start(app, host, port)
    log.info(
        "fake_llm.started",
        url=f"http://{host}:{port}/v1",
        rpm=rpm,
        tpm=tpm,
        faults=app[FAKE_MODEL].random.describe(),
        seed=seed,
    )
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


class FakeLLMServer:
    """The fake on a free port of 127.0.0.1, for tests: ``async with FakeLLMServer() as s``.

    ``url`` is the OpenAI base url (ends in ``/v1``); ``root_url`` serves
    ``/_calls`` and ``/_reset``.
    """

    def __init__(
        self,
        *,
        rpm: int = 0,
        tpm: int = 0,
        fault_rate: float = 0.0,
        seed: int = 0,
        faults: Mapping[str, float] | None = None,
        slow_s: float = DEFAULT_SLOW_S,
        batch_delay_s: float = DEFAULT_BATCH_DELAY_S,
    ) -> None:
        self._app = make_app(
            rpm=rpm,
            tpm=tpm,
            fault_rate=fault_rate,
            seed=seed,
            faults=faults,
            slow_s=slow_s,
            batch_delay_s=batch_delay_s,
        )
        self._runner: web.AppRunner | None = None
        self.root_url = ""

    @property
    def url(self) -> str:
        return f"{self.root_url}/v1"

    @property
    def model(self) -> FakeModel:
        return self._app[FAKE_MODEL]

    @property
    def batches(self) -> FakeBatches:
        return self._app[FAKE_BATCHES]

    def stats(self, contains: str | None = None) -> CallStats:
        return self.model.stats(contains)

    async def __aenter__(self) -> FakeLLMServer:
        self._runner = await _start(self._app, "127.0.0.1", 0)
        host, port = self._runner.addresses[0][:2]
        self.root_url = f"http://{host}:{port}"
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
