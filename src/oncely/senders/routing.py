"""Routing outbox rows to senders by the effect topics workflows declared.

The relay knows only ``send(topic, payload, dedupe_key)``. ``EffectRouter``
looks the topic up: an email topic is rendered by its workflow's renderer and
handed to the email sender; a webhook topic becomes an ``Event`` for the
sender of its URL. Senders never see a topic's meaning.

A row the router cannot route (an unknown topic, a webhook topic without a
URL or secret) or render (a renderer raising on its payload) fails
permanently: no retry can fix it, and an operator can
retry the failed row once the code or the configuration is fixed.

``build_router`` is what the composition root calls, with every registered
workflow's effects and a ``SendersConfig``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeVar

import structlog

from oncely.effects import Effect, Email, EmailEffect, Event, Payload, WebhookEffect
from oncely.errors import CallFailed, OncelyError, PermanentError
from oncely.senders.base import (
    AnswerTooLarge,
    EmailSender,
    EventSender,
    SendResult,
    check_recipient,
)
from oncely.senders.http import DEFAULT_MAX_ANSWER_BYTES, HttpEmailSender, JsonPoster
from oncely.senders.smtp import SmtpSender
from oncely.senders.webhook import WebhookSender

T = TypeVar("T")

log = structlog.get_logger("oncely.relay")


class EffectRouter:
    """The relay's sender: one declared effect per topic, each with its sender.

    ``event_senders`` maps each webhook topic to the sender of its URL; one
    ``email_sender`` delivers every email topic. ValueError if two effects
    share a topic or an effect has no sender.
    """

    def __init__(
        self,
        effects: Iterable[Effect],
        *,
        email_sender: EmailSender | None = None,
        event_senders: Mapping[str, EventSender] | None = None,
    ) -> None:
        events = event_senders or {}
        self._routes: dict[str, _EmailRoute | _EventRoute] = {}
        for effect in effects:
            if effect.topic in self._routes:
                raise ValueError(f"effect topic {effect.topic!r} is declared twice")
            self._routes[effect.topic] = _route(effect, email_sender, events)
        senders = [route.sender for route in self._routes.values()]
        self._senders = list({id(sender): sender for sender in senders}.values())

    async def send(self, topic: str, payload: Payload, dedupe_key: str) -> SendResult:
        """Render the row by its topic's effect and deliver it under ``dedupe_key``."""
        route = self._routes.get(topic)
        if route is None:
            raise PermanentError(f"no effect is declared for topic {topic!r}")
        return await route.deliver(payload, dedupe_key)

    async def aclose(self) -> None:
        """Close every distinct sender once."""
        for sender in self._senders:
            await sender.aclose()


@dataclass(frozen=True)
class _EmailRoute:
    effect: EmailEffect
    sender: EmailSender

    async def deliver(self, payload: Payload, dedupe_key: str) -> SendResult:
        email = _rendered(self.effect.topic, self.effect.render, payload)
        try:
            return await self.sender.send(email, dedupe_key)
        except AnswerTooLarge:
            return SendResult(provider_message_id=None)  # sent; its id is not read


@dataclass(frozen=True)
class _EventRoute:
    effect: WebhookEffect
    sender: EventSender

    async def deliver(self, payload: Payload, dedupe_key: str) -> SendResult:
        event = _rendered(self.effect.topic, self.effect.event, payload)
        try:
            sent = await self.sender.send(event, dedupe_key)
        except AnswerTooLarge as exc:
            if not self.effect.answers:
                return SendResult(provider_message_id=None)  # sent; its id is not read
            # The receiver acted, so a resend would only bring the same answer.
            raise CallFailed(f"{self.effect.topic}: {exc}", reason="invalid_answer") from None
        if not self.effect.answers:
            return sent
        # A call: its answer, validated, is what the job resumes with.
        return replace(sent, answer=self.effect.answer(sent.body))


def _route(
    effect: Effect, email_sender: EmailSender | None, event_senders: Mapping[str, EventSender]
) -> _EmailRoute | _EventRoute:
    if isinstance(effect, EmailEffect):
        if email_sender is None:
            raise ValueError(f"email topic {effect.topic!r} needs an email sender")
        return _EmailRoute(effect, email_sender)
    event_sender = event_senders.get(effect.topic)
    if event_sender is None:
        raise ValueError(f"webhook topic {effect.topic!r} needs an event sender")
    return _EventRoute(effect, event_sender)


def _rendered(topic: str, render: Callable[[Payload], T], payload: Payload) -> T:
    """What ``render`` makes of ``payload``; anything it raises is permanent.

    Renderers are pure, so a payload one cannot render never will be.
    """
    try:
        return render(payload)
    except OncelyError:
        raise
    except Exception as exc:
        raise PermanentError(f"cannot render {topic}: {type(exc).__name__}: {exc}") from exc


@dataclass(frozen=True)
class SendersConfig:
    """How effects leave the system; the composition root maps settings to it."""

    # How email effects go out: an HTTP email API, SMTP, or as webhooks (events
    # of type = topic, data = {to, subject, text}) for a receiver that mails.
    email: Literal["http", "webhook", "smtp"] = "http"
    # The HTTP email API, smtp[s]://[user:pass@]host[:port], or the webhook
    # URL when email == "webhook".
    email_url: str = "http://127.0.0.1:8102/v1/messages"
    # Bounds each send as a whole (connect, request, answer).
    timeout_s: float = 10.0
    # The most of an answer read (ONCELY_CALL_ANSWER_MAX_BYTES): a call whose
    # answer is larger fails (invalid_answer); a plain effect is sent all
    # the same, without its provider's message id.
    call_answer_max_bytes: int = DEFAULT_MAX_ANSWER_BYTES
    # Signs every webhook (ONCELY_WEBHOOK_SECRET): whsec_<base64> or any text.
    webhook_secret: str = ""
    smtp_from: str = "oncely@localhost"
    # Workflow name -> URL for its webhook effects (ONCELY_<WORKFLOW>_WEBHOOK_URL).
    webhook_urls: Mapping[str, str] = field(default_factory=dict)
    # For workflows without their own URL (ONCELY_WEBHOOK_URL).
    default_webhook_url: str | None = None


def build_router(effects: Iterable[tuple[str, Effect]], config: SendersConfig) -> EffectRouter:
    """The router for ``(workflow name, effect)`` pairs; ValueError for a topic
    declared twice. A webhook topic without a URL or secret is logged at once
    (``relay.effect_unconfigured``) and its rows fail with the reason.

    One webhook sender per distinct URL, all on one HTTP session, and an email
    sender only if some effect is an email, so a deployment with webhooks only
    needs no mail settings.
    """
    # Opens its session on first use only.
    poster = JsonPoster(config.timeout_s, max_answer_bytes=config.call_answer_max_bytes)
    routed = [(workflow, _as_delivered(effect, config)) for workflow, effect in _unique(effects)]
    event_senders = _event_senders(routed, config, poster)
    wants_email = any(isinstance(effect, EmailEffect) for _, effect in routed)
    email_sender = _email_sender(config, poster) if wants_email else None
    return EffectRouter(
        (effect for _, effect in routed), email_sender=email_sender, event_senders=event_senders
    )


def _unique(effects: Iterable[tuple[str, Effect]]) -> list[tuple[str, Effect]]:
    pairs = list(effects)
    declared_by: dict[str, str] = {}
    for workflow, effect in pairs:
        if effect.topic in declared_by:
            raise ValueError(
                f"effect topic {effect.topic!r} is declared twice"
                f" (workflows {declared_by[effect.topic]!r} and {workflow!r})"
            )
        declared_by[effect.topic] = workflow
    return pairs


def _event_senders(
    routed: list[tuple[str, Effect]], config: SendersConfig, poster: JsonPoster
) -> dict[str, EventSender]:
    """Each webhook topic's sender: one per distinct URL."""
    by_url: dict[str, EventSender] = {}
    by_topic: dict[str, EventSender] = {}
    for workflow, effect in routed:
        if not isinstance(effect, WebhookEffect):
            continue
        try:
            url = _webhook_url(workflow, effect, config)
            if url not in by_url:
                by_url[url] = _webhook_sender(workflow, effect, url, config, poster)
            by_topic[effect.topic] = by_url[url]
        except ValueError as exc:
            # The relay still delivers every other topic; this one's rows fail
            # with the reason, for an operator to fix and `oncely outbox retry`.
            log.warning("relay.effect_unconfigured", topic=effect.topic, reason=str(exc))
            by_topic[effect.topic] = _Unconfigured(str(exc))
    return by_topic


class _Unconfigured:
    """Stands in for a webhook sender whose URL or secret is missing."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    async def send(self, event: Event, dedupe_key: str) -> SendResult:
        raise PermanentError(self.reason)

    async def aclose(self) -> None:
        """Nothing was opened."""


def _as_delivered(effect: Effect, config: SendersConfig) -> Effect:
    """With ``email == "webhook"`` an email effect goes out as a webhook to ``email_url``."""
    if isinstance(effect, EmailEffect) and config.email == "webhook":
        return WebhookEffect(effect.topic, _email_fields(effect.render), config.email_url)
    return effect


def _email_fields(render: Callable[[Payload], Email]) -> Callable[[Payload], Mapping[str, Any]]:
    def fields(payload: Payload) -> Mapping[str, Any]:
        email = render(payload)
        check_recipient(email)
        return {"to": email.to, "subject": email.subject, "text": email.text}

    return fields


def _webhook_url(workflow: str, effect: WebhookEffect, config: SendersConfig) -> str:
    url = effect.url or config.webhook_urls.get(workflow) or config.default_webhook_url
    if not url:
        raise ValueError(
            f"workflow {workflow!r} declares webhook topic {effect.topic!r} but no URL is"
            f" configured: set ONCELY_{workflow.upper()}_WEBHOOK_URL or ONCELY_WEBHOOK_URL"
        )
    return url


def _webhook_sender(
    workflow: str, effect: WebhookEffect, url: str, config: SendersConfig, poster: JsonPoster
) -> WebhookSender:
    if not config.webhook_secret:
        raise ValueError(
            f"workflow {workflow!r} sends topic {effect.topic!r} as a signed webhook:"
            " set ONCELY_WEBHOOK_SECRET"
        )
    return WebhookSender(url, config.webhook_secret, config.timeout_s, poster=poster)


def _email_sender(config: SendersConfig, poster: JsonPoster) -> EmailSender:
    # Never "webhook": those email effects were turned into webhooks.
    if config.email == "smtp":
        return SmtpSender.from_url(config.email_url, config.smtp_from, config.timeout_s)
    return HttpEmailSender(config.email_url, config.timeout_s, poster=poster)
