"""Effects: what a workflow may cause outside the system, declared by topic.

A workflow declares each topic it may emit and how that topic is delivered:

- ``email(topic, render)``: ``render`` turns the outbox row's payload into an
  ``Email`` (to, subject, text); the configured email sender delivers it and
  knows nothing about the topic.
- ``webhook(topic, render=None, url=None)``: a signed POST (Standard Webhooks)
  whose body is ``{"type": topic, "timestamp", "data": render(payload)}``
  (the payload itself when there is no ``render``).

Renderers must be deterministic: a resend after a crash must be the same
message, and the provider dedupes it on the row's dedupe key.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


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


@dataclass(frozen=True)
class WebhookEffect:
    topic: str
    render: Callable[[Payload], Mapping[str, Any]] | None = None
    # None: the workflow's configured webhook URL (docs/settings.md).
    url: str | None = None

    def event(self, payload: Payload) -> Event:
        return Event(self.topic, self.render(payload) if self.render else payload)


Effect = EmailEffect | WebhookEffect


def email(topic: str, render: Callable[[Payload], Email]) -> EmailEffect:
    """Declare an email topic and the renderer that makes its message."""
    return EmailEffect(topic, render)


def webhook(
    topic: str,
    *,
    render: Callable[[Payload], Mapping[str, Any]] | None = None,
    url: str | None = None,
) -> WebhookEffect:
    """Declare a webhook topic (signed per Standard Webhooks)."""
    return WebhookEffect(topic, render, url)
