"""Senders: where outbox rows leave the system, each carrying its dedupe key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import assert_never
from urllib.parse import unquote, urlsplit

from oncely.senders.base import (
    SUMMARY_READY,
    Email,
    Sender,
    SendResult,
    SummaryReady,
    classify_status,
    render_email,
)
from oncely.senders.http import HttpEmailSender
from oncely.senders.smtp import SmtpSender
from oncely.senders.webhook import WebhookSender, verify_signature
from oncely.settings import Settings

__all__ = [
    "SUMMARY_READY",
    "Email",
    "HttpEmailSender",
    "SendResult",
    "Sender",
    "SmtpSender",
    "SmtpTarget",
    "SummaryReady",
    "WebhookSender",
    "build_sender",
    "classify_status",
    "parse_smtp_url",
    "render_email",
    "verify_signature",
]


def build_sender(settings: Settings) -> Sender:
    """The sender ``settings.sender`` names, pointed at ``settings.sender_url``."""
    match settings.sender:
        case "http":
            return HttpEmailSender(settings.sender_url, settings.sender_timeout_s)
        case "webhook":
            secret = settings.webhook_secret.get_secret_value()
            return WebhookSender(settings.sender_url, secret, settings.sender_timeout_s)
        case "smtp":
            return _smtp_sender(parse_smtp_url(settings.sender_url), settings)
        case _:
            assert_never(settings.sender)


@dataclass(frozen=True)
class SmtpTarget:
    host: str
    port: int
    use_tls: bool
    username: str | None = None
    password: str | None = None


def parse_smtp_url(url: str) -> SmtpTarget:
    """``smtp://[user:pass@]host[:port]`` (default 25) or ``smtps://…`` (TLS, default 465)."""
    parts = urlsplit(url)
    if parts.scheme not in ("smtp", "smtps") or not parts.hostname:
        raise ValueError(f"the smtp sender needs a smtp://host:port URL, got {url!r}")
    use_tls = parts.scheme == "smtps"
    return SmtpTarget(
        host=parts.hostname,
        port=parts.port or (465 if use_tls else 25),
        use_tls=use_tls,
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password else None,
    )


def _smtp_sender(target: SmtpTarget, settings: Settings) -> SmtpSender:
    return SmtpSender(
        target.host,
        target.port,
        settings.smtp_from,
        settings.sender_timeout_s,
        username=target.username,
        password=target.password,
        use_tls=target.use_tls,
    )
