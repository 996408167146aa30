"""Effects: what a workflow may cause outside the system, declared by topic.

A workflow declares each topic it may emit and how that topic is delivered:

- ``email(topic, render)``: ``render`` turns the outbox row's payload into an
  ``Email`` (to, subject, text); the configured email sender delivers it and
  knows nothing about the topic.
- ``webhook(topic, render=None, url=None)``: a signed POST (Standard Webhooks)
  whose body is ``{"type": topic, "timestamp", "data": render(payload)}``
  (the payload itself when there is no ``render``).
- ``webhook(topic, returns=Model)`` (or ``returns=True`` for any JSON): a
  *call that answers* (``ctx.call``, docs/agents.md): the receiver's 2xx
  answer, validated, is the step's value.

Renderers must be deterministic: a resend after a crash must be the same
message, and the provider dedupes it on the row's dedupe key.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from oncely.errors import CallFailed


@dataclass(frozen=True)
class Email:
    to: str
    subject: str
    text: str


@dataclass(frozen=True)
class Event:
    """A webhook's content: ``type`` is the topic, ``data`` what the receiver reads."""

    type: str
    data: Mapping[str, Any]


Payload = Mapping[str, Any]


@dataclass(frozen=True)
class EmailEffect:
    topic: str
    render: Callable[[Payload], Email]


# How many characters of a receiver's invalid answer an error names.
_ANSWER_ERROR_CHARS = 300


@dataclass(frozen=True)
class WebhookEffect:
    topic: str
    render: Callable[[Payload], Mapping[str, Any]] | None = None
    # None: the workflow's configured webhook URL (docs/settings.md).
    url: str | None = None
    # A call that answers: the model its answer must validate as (True: any
    # JSON); None for a plain webhook.
    returns: type[BaseModel] | bool | None = None

    @property
    def answers(self) -> bool:
        return self.returns is not None and self.returns is not False

    def event(self, payload: Payload) -> Event:
        return Event(self.topic, self.render(payload) if self.render else payload)

    def answer(self, body: bytes) -> Any:
        """The receiver's 2xx answer as JSON valid for ``returns`` and
        storable; a ``CallFailed`` (``invalid_answer``) if it is not. Its
        message names the answer's size, never its text."""
        try:
            value = json.loads(body, parse_constant=_no_constant)
        except (ValueError, RecursionError):  # RecursionError: nested too deep
            raise CallFailed(
                f"{self.topic}: the receiver's answer ({len(body)} bytes) is not JSON",
                reason="invalid_answer",
            ) from None
        if not storable(value):
            raise CallFailed(
                f"{self.topic}: the receiver's answer ({len(body)} bytes) cannot be stored"
                " (a NUL or a lone surrogate in a string, or a number out of range)",
                reason="invalid_answer",
            )
        if isinstance(self.returns, type) and issubclass(self.returns, BaseModel):
            try:
                return self.returns.model_validate(value).model_dump(mode="json")
            except ValidationError as exc:
                detail = str(exc.errors(include_url=False, include_input=False))
                raise CallFailed(
                    f"{self.topic}: the answer is not a valid {self.returns.__name__}:"
                    f" {detail[:_ANSWER_ERROR_CHARS]}",
                    reason="invalid_answer",
                ) from None
        return value


# What PostgreSQL's jsonb refuses in a string: NUL, and a surrogate not in a
# pair (json.loads joins a pair into one character, so any left is lone).
_UNSTORABLE_TEXT = re.compile("[\x00\ud800-\udfff]")


def storable(value: Any) -> bool:
    """Whether jsonb stores ``value`` (parsed JSON) as it is: no string, key
    or value, that it refuses, and no number beyond a float's range. Walked
    without recursion: an answer may be nested as deep as JSON allows."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            if _UNSTORABLE_TEXT.search(item):
                return False
        elif isinstance(item, dict):
            pending.extend(item)
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
        elif isinstance(item, float) and not math.isfinite(item):
            return False
    return True


def _no_constant(name: str) -> Any:
    # NaN and Infinity are no JSON, though Python's parser takes them.
    raise ValueError(f"{name} is not JSON")


Effect = EmailEffect | WebhookEffect


def email(topic: str, render: Callable[[Payload], Email]) -> EmailEffect:
    """Declare an email topic and the renderer that makes its message."""
    return EmailEffect(topic, render)


def webhook(
    topic: str,
    *,
    render: Callable[[Payload], Mapping[str, Any]] | None = None,
    url: str | None = None,
    returns: type[BaseModel] | bool | None = None,
) -> WebhookEffect:
    """Declare a webhook topic (signed per Standard Webhooks). With
    ``returns`` (a pydantic model, or True for any JSON) it is a call that
    answers: ``await ctx.call(topic, payload)`` sends it once and gives back
    the receiver's answer, validated (docs/agents.md)."""
    if returns is not None and not (
        returns is True or (isinstance(returns, type) and issubclass(returns, BaseModel))
    ):
        raise ValueError(f"webhook {topic!r}: returns must be a pydantic model or True")
    return WebhookEffect(topic, render, url, returns)
