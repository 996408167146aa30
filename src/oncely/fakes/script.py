"""What the fake model reads in a prompt (docs/fakes.md): the
``[[fake:…]]`` directives that script a prompt's faults, tool calls and
pace, parsed once per distinct prompt (``Prompt``), the request as the
fake reads it in any dialect (``ChatRequest``), and the answer it gives:
an extractive summary of the subject, or the schema's one instance
(``oncely.fakes.schema``). No I/O: the server (``oncely.fakes.llm``)
counts, serves and fails calls by what this says.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from oncely.fakes.schema import SchemaFiller

HttpFault = Literal["429", "503", "529", "400", "credit", "hang", "drip"]
FaultKind = HttpFault | Literal["badjson", "cut", "refusal", "pause"]
Dialect = Literal["chat", "responses", "anthropic"]

# The directives a prompt scripts its calls with (docs/fakes.md).
_DIRECTIVE = re.compile(
    r"\[\[fake:(?:(?P<fault>429|503|529|400|credit|hang|drip|badjson|cut|refusal|pause)"
    r"(?:\*(?P<times>\d+))?"
    r"|sleep=(?P<sleep>\d+(?:\.\d+)?)|typing=(?P<typing>\d+(?:\.\d+)?)"
    r"|late=(?P<late>\d+(?:\.\d+)?)|cache=(?P<cache>\d+))\]\]"
)
# Every directive, to take out of an answer (tool calls' JSON included).
ANY_DIRECTIVE = re.compile(r"\[\[fake:.*?\]\]")
_TOOL = re.compile(r"\[\[fake:tool=(?P<name>[A-Za-z0-9_-]+)(?:\s+(?P<args>\{.*?\}))?\]\]")
_BUSY = re.compile(r"\[\[fake:busy(?:\*(?P<times>\d+))?\]\]")
_PARALLEL = "[[fake:tools=parallel]]"
_BAD_ARGS = "[[fake:badargs]]"
# Ids as careless providers send them: one for every call, or none at all.
REPEATED_IDS = "[[fake:tool_ids=repeat]]"
NO_IDS = "[[fake:tool_ids=none]]"

# The answer: the subject's first sentences, a token per four characters.
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_SUMMARY_SENTENCES = 2
_SUMMARY_MAX_CHARS = 280
_EXCERPT_CHARS = 80
CHARS_PER_TOKEN = 4


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    times: int | None  # None: every call from here on


@dataclass(frozen=True)
class ChatRequest:
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
    # How many ``tool`` messages the conversation holds.
    tool_results: int = 0
    # Asked for server-sent chunks (``stream: true``).
    stream: bool = False
    # The API it came by, and (Anthropic's) the text of the assistant
    # message it ends with: a paused turn, continued.
    dialect: Dialect = "chat"
    continued: str = ""
    # The Responses API's: background mode asked for, the reasoning effort.
    background: bool = False
    reasoning: str = ""
    # The tier asked for (``service_tier``; "" for none).
    tier: str = ""

    @property
    def prompt_tokens(self) -> int:
        return self.chars // CHARS_PER_TOKEN + 1

    @property
    def second_choice(self) -> bool:
        """The "v2" model answers differently, for shadow comparisons."""
        return "v2" in self.model.lower()


@dataclass
class Prompt:
    """One distinct prompt: its script and answers, worked out once, and how often
    it was called."""

    sha256: str
    text: str
    script: tuple[Fault, ...]
    sleep_s: float
    # Between a stream's chunks.
    typing_s: float = 0.0
    # Between a background response created and the create's answer.
    late_s: float = 0.0
    # Prompt tokens it declares cacheable: the first call writes them to the
    # cache, later ones read them.
    cache_tokens: int = 0
    count: int = 0
    billed: int = 0
    billed_ports: list[int] = field(default_factory=list)
    faults: dict[str, int] = field(default_factory=dict)
    fault_ports: dict[str, list[int]] = field(default_factory=dict)
    abandoned: int = 0
    # ``[[fake:busy*N]]``: its first N flex calls (None: every one; 0: none)
    # find no capacity; the flex calls so far.
    busy: int | None = 0
    flex_calls: int = 0
    _answers: dict[tuple[bool, str], str] = field(default_factory=dict, repr=False)

    @classmethod
    def parse(cls, sha256: str, text: str) -> Prompt:
        script: list[Fault] = []
        sleep_s = typing_s = late_s = 0.0
        cache = 0
        for match in _DIRECTIVE.finditer(text):
            if match["sleep"] is not None:
                sleep_s = float(match["sleep"])
            elif match["typing"] is not None:
                typing_s = float(match["typing"])
            elif match["late"] is not None:
                late_s = float(match["late"])
            elif match["cache"] is not None:
                cache = int(match["cache"])
            else:
                times = int(match["times"]) if match["times"] is not None else None
                script.append(Fault(cast(FaultKind, match["fault"]), times))
        prompt = cls(sha256, text, tuple(script), sleep_s, typing_s, late_s, cache)
        busy = _BUSY.search(text)
        if busy is not None:
            prompt.busy = int(busy["times"]) if busy["times"] is not None else None
        return prompt

    def no_capacity(self) -> bool:
        """A flex call of this prompt finds no capacity (``[[fake:busy]]``)."""
        self.flex_calls += 1
        return self.busy is None or self.flex_calls <= self.busy

    def answer(self, request: ChatRequest) -> str:
        """The content for this prompt, once per model variant and schema."""
        key = (request.second_choice, request.schema_key)
        content = self._answers.get(key)
        if content is None:
            content = answer_for(self.text, request.schema, second_choice=request.second_choice)
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


def subject(text: str) -> str:
    """The text to summarise: inside ``<text>…</text>`` when the prompt fences it
    (``build_summary_prompt`` does), else the whole message."""
    start, end = text.find("<text>"), text.rfind("</text>")
    return text[start + len("<text>") : end] if 0 <= start < end else text


def summarise(text: str, sentences: int = _SUMMARY_SENTENCES) -> str:
    """Extractive: the first sentences of the subject, directives removed."""
    words = " ".join(ANY_DIRECTIVE.sub(" ", subject(text)).split())
    summary = " ".join(_SENTENCE_END.split(words)[:sentences])
    if len(summary) > _SUMMARY_MAX_CHARS:
        summary = summary[: _SUMMARY_MAX_CHARS - 1].rstrip() + "…"
    return summary or "Nothing to summarise."


def excerpt(text: str) -> str:
    return " ".join(subject(text).split())[:_EXCERPT_CHARS]


def answer_for(text: str, schema: Mapping[str, Any] | None, *, second_choice: bool) -> str:
    summary = summarise(text, 1 if second_choice else _SUMMARY_SENTENCES)
    if schema is None:
        return summary
    instance = SchemaFiller(schema, text.lower(), summary, second_choice).fill(schema)
    return json.dumps(instance, ensure_ascii=False)


def tool_script(text: str) -> tuple[list[dict[str, Any]], bool, bool]:
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
