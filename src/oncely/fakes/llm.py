"""The fake model: an OpenAI-compatible chat endpoint whose faults are scripted
by the prompt itself (DESIGN §6).

Directives in the last user message, counted per distinct prompt (sha256), so
a job's fate is written in its own text and survives redeliveries:

- ``[[fake:429*N]]``, ``[[fake:503*N]]``, ``[[fake:400*N]]``: the next N calls
  answer that status (429 with ``Retry-After: 1``).
- ``[[fake:hang*N]]``: never answers. ``[[fake:drip*N]]``: a 200 whose body
  comes one byte a second, forever.
- ``[[fake:sleep=S]]``: every call takes S seconds first.

Without ``*N`` a fault applies to every call. Faults run in the order written:
``[[fake:503*2]] [[fake:429*1]]`` answers 503, 503, 429, then a summary.

It must never be a benchmark's bottleneck: no middleware, no access log,
directives parsed once per distinct prompt, O(1) work per call otherwise.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from types import TracebackType
from typing import Literal, cast

import structlog
from aiohttp import web

log = structlog.get_logger(__name__)

FaultKind = Literal["429", "503", "400", "hang", "drip"]

_DIRECTIVE = re.compile(
    r"\[\[fake:(?:(?P<fault>429|503|400|hang|drip)(?:\*(?P<times>\d+))?"
    r"|sleep=(?P<sleep>\d+(?:\.\d+)?))\]\]"
)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_SUMMARY_SENTENCES = 2
_SUMMARY_MAX_CHARS = 280
_EXCERPT_CHARS = 80
_LIMIT_WINDOW_S = 60.0
# Fakes hold nothing worth waiting for; a hung call must not stall shutdown.
_SHUTDOWN_TIMEOUT_S = 0.1


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    times: int | None  # None: every call from here on


@dataclass
class _Prompt:
    """One distinct prompt: its script and summary, worked out once, and how often
    it was called."""

    sha256: str
    text: str
    script: tuple[Fault, ...]
    sleep_s: float
    summary: str
    count: int = 0

    @classmethod
    def parse(cls, sha256: str, text: str) -> _Prompt:
        script: list[Fault] = []
        sleep_s = 0.0
        for match in _DIRECTIVE.finditer(text):
            if match["sleep"] is not None:
                sleep_s = float(match["sleep"])
            else:
                times = int(match["times"]) if match["times"] is not None else None
                script.append(Fault(cast(FaultKind, match["fault"]), times))
        return cls(sha256, text, tuple(script), sleep_s, summarise(text))

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


@dataclass(frozen=True)
class CallStats:
    """What ``GET /_calls`` answers. ``count`` excludes calls refused by rpm/tpm."""

    total: int
    in_flight: int
    max_in_flight: int
    prompts: list[PromptCalls]
    rate_limited: int | None = None  # only when an rpm/tpm limit is on

    def to_json(self) -> dict[str, object]:
        body = asdict(self)
        if self.rate_limited is None:
            del body["rate_limited"]
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

    def __init__(self, *, rpm: int = 0, tpm: int = 0, fault_rate: float = 0.0, seed: int = 0):
        self._limits = (rpm, tpm)
        self._fault_rate = fault_rate
        self._seed = seed
        self.in_flight = 0
        self.reset()

    def reset(self) -> None:
        self.total = 0
        self.max_in_flight = self.in_flight
        self.rate_limited = 0
        self._prompts: dict[str, _Prompt] = {}
        self._rng = random.Random(self._seed)
        self._limit = _RateLimit(*self._limits) if any(self._limits) else None

    def stats(self, contains: str | None = None) -> CallStats:
        prompts = [
            PromptCalls(p.sha256, p.count, _excerpt(p.text))
            for p in self._prompts.values()
            if contains is None or contains in p.text
        ]
        rate_limited = self.rate_limited if self._limit is not None else None
        return CallStats(self.total, self.in_flight, self.max_in_flight, prompts, rate_limited)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        self.total += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._complete(request)
        finally:
            self.in_flight -= 1

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        parsed = _parse_request(await request.read())
        if isinstance(parsed, web.Response):
            return parsed
        model, text = parsed
        refused = self._refuse_over_limit(text)
        if refused is not None:
            return refused
        prompt = self._prompt(text)
        prompt.count += 1
        call = prompt.count  # read before sleeping: concurrent calls each get their number
        if prompt.sleep_s:
            await asyncio.sleep(prompt.sleep_s)
        fault = self._random_fault() or prompt.fault_for(call)
        if fault is not None:
            return await _FAULTS[fault](request)
        return web.json_response(_completion(model, prompt, self.total))

    def _refuse_over_limit(self, text: str) -> web.Response | None:
        if self._limit is None:
            return None
        wait_s = self._limit.admit(len(text) // 4 + 1, time.monotonic())
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

    def _random_fault(self) -> FaultKind | None:
        if self._fault_rate and self._rng.random() < self._fault_rate:
            return self._rng.choice(("503", "429"))
        return None

    async def calls(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats(request.query.get("contains")).to_json())

    async def reset_route(self, request: web.Request) -> web.Response:
        self.reset()
        return web.json_response({"reset": True})


def _parse_request(raw: bytes) -> tuple[str, str] | web.Response:
    """(model, last user message) or the 400 a real provider would send."""
    try:
        body = json.loads(raw)
        messages = body["messages"]
        text = next(_text(m["content"]) for m in reversed(messages) if m["role"] == "user")
    except (ValueError, KeyError, TypeError, StopIteration):
        return _error(400, "expected a JSON body with a user message", "invalid_request_error")
    return str(body.get("model", "oncely-fake")), text


def _text(content: object) -> str:
    """Message content: a string, or a list of parts of which the text ones count."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and "text" in p)
    raise TypeError("message content must be a string or a list of parts")


def _subject(text: str) -> str:
    """The text to summarise: inside ``<text>…</text>`` when the prompt fences it
    (``build_summary_prompt`` does), else the whole message."""
    start, end = text.find("<text>"), text.rfind("</text>")
    return text[start + len("<text>") : end] if 0 <= start < end else text


def summarise(text: str) -> str:
    """Extractive: the first sentences of the subject, directives removed."""
    words = " ".join(_DIRECTIVE.sub(" ", _subject(text)).split())
    summary = " ".join(_SENTENCE_END.split(words)[:_SUMMARY_SENTENCES])
    if len(summary) > _SUMMARY_MAX_CHARS:
        summary = summary[: _SUMMARY_MAX_CHARS - 1].rstrip() + "…"
    return summary or "Nothing to summarise."


def _excerpt(text: str) -> str:
    return " ".join(_subject(text).split())[:_EXCERPT_CHARS]


def _completion(model: str, prompt: _Prompt, number: int) -> dict[str, object]:
    summary = prompt.summary
    prompt_tokens, completion_tokens = len(prompt.text) // 4 + 1, len(summary) // 4 + 1
    return {
        "id": f"chatcmpl-fake-{number}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": summary},
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


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


_FAULTS: dict[FaultKind, Callable[[web.Request], Awaitable[web.StreamResponse]]] = {
    "429": _answer_429,
    "503": _answer_503,
    "400": _answer_400,
    "hang": _hang,
    "drip": _drip,
}

FAKE_MODEL = web.AppKey("fake_model", FakeModel)


def make_app(
    *, rpm: int = 0, tpm: int = 0, fault_rate: float = 0.0, seed: int = 0
) -> web.Application:
    """The fake's aiohttp app; its ``FakeModel`` is at ``app[FAKE_MODEL]``."""
    model = FakeModel(rpm=rpm, tpm=tpm, fault_rate=fault_rate, seed=seed)
    app = web.Application()
    app[FAKE_MODEL] = model
    app.router.add_post("/v1/chat/completions", model.chat_completions)
    app.router.add_get("/_calls", model.calls)
    app.router.add_post("/_reset", model.reset_route)
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
    host: str, port: int, *, rpm: int = 0, tpm: int = 0, fault_rate: float = 0.0, seed: int = 0
) -> None:
    """Serve the fake model until cancelled."""
    runner = await _start(make_app(rpm=rpm, tpm=tpm, fault_rate=fault_rate, seed=seed), host, port)
    log.info("fake_llm.started", url=f"http://{host}:{port}/v1", rpm=rpm, tpm=tpm)
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
        self, *, rpm: int = 0, tpm: int = 0, fault_rate: float = 0.0, seed: int = 0
    ) -> None:
        self._app = make_app(rpm=rpm, tpm=tpm, fault_rate=fault_rate, seed=seed)
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
