"""The fake model: an OpenAI-compatible chat endpoint whose faults are scripted
by the prompt itself (docs/fakes.md).

It answers an extractive summary of the last user message (its first two
sentences; for a model whose name contains ``v2``, the first sentence only).
A request with ``response_format: {"type": "json_schema", ...}`` gets instead
the one JSON instance of that schema the fake derives from the same message:
an enum takes the first of its values, in declared order, that the message
mentions (case-insensitive; ``v2`` takes the second one mentioned), else its
first value; strings are the summary fitted to ``minLength``/``maxLength``;
numbers the least their lower bound allows (0 without one); booleans false;
objects every property; arrays ``minItems`` items; ``$ref``, ``anyOf``,
``oneOf``, ``allOf`` and ``const`` are followed. ``usage`` estimates four
characters a token over all messages.

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
that is not JSON. ``GET /_calls?messages=1`` adds ``requests``: the
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
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from types import TracebackType
from typing import Any, Literal, cast

import structlog
from aiohttp import web

from oncely.fakes.faults import RandomFaults

log = structlog.get_logger(__name__)

HttpFault = Literal["429", "503", "400", "hang", "drip"]
FaultKind = HttpFault | Literal["badjson", "cut"]
# What ``--faults`` may name, in the order rates are drawn.
RANDOM_FAULTS = ("429", "503", "hang", "drip", "slow", "badjson")
RandomFault = FaultKind | Literal["slow"]

_DIRECTIVE = re.compile(
    r"\[\[fake:(?:(?P<fault>429|503|400|hang|drip|badjson|cut)(?:\*(?P<times>\d+))?"
    r"|sleep=(?P<sleep>\d+(?:\.\d+)?)|typing=(?P<typing>\d+(?:\.\d+)?))\]\]"
)
# Every directive, to take out of an answer (tool calls' JSON included).
_ANY_DIRECTIVE = re.compile(r"\[\[fake:.*?\]\]")
_TOOL = re.compile(r"\[\[fake:tool=(?P<name>[A-Za-z0-9_-]+)(?:\s+(?P<args>\{.*?\}))?\]\]")
_PARALLEL = "[[fake:tools=parallel]]"
_BAD_ARGS = "[[fake:badargs]]"
# How many requests' messages ``/_calls?messages=1`` keeps.
_RECENT = 100
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_SUMMARY_SENTENCES = 2
_SUMMARY_MAX_CHARS = 280
_EXCERPT_CHARS = 80
_CHARS_PER_TOKEN = 4
# What ``[[fake:badjson]]`` answers: invalid for any schema, and not JSON at all.
_BAD_JSON = '{"oops": '
_NOT_JSON = "not json"
# Values for string formats pydantic emits, where the summary would not validate.
_STRING_FORMATS = {
    "date-time": "1970-01-01T00:00:00Z",
    "date": "1970-01-01",
    "time": "00:00:00",
    "duration": "PT0S",
    "uuid": "00000000-0000-4000-8000-000000000000",
    "email": "fake@example.com",
    "uri": "https://example.com/",
}
_LIMIT_WINDOW_S = 60.0
# Fakes hold nothing worth waiting for; a hung call must not stall shutdown.
_SHUTDOWN_TIMEOUT_S = 0.1
# How long a random ``slow`` call takes to answer.
DEFAULT_SLOW_S = 2.0


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    times: int | None  # None: every call from here on


@dataclass(frozen=True)
class _ChatRequest:
    """What the fake reads from a chat completion request."""

    model: str
    text: str  # the last user message: what faults are counted and answers keyed on
    chars: int  # of all messages' text, for the token estimate
    schema: Mapping[str, Any] | None  # from a ``json_schema`` response format
    schema_key: str  # ``schema`` as canonical JSON; "" without one
    # With tools declared: the first user message (its tool directives) and
    # the tool calls already answered by a ``tool`` message.
    tools: bool = False
    first_user: str = ""
    answered: frozenset[str] = frozenset()
    # Asked for server-sent chunks (``stream: true``).
    stream: bool = False

    @property
    def prompt_tokens(self) -> int:
        return self.chars // _CHARS_PER_TOKEN + 1

    @property
    def second_choice(self) -> bool:
        """The "v2" model answers differently, for shadow comparisons."""
        return "v2" in self.model.lower()


@dataclass
class _Prompt:
    """One distinct prompt: its script and answers, worked out once, and how often
    it was called."""

    sha256: str
    text: str
    script: tuple[Fault, ...]
    sleep_s: float
    # Between a stream's chunks.
    typing_s: float = 0.0
    count: int = 0
    billed: int = 0
    billed_ports: list[int] = field(default_factory=list)
    faults: dict[str, int] = field(default_factory=dict)
    fault_ports: dict[str, list[int]] = field(default_factory=dict)
    abandoned: int = 0
    _answers: dict[tuple[bool, str], str] = field(default_factory=dict, repr=False)

    @classmethod
    def parse(cls, sha256: str, text: str) -> _Prompt:
        script: list[Fault] = []
        sleep_s = typing_s = 0.0
        for match in _DIRECTIVE.finditer(text):
            if match["sleep"] is not None:
                sleep_s = float(match["sleep"])
            elif match["typing"] is not None:
                typing_s = float(match["typing"])
            else:
                times = int(match["times"]) if match["times"] is not None else None
                script.append(Fault(cast(FaultKind, match["fault"]), times))
        return cls(sha256, text, tuple(script), sleep_s, typing_s)

    def answer(self, request: _ChatRequest) -> str:
        """The content for this prompt, once per model variant and schema."""
        key = (request.second_choice, request.schema_key)
        content = self._answers.get(key)
        if content is None:
            content = _answer(self.text, request.schema, second_choice=request.second_choice)
            self._answers[key] = content
        return content

    def fault_for(self, call: int) -> FaultKind | None:
        """The fault scripted for this prompt's ``call``-th call (1-based)."""
        scripted = 0
        for fault in self.script:
            if fault.times is None:
                return fault.kind
            scripted += fault.times
            if call <= scripted:
                return fault.kind
        return None


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
    rate_limited: int | None = None  # only when an rpm/tpm limit is on
    random_faults: dict[str, int] | None = None  # only when random faults are on

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
        self.tokens: dict[str, dict[str, int]] = {}
        self._prompts: dict[str, _Prompt] = {}
        self._tool_scripts: dict[str, tuple[list[dict[str, Any]], bool, bool]] = {}
        self.recent: deque[list[Any]] = deque(maxlen=_RECENT)
        self._limit = _RateLimit(*self._limits) if any(self._limits) else None

    def stats(self, contains: str | None = None) -> CallStats:
        prompts = [
            PromptCalls(
                p.sha256,
                p.count,
                _excerpt(p.text),
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
            rate_limited,
            random_faults,
        )

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        self.total += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        prompt: list[_Prompt] = []
        try:
            return await self._complete(request, prompt)
        except asyncio.CancelledError:
            # The client went away first (its call was cancelled or cut off).
            self.abandoned += 1
            for p in prompt:
                p.abandoned += 1
            raise
        finally:
            self.in_flight -= 1

    async def _complete(self, request: web.Request, called: list[_Prompt]) -> web.StreamResponse:
        parsed = _parse_request(await request.read())
        if isinstance(parsed, web.Response):
            return parsed
        chat, messages = parsed
        self.recent.append(messages)
        self.models[chat.model] = self.models.get(chat.model, 0) + 1
        refused = self._refuse_over_limit(chat.prompt_tokens)
        if refused is not None:
            return refused
        prompt = self._prompt(chat.text)
        called.append(prompt)
        prompt.count += 1
        call = prompt.count  # read before sleeping: concurrent calls each get their number
        if prompt.sleep_s:
            await asyncio.sleep(prompt.sleep_s)
        fault = (
            self.outage
            or self.model_outages.get(chat.model)
            or prompt.fault_for(call)
            or self._random_fault(prompt.sha256, call)
        )
        port = _client_port(request)
        if fault is not None:
            prompt.faults[fault] = prompt.faults.get(fault, 0) + 1
            prompt.fault_ports.setdefault(fault, []).append(port)
        if fault == "badjson":
            content = _BAD_JSON if chat.schema is not None else _NOT_JSON
        elif fault is not None and fault not in ("slow", "cut"):
            return await _FAULTS[cast(HttpFault, fault)](request)
        else:
            calls = self._tool_calls(chat)
            if calls:
                prompt.billed += 1
                prompt.billed_ports.append(port)
                answer = _tool_completion(chat, calls, self.total)
                return await _respond(request, chat, answer, prompt, cut=fault == "cut")
            try:
                content = prompt.answer(chat)
            except _InvalidSchema as exc:
                return _error(400, f"invalid json_schema: {exc}", "invalid_request_error")
            # Billed once generating starts, as a provider does, even if the
            # client goes away before a slow answer is done.
            prompt.billed += 1
            prompt.billed_ports.append(port)
            if fault == "slow":
                await asyncio.sleep(self.slow_s)
        answer = _completion(chat, content, self.total)
        used = self.tokens.setdefault(chat.model, {"prompt": 0, "completion": 0})
        used["prompt"] += chat.prompt_tokens
        used["completion"] += _completion_tokens(content)
        return await _respond(request, chat, answer, prompt, cut=fault == "cut")

    def _refuse_over_limit(self, tokens: int) -> web.Response | None:
        if self._limit is None:
            return None
        wait_s = self._limit.admit(tokens, time.monotonic())
        if wait_s is None:
            return None
        self.rate_limited += 1
        retry_after = max(1, math.ceil(wait_s))
        return _error(429, "Rate limit reached", "rate_limit_exceeded", retry_after=retry_after)

    def _prompt(self, text: str) -> _Prompt:
        sha = hashlib.sha256(text.encode()).hexdigest()
        prompt = self._prompts.get(sha)
        if prompt is None:
            prompt = self._prompts[sha] = _Prompt.parse(sha, text)
        return prompt

    def _tool_calls(self, chat: _ChatRequest) -> list[dict[str, Any]]:
        """The tool calls this turn answers (none: the final answer)."""
        if not chat.tools or "[[fake:tool" not in chat.first_user:
            return []
        script = self._tool_scripts.get(chat.first_user)
        if script is None:
            script = self._tool_scripts[chat.first_user] = _tool_script(chat.first_user)
        calls, parallel, bad_args = script
        pending = [c for c in calls if c["id"] not in chat.answered]
        if not pending:
            return []
        turn = pending if parallel else pending[:1]
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
            return _error(400, f"fault must be one of {sorted(_FAULTS)}", "invalid_request_error")
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


def _parse_request(raw: bytes) -> tuple[_ChatRequest, list[Any]] | web.Response:
    """What the fake needs from a request, with its messages as sent, or the
    400 a real provider would send."""
    try:
        body = json.loads(raw)
        messages = [(m["role"], _text(m.get("content"))) for m in body["messages"]]
        text = next(content for role, content in reversed(messages) if role == "user")
        schema = _response_schema(body.get("response_format"))
        tools = bool(body.get("tools"))
        first = next(content for role, content in messages if role == "user") if tools else ""
        answered = frozenset(
            str(m.get("tool_call_id")) for m in body["messages"] if m["role"] == "tool"
        )
        stream = body.get("stream") is True
    except (ValueError, KeyError, TypeError, AttributeError, StopIteration):
        return _error(400, "expected a JSON body with a user message", "invalid_request_error")
    chars = sum(len(content) for _, content in messages)
    # Interned: the answer caches of all prompts asked with one schema share one key.
    schema_key = "" if schema is None else sys.intern(json.dumps(schema, sort_keys=True))
    model = str(body.get("model", "oncely-fake"))
    chat = _ChatRequest(model, text, chars, schema, schema_key, tools, first, answered, stream)
    return chat, body["messages"]


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


def _subject(text: str) -> str:
    """The text to summarise: inside ``<text>…</text>`` when the prompt fences it
    (``build_summary_prompt`` does), else the whole message."""
    start, end = text.find("<text>"), text.rfind("</text>")
    return text[start + len("<text>") : end] if 0 <= start < end else text


def summarise(text: str, sentences: int = _SUMMARY_SENTENCES) -> str:
    """Extractive: the first sentences of the subject, directives removed."""
    words = " ".join(_ANY_DIRECTIVE.sub(" ", _subject(text)).split())
    summary = " ".join(_SENTENCE_END.split(words)[:sentences])
    if len(summary) > _SUMMARY_MAX_CHARS:
        summary = summary[: _SUMMARY_MAX_CHARS - 1].rstrip() + "…"
    return summary or "Nothing to summarise."


def _excerpt(text: str) -> str:
    return " ".join(_subject(text).split())[:_EXCERPT_CHARS]


def _answer(text: str, schema: Mapping[str, Any] | None, *, second_choice: bool) -> str:
    summary = summarise(text, 1 if second_choice else _SUMMARY_SENTENCES)
    if schema is None:
        return summary
    instance = _SchemaFiller(schema, text.lower(), summary, second_choice).fill(schema)
    return json.dumps(instance, ensure_ascii=False)


class _InvalidSchema(ValueError):
    """A response schema the fake cannot build an instance of (a real provider
    refuses such a request with a 400 too)."""


_Schema = Mapping[str, Any]
_Expanding = frozenset[str]  # the ``$ref``s being filled on the current path


@dataclass(frozen=True)
class _SchemaFiller:
    """Builds the one instance of a JSON schema the fake answers for a prompt."""

    root: _Schema
    lowered: str  # the last user message, lower-cased, for enum choices
    summary: str
    second_choice: bool

    def fill(self, schema: _Schema, expanding: _Expanding = frozenset()) -> object:
        if "$ref" in schema:
            return self._fill_ref(schema["$ref"], expanding)
        if "const" in schema:
            return schema["const"]
        if "enum" in schema:
            return self._choose(schema["enum"])
        alternatives = schema.get("anyOf") or schema.get("oneOf")
        if alternatives:
            return self.fill(_pick(alternatives, expanding), expanding)
        if "allOf" in schema:
            return _merge([self.fill(part, expanding) for part in schema["allOf"]])
        return self._fill_typed(schema, expanding)

    def _fill_ref(self, ref: str, expanding: _Expanding) -> object:
        if ref in expanding:
            return None  # a model that must contain itself has no finite instance
        return self.fill(_resolve(self.root, ref), expanding | {ref})

    def _choose(self, values: Sequence[object]) -> object:
        """The first value the prompt mentions (v2: the second), else the first value."""
        if not values:
            raise _InvalidSchema("an enum without values")
        mentioned = [v for v in values if isinstance(v, str) and v.lower() in self.lowered]
        if not mentioned:
            return values[0]
        return mentioned[1] if self.second_choice and len(mentioned) > 1 else mentioned[0]

    def _fill_typed(self, schema: _Schema, expanding: _Expanding) -> object:
        kind = _type_of(schema)
        if kind == "object":
            properties = schema.get("properties", {})
            return {name: self.fill(prop, expanding) for name, prop in properties.items()}
        if kind == "array":
            return self._fill_array(schema, expanding)
        if kind in ("string", "any"):
            fixed = _STRING_FORMATS.get(schema.get("format", ""))
            return fixed or _fit(self.summary, schema.get("minLength", 0), schema.get("maxLength"))
        if kind in ("integer", "number"):
            return _least_number(schema, integer=kind == "integer")
        if kind in ("boolean", "null"):
            return False if kind == "boolean" else None
        raise _InvalidSchema(f"unknown type {kind!r}")

    def _fill_array(self, schema: _Schema, expanding: _Expanding) -> list[object]:
        items = [self.fill(part, expanding) for part in schema.get("prefixItems", ())]
        missing = schema.get("minItems", 0) - len(items)
        if missing > 0:
            each = schema.get("items")
            items += [self.fill(each if isinstance(each, dict) else {}, expanding)] * missing
        return items


def _resolve(root: _Schema, ref: str) -> _Schema:
    """A local reference (``#/$defs/Name``, ``#/definitions/Name``) in ``root``."""
    if not ref.startswith("#"):
        raise _InvalidSchema(f"only local $ref is supported, not {ref!r}")
    target: Any = root
    for token in filter(None, ref[1:].split("/")):
        try:
            target = target[token.replace("~1", "/").replace("~0", "~")]
        except (KeyError, TypeError):
            raise _InvalidSchema(f"unresolvable $ref {ref!r}") from None
    if not isinstance(target, dict):
        raise _InvalidSchema(f"$ref {ref!r} is not a schema")
    return target


def _pick(alternatives: Sequence[_Schema], expanding: _Expanding) -> _Schema:
    """The first non-null alternative, unless it only recurses into a model being
    filled (``next: Node | None``), where null ends the recursion."""
    for alternative in alternatives:
        if alternative.get("type") != "null" and alternative.get("$ref") not in expanding:
            return alternative
    return next((a for a in alternatives if a.get("type") == "null"), alternatives[0])


def _merge(parts: list[object]) -> object:
    """``allOf``: the objects' properties together; otherwise the first part."""
    merged: dict[str, object] = {}
    for part in parts:
        if not isinstance(part, dict):
            return parts[0]
        merged.update(part)
    return merged


def _type_of(schema: _Schema) -> str:
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None:
        return "object" if "properties" in schema else "any"
    return str(kind)


def _fit(text: str, min_length: int, max_length: int | None) -> str:
    """``text`` repeated up to ``min_length``, cut at ``max_length``."""
    if len(text) < min_length:
        text = " ".join([text] * (min_length // (len(text) + 1) + 1))
    return text if max_length is None else text[:max_length]


def _least_number(schema: _Schema, *, integer: bool) -> float:
    """The minimum (0 without one), kept inside the upper bounds."""
    value: float = schema.get("minimum", 0)
    above = schema.get("exclusiveMinimum")
    if above is not None and ("minimum" not in schema or value <= above):
        value = math.floor(above) + 1 if integer else above + 1
    if "maximum" in schema and value > schema["maximum"]:
        value = schema["maximum"]
    below = schema.get("exclusiveMaximum")
    if below is not None and value >= below:
        lower = schema.get("minimum", above)
        if integer:
            value = math.ceil(below) - 1
        else:
            value = below - 1 if lower is None else (lower + below) / 2
    return math.ceil(value) if integer else value


def _completion_tokens(content: str) -> int:
    return len(content) // _CHARS_PER_TOKEN + 1


def _tool_script(text: str) -> tuple[list[dict[str, Any]], bool, bool]:
    """The tool calls ``[[fake:tool=…]]`` directives script, in order (ids
    ``call_<n>``), and whether they come at once and with bad arguments."""
    calls = []
    for number, match in enumerate(_TOOL.finditer(text), start=1):
        arguments = match["args"] or "{}"
        calls.append(
            {
                "id": f"call_{number}",
                "type": "function",
                "function": {"name": match["name"], "arguments": arguments},
            }
        )
    return calls, _PARALLEL in text, _BAD_ARGS in text


def _tool_completion(
    chat: _ChatRequest, calls: list[dict[str, Any]], number: int
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


def _completion(chat: _ChatRequest, content: str, number: int) -> dict[str, object]:
    completion_tokens = _completion_tokens(content)
    return {
        "id": f"chatcmpl-fake-{number}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": chat.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": chat.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": chat.prompt_tokens + completion_tokens,
        },
    }


async def _respond(
    request: web.Request,
    chat: _ChatRequest,
    answer: dict[str, Any],
    prompt: _Prompt,
    *,
    cut: bool,
) -> web.StreamResponse:
    """The answer, whole or (``stream: true``) as server-sent chunks, a
    ``typing`` pause between them (a whole answer waits as long, once: the
    same generation, not streamed). ``cut``: the connection drops halfway."""
    if not chat.stream:
        if prompt.typing_s:
            await asyncio.sleep(prompt.typing_s * (len(_chunks(answer)) - 1))
        if not cut:
            return web.json_response(answer)
        body = json.dumps(answer).encode()
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.content_length = len(body)
        await response.prepare(request)
        await response.write(body[: len(body) // 2])
        return _drop(request, response)
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    chunks = _chunks(answer)
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
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    if cut:
        return _drop(request, response)
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


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
    for index, call in enumerate(message.get("tool_calls") or ()):
        function = call["function"]
        opening = {"index": index, "id": call["id"], "type": "function"}
        opening["function"] = {"name": function["name"], "arguments": ""}
        arguments = {"index": index, "function": {"arguments": function["arguments"]}}
        chunks += [chunk({"tool_calls": [opening]}), chunk({"tool_calls": [arguments]})]
    chunks.append(chunk({}, choice["finish_reason"]))
    chunks.append({**head, "choices": [], "usage": answer["usage"]})
    return chunks


def _error(status: int, message: str, kind: str, *, retry_after: int | None = None) -> web.Response:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    body = {"error": {"message": message, "type": kind, "param": None, "code": kind}}
    return web.json_response(body, status=status, headers=headers)


async def _answer_429(request: web.Request) -> web.StreamResponse:
    return _error(429, "Rate limit reached (scripted)", "rate_limit_exceeded", retry_after=1)


async def _answer_503(request: web.Request) -> web.StreamResponse:
    return _error(503, "The server is overloaded (scripted)", "server_error")


async def _answer_400(request: web.Request) -> web.StreamResponse:
    return _error(400, "Invalid request (scripted)", "invalid_request_error")


async def _hang(request: web.Request) -> web.StreamResponse:
    # Never set: the runner cancels this handler when the client goes away.
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def _drip(request: web.Request) -> web.StreamResponse:
    """Headers at once, then a byte a second: defeats per-read timeouts."""
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    await response.prepare(request)
    try:
        while True:
            await response.write(b" ")
            await asyncio.sleep(1.0)
    except ConnectionResetError:
        return response


_FAULTS: dict[HttpFault, Callable[[web.Request], Awaitable[web.StreamResponse]]] = {
    "429": _answer_429,
    "503": _answer_503,
    "400": _answer_400,
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
) -> web.Application:
    """The fake's aiohttp app; its ``FakeModel`` is at ``app[FAKE_MODEL]``."""
    model = FakeModel(
        rpm=rpm, tpm=tpm, fault_rate=fault_rate, seed=seed, faults=faults, slow_s=slow_s
    )
    app = web.Application()
    app[FAKE_MODEL] = model
    app.router.add_post("/v1/chat/completions", model.chat_completions)
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
) -> None:
    """Serve the fake model until cancelled."""
    app = make_app(rpm=rpm, tpm=tpm, fault_rate=fault_rate, seed=seed, faults=faults, slow_s=slow_s)
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
    ) -> None:
        self._app = make_app(
            rpm=rpm, tpm=tpm, fault_rate=fault_rate, seed=seed, faults=faults, slow_s=slow_s
        )
        self._runner: web.AppRunner | None = None
        self.root_url = ""

    @property
    def url(self) -> str:
        return f"{self.root_url}/v1"

    @property
    def model(self) -> FakeModel:
        return self._app[FAKE_MODEL]

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
