"""Senders: where outbox rows leave the system, each carrying its dedupe key.

The relay hands every row to an ``EffectRouter`` (built by ``build_router``
from the effects workflows declare and a ``SendersConfig``), which renders it
by its topic and passes it to an ``EmailSender`` (HTTP API or SMTP) or an
``EventSender`` (Standard Webhooks). No sender knows any topic.
"""

from __future__ import annotations

from oncely.senders.base import (
    EmailSender,
    EventSender,
    Sender,
    SendResult,
    check_recipient,
    classify_status,
)
from oncely.senders.http import HttpEmailSender
from oncely.senders.routing import EffectRouter, SendersConfig, build_router
from oncely.senders.smtp import SmtpSender, SmtpTarget, parse_smtp_url
from oncely.senders.webhook import WebhookSender, sign, verify

__all__ = [
    "EffectRouter",
    "EmailSender",
    "EventSender",
    "HttpEmailSender",
    "SendResult",
    "Sender",
    "SendersConfig",
    "SmtpSender",
    "SmtpTarget",
    "WebhookSender",
    "build_router",
    "check_recipient",
    "classify_status",
    "parse_smtp_url",
    "sign",
    "verify",
]
