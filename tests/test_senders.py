"""Senders carry the dedupe key to the provider and classify every failure;
the router turns an outbox row into the right sender's message by its topic."""

from __future__ import annotations

import asyncio
import base64
import email
import email.policy
import email.utils
import json
import socket
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from email.message import EmailMessage
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from structlog.testing import capture_logs

from oncely.effects import Email, Event, Payload, webhook
from oncely.effects import email as email_effect
from oncely.errors import PermanentError, TransientError
from oncely.fakes.mail import FakeMailServer, Faults
from oncely.senders import (
    EffectRouter,
    HttpEmailSender,
    SendersConfig,
    SendResult,
    SmtpSender,
    WebhookSender,
    build_router,
    classify_status,
    parse_smtp_url,
    sign,
    verify,
)
from oncely.senders.base import parse_retry_after
from oncely.senders.smtp import message_id_for
from oncely.senders.webhook import secret_key
from tests.helpers import mailbox_lines, posts_served

EMAIL = Email(to="ada@example.com", subject="Your summary is ready (job job-1)", text="Short.\n")
KEY = "summary_ready:job-1"
UNUSABLE_RECIPIENTS = ["", "  ", "ada@example.com\r\nBcc: eve@example.com", "ada@x.com\nBcc: e"]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


# --- classification ---------------------------------------------------------------------


@pytest.mark.parametrize("status", [408, 409, 429, 500, 502, 503, 504])
def test_retryable_statuses_are_transient(status: int) -> None:
    with pytest.raises(TransientError):
        classify_status(status, None)


@pytest.mark.parametrize("status", [301, 400, 401, 403, 404, 410, 413, 422])
def test_other_non_2xx_statuses_are_permanent(status: int) -> None:
    with pytest.raises(PermanentError):
        classify_status(status, None)


@pytest.mark.parametrize("status", [200, 201, 202, 204])
def test_2xx_statuses_pass(status: int) -> None:
    classify_status(status, None)


def test_retry_after_seconds_are_carried_on_the_transient_error() -> None:
    with pytest.raises(TransientError) as caught:
        classify_status(429, "7")
    assert caught.value.retry_after_s == 7.0


def test_retry_after_http_date_becomes_seconds_from_now() -> None:
    now = 1_700_000_000.0
    header = email.utils.formatdate(now + 30, usegmt=True)

    assert parse_retry_after(header, now=now) == 30.0
    assert parse_retry_after(email.utils.formatdate(now - 30, usegmt=True), now=now) == 0.0


@pytest.mark.parametrize("header", [None, "", "soon", "-3", "nan"])
def test_unusable_retry_after_is_none(header: str | None) -> None:
    assert parse_retry_after(header) is None


# --- HTTP email API against the fake provider ---------------------------------------------


@pytest.fixture
async def sender(mail: FakeMailServer) -> AsyncIterator[HttpEmailSender]:
    s = HttpEmailSender(mail.url, timeout_s=2.0)
    yield s
    await s.aclose()


async def test_same_dedupe_key_twice_is_one_email(
    sender: HttpEmailSender, mail: FakeMailServer, mailbox: Path
) -> None:
    first = await sender.send(EMAIL, KEY)
    second = await sender.send(EMAIL, KEY)

    assert first.provider_message_id is not None
    assert first == second
    assert await mail.deliveries() == {
        "requests": 2,
        "effects": 1,
        "by_key": {"summary_ready:job-1": 2},
    }
    [line] = mailbox_lines(mailbox)
    assert (line["idempotency_key"], line["to"]) == ("summary_ready:job-1", "ada@example.com")
    assert (line["subject"], line["text"]) == (EMAIL.subject, EMAIL.text)


async def test_concurrent_sends_share_one_session(
    sender: HttpEmailSender, mail: FakeMailServer
) -> None:
    keys = [f"summary_ready:job-{n}" for n in range(64)]

    await asyncio.gather(*(sender.send(EMAIL, key) for key in keys))

    deliveries = await mail.deliveries()
    assert (deliveries["requests"], deliveries["effects"]) == (64, 64)


async def test_provider_503_with_retry_after_is_transient(
    sender: HttpEmailSender, mail: FakeMailServer
) -> None:
    mail.state.script(Faults(fail_next=1, status=503, retry_after=1))

    with pytest.raises(TransientError) as caught:
        await sender.send(EMAIL, KEY)

    assert caught.value.retry_after_s == 1.0
    assert (await mail.deliveries())["effects"] == 0


@pytest.mark.parametrize("status", [400, 422])
async def test_provider_4xx_is_permanent(
    sender: HttpEmailSender, mail: FakeMailServer, status: int
) -> None:
    mail.state.script(Faults(fail_next=1, status=status))

    with pytest.raises(PermanentError):
        await sender.send(EMAIL, KEY)

    assert (await mail.deliveries())["effects"] == 0


async def test_connection_refused_is_transient() -> None:
    sender = HttpEmailSender(f"http://127.0.0.1:{closed_port()}/v1/messages", timeout_s=2.0)
    try:
        with pytest.raises(TransientError):
            await sender.send(EMAIL, KEY)
    finally:
        await sender.aclose()


async def test_invalid_url_is_permanent() -> None:
    sender = HttpEmailSender("not a url", timeout_s=2.0)
    try:
        with pytest.raises(PermanentError):
            await sender.send(EMAIL, KEY)
    finally:
        await sender.aclose()


async def test_timeout_is_transient_and_the_resend_is_still_one_email(
    mail: FakeMailServer,
) -> None:
    mail.state.script(Faults(delay_s=0.2))
    sender = HttpEmailSender(mail.url, timeout_s=0.05)
    try:
        with pytest.raises(TransientError):
            await sender.send(EMAIL, KEY)
        # The provider acts after we gave up: the residual window that the
        # same dedupe key closes on the resend.
        await until_delivered(mail, effects=1)
        mail.state.script(Faults())
        await sender.send(EMAIL, KEY)
    finally:
        await sender.aclose()

    assert await mail.deliveries() == {
        "requests": 2,
        "effects": 1,
        "by_key": {"summary_ready:job-1": 2},
    }


@pytest.mark.parametrize("to", UNUSABLE_RECIPIENTS)
async def test_unusable_recipient_is_permanent_and_never_sent(
    sender: HttpEmailSender, mail: FakeMailServer, to: str
) -> None:
    with pytest.raises(PermanentError, match="recipient"):
        await sender.send(Email(to, EMAIL.subject, EMAIL.text), KEY)

    assert (await mail.deliveries())["requests"] == 0


async def until_delivered(mail: FakeMailServer, *, effects: int) -> None:
    for _ in range(200):
        if (await mail.deliveries())["effects"] >= effects:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never reached {effects} effects")


# --- Standard Webhooks: signing and verifying ----------------------------------------------

# The example published in the Standard Webhooks README (and its libraries' tests).
SPEC_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SPEC_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
SPEC_TIMESTAMP = 1614265330
SPEC_BODY = b'{"test": 2432232314}'
SPEC_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def spec_headers(signature: str = SPEC_SIGNATURE) -> dict[str, str]:
    return {
        "webhook-id": SPEC_ID,
        "webhook-timestamp": str(SPEC_TIMESTAMP),
        "webhook-signature": signature,
    }


def test_signature_matches_the_standard_webhooks_example() -> None:
    assert sign(SPEC_SECRET, SPEC_ID, SPEC_TIMESTAMP, SPEC_BODY) == SPEC_SIGNATURE


def test_verify_accepts_the_standard_webhooks_example_within_tolerance() -> None:
    assert verify(SPEC_SECRET, spec_headers(), SPEC_BODY, now=SPEC_TIMESTAMP + 299)
    assert verify(SPEC_SECRET, spec_headers(), SPEC_BODY, now=SPEC_TIMESTAMP - 299)


def test_verify_takes_the_body_as_text_too() -> None:
    text = SPEC_BODY.decode()
    assert verify(SPEC_SECRET, spec_headers(), text, now=SPEC_TIMESTAMP)
    assert not verify(SPEC_SECRET, spec_headers(), text + " ", now=SPEC_TIMESTAMP)


def test_verify_fails_for_a_wrong_secret_a_tampered_body_or_another_id() -> None:
    wrong_secret = "whsec_" + base64.b64encode(b"another key").decode()

    assert not verify(wrong_secret, spec_headers(), SPEC_BODY, now=SPEC_TIMESTAMP)
    assert not verify(SPEC_SECRET, spec_headers(), SPEC_BODY + b" ", now=SPEC_TIMESTAMP)
    replayed = {**spec_headers(), "webhook-id": "msg_other"}
    assert not verify(SPEC_SECRET, replayed, SPEC_BODY, now=SPEC_TIMESTAMP)


def test_verify_fails_outside_the_tolerance_or_with_an_odd_timestamp() -> None:
    assert not verify(SPEC_SECRET, spec_headers(), SPEC_BODY, now=SPEC_TIMESTAMP + 301)
    assert not verify(SPEC_SECRET, spec_headers(), SPEC_BODY, now=SPEC_TIMESTAMP - 301)
    assert not verify(SPEC_SECRET, spec_headers(), SPEC_BODY, 10, now=SPEC_TIMESTAMP + 11)
    for odd in ("nan", "-1614265330", "1614265330.0", "", "١٦١٤٢٦٥٣٣٠"):
        headers = {**spec_headers(), "webhook-timestamp": odd}
        assert not verify(SPEC_SECRET, headers, SPEC_BODY, now=SPEC_TIMESTAMP)


def test_verify_passes_when_any_of_several_signatures_matches() -> None:
    rotating = "v1,bm90IHRoZSBzaWduYXR1cmU= v1a,whatever " + SPEC_SIGNATURE

    assert verify(SPEC_SECRET, spec_headers(rotating), SPEC_BODY, now=SPEC_TIMESTAMP)
    assert not verify(SPEC_SECRET, spec_headers("v1,bm90 v1a,x"), SPEC_BODY, now=SPEC_TIMESTAMP)


def test_verify_matches_header_names_case_insensitively_and_needs_all_three() -> None:
    shouting = {name.upper(): value for name, value in spec_headers().items()}

    assert verify(SPEC_SECRET, shouting, SPEC_BODY, now=SPEC_TIMESTAMP)
    for missing in spec_headers():
        headers = {k: v for k, v in spec_headers().items() if k != missing}
        assert not verify(SPEC_SECRET, headers, SPEC_BODY, now=SPEC_TIMESTAMP)


def test_secret_is_base64_after_whsec_and_raw_utf8_otherwise() -> None:
    assert secret_key(SPEC_SECRET) == base64.b64decode("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    assert secret_key("s3cret-ü") == "s3cret-ü".encode()
    for unusable in ("", "whsec_", "whsec_not base64!"):
        with pytest.raises(ValueError, match="secret"):
            secret_key(unusable)


# --- the webhook sender against a real receiver ----------------------------------------------


class Receiver:
    """A tiny webhook endpoint that records what it got and answers as scripted."""

    def __init__(self, status: int = 200, headers: dict[str, str] | None = None) -> None:
        self.status, self.headers = status, headers or {}
        self.received: list[tuple[dict[str, str], bytes]] = []
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        self.received.append((dict(request.headers), await request.read()))
        body = {"id": f"hook-{len(self.received)}"} if self.status < 300 else {"error": "busy"}
        return web.json_response(body, status=self.status, headers=self.headers)


@asynccontextmanager
async def serving(receiver: Receiver) -> AsyncIterator[Receiver]:
    async with posts_served("/hook", receiver.handle) as receiver.url:
        yield receiver


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    async with serving(Receiver()) as r:
        yield r


NOW = 1_700_000_000.0  # 2023-11-14T22:13:20Z
EVENT = Event("triage.done", {"ticket": "T-1", "labels": ["billing"]})


async def send_webhook(
    receiver: Receiver, event: Event = EVENT, secret: str = SPEC_SECRET
) -> tuple[dict[str, str], bytes]:
    sender = WebhookSender(receiver.url, secret, timeout_s=2.0, clock=lambda: NOW)
    try:
        result = await sender.send(event, KEY)
    finally:
        await sender.aclose()
    assert result.provider_message_id == "hook-1"
    [received] = receiver.received
    return received


async def test_webhook_carries_the_standard_headers_and_body(receiver: Receiver) -> None:
    headers, body = await send_webhook(receiver)

    assert (headers["webhook-id"], headers["Idempotency-Key"]) == (KEY, KEY)
    assert headers["webhook-timestamp"] == "1700000000"
    assert headers["webhook-signature"].startswith("v1,")
    assert json.loads(body) == {
        "type": "triage.done",
        "timestamp": "2023-11-14T22:13:20Z",
        "data": {"ticket": "T-1", "labels": ["billing"]},
    }
    assert body == json.dumps(json.loads(body), separators=(",", ":")).encode(), "compact"


async def test_webhook_signature_verifies_only_with_its_secret(receiver: Receiver) -> None:
    headers, body = await send_webhook(receiver, secret="plain-secret")

    assert verify("plain-secret", headers, body, now=NOW)
    assert not verify(SPEC_SECRET, headers, body, now=NOW)
    assert not verify("plain-secret", headers, body, now=NOW + 301)


async def test_webhook_receiver_503_is_transient(receiver: Receiver) -> None:
    receiver.status, receiver.headers = 503, {"Retry-After": "2"}

    with pytest.raises(TransientError) as caught:
        await send_webhook(receiver)

    assert caught.value.retry_after_s == 2.0


async def test_webhook_receiver_4xx_is_permanent(receiver: Receiver) -> None:
    receiver.status = 401

    with pytest.raises(PermanentError):
        await send_webhook(receiver)


async def test_event_data_that_is_not_json_is_permanent_and_never_sent(
    receiver: Receiver,
) -> None:
    with pytest.raises(PermanentError, match="JSON"):
        await send_webhook(receiver, Event("triage.done", {"at": object()}))

    assert receiver.received == []


def test_webhook_sender_refuses_an_empty_secret() -> None:
    with pytest.raises(ValueError, match="secret"):
        WebhookSender("http://127.0.0.1:1/hook", "", timeout_s=1.0)


# --- SMTP -------------------------------------------------------------------------------------


class SmtpResponder:
    """Just enough SMTP for aiosmtplib, with scriptable RCPT and DATA replies."""

    def __init__(
        self, rcpt_reply: str = "250 OK", data_reply: str = "250 OK queued", stall: bool = False
    ) -> None:
        self.replies = {
            b"EHLO": "250-fake\r\n250 8BITMIME",
            b"RCPT": rcpt_reply,
            b"QUIT": "221 Bye",
        }
        self.data_reply = data_reply
        self.stall = stall  # never answer the end of DATA, like a hung server
        self.messages: list[EmailMessage] = []
        self.port = 0

    async def __aenter__(self) -> SmtpResponder:
        self._server = await asyncio.start_server(self._session, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._server.close()
        await self._server.wait_closed()

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"220 fake ESMTP\r\n")
        while line := await reader.readline():
            verb = line[:4].upper()
            if verb == b"DATA":
                writer.write(b"354 go ahead\r\n")
                self.messages.append(await _read_data(reader))
                if self.stall:
                    await reader.read()
            reply = self.data_reply if verb == b"DATA" else self.replies.get(verb, "250 OK")
            writer.write(reply.encode() + b"\r\n")
            await writer.drain()
            if verb == b"QUIT":
                break
        writer.close()


async def _read_data(reader: asyncio.StreamReader) -> EmailMessage:
    lines: list[bytes] = []
    while (line := await reader.readline()) != b".\r\n":
        lines.append(line[1:] if line.startswith(b"..") else line)
    parsed = email.message_from_bytes(b"".join(lines), policy=email.policy.default)
    assert isinstance(parsed, EmailMessage)
    return parsed


def smtp_sender(port: int) -> SmtpSender:
    return SmtpSender(
        "127.0.0.1", port, "oncely@example.com", timeout_s=2.0, local_hostname="test.local"
    )


async def test_smtp_same_dedupe_key_sends_the_same_message_id() -> None:
    async with SmtpResponder() as server:
        sender = smtp_sender(server.port)
        first = await sender.send(EMAIL, KEY)
        again = await sender.send(EMAIL, KEY)
        other = await sender.send(EMAIL, "summary_ready:job-2")

    ids = [message["Message-ID"] for message in server.messages]
    assert ids == [first.provider_message_id, again.provider_message_id, other.provider_message_id]
    assert ids[0] == ids[1] == message_id_for(KEY)
    assert ids[2] != ids[0]
    message = server.messages[0]
    assert (message["To"], message["From"]) == ("ada@example.com", "oncely@example.com")
    assert message["Subject"] == EMAIL.subject
    assert message.get_content().startswith("Short.")


async def test_smtp_carries_non_ascii_text_intact() -> None:
    text = "Grüße — naïve café, 東京."
    async with SmtpResponder() as server:
        await smtp_sender(server.port).send(Email(EMAIL.to, EMAIL.subject, text), KEY)

    assert server.messages[0].get_content().startswith(text)


@pytest.mark.parametrize(
    "mail",
    [Email(to, EMAIL.subject, EMAIL.text) for to in UNUSABLE_RECIPIENTS]
    + [Email(EMAIL.to, "Hi\r\nBcc: eve@example.com", EMAIL.text)],
)
async def test_smtp_refuses_header_injection_permanently_before_connecting(mail: Email) -> None:
    async with SmtpResponder() as server:
        with pytest.raises(PermanentError):
            await smtp_sender(server.port).send(mail, KEY)

    assert server.messages == []


async def test_smtp_5xx_reply_is_permanent() -> None:
    async with SmtpResponder(rcpt_reply="550 5.1.1 no such user") as server:
        with pytest.raises(PermanentError):
            await smtp_sender(server.port).send(EMAIL, KEY)

    assert server.messages == []


async def test_smtp_4xx_reply_is_transient() -> None:
    async with SmtpResponder(data_reply="451 4.3.0 try again later") as server:
        with pytest.raises(TransientError):
            await smtp_sender(server.port).send(EMAIL, KEY)


async def test_smtp_server_that_never_answers_is_transient_within_the_timeout() -> None:
    async with SmtpResponder(stall=True) as server:
        sender = SmtpSender(
            "127.0.0.1", server.port, "oncely@example.com", 0.1, local_hostname="test.local"
        )
        with pytest.raises(TransientError) as raised:
            await sender.send(EMAIL, KEY)

    # The server stalls for good: only the 0.1 s timeout can have ended the
    # send (a hang meets the test's own timeout instead).
    assert isinstance(raised.value.__cause__, TimeoutError)


async def test_smtp_connection_refused_is_transient() -> None:
    with pytest.raises(TransientError):
        await smtp_sender(closed_port()).send(EMAIL, KEY)


def test_smtp_url_gives_host_port_tls_and_credentials() -> None:
    plain = parse_smtp_url("smtp://mail.local:2525")
    tls = parse_smtp_url("smtps://user:p%40ss@mail.example.com")

    assert (plain.host, plain.port, plain.use_tls) == ("mail.local", 2525, False)
    assert (tls.port, tls.use_tls, tls.username, tls.password) == (465, True, "user", "p@ss")
    assert parse_smtp_url("smtp://mail.local").port == 25


# --- routing effects by topic -----------------------------------------------------------------


def render_summary(payload: Payload) -> Email:
    return Email(
        to=payload["to"],
        subject=f"Your summary is ready (job {payload['job_id']})",
        text=payload["summary"].strip() + "\n",
    )


def render_triage(payload: Payload) -> Mapping[str, Any]:
    return {"ticket": payload["ticket"], "labels": sorted(payload["labels"])}


SUMMARY = email_effect("email.summary_ready", render_summary)
TRIAGE = webhook("triage.done", render=render_triage)
SUMMARY_PAYLOAD: dict[str, Any] = {"job_id": "job-1", "to": "ada@example.com", "summary": "Short."}
TRIAGE_PAYLOAD: dict[str, Any] = {"ticket": "T-1", "labels": ["urgent", "billing"]}


@asynccontextmanager
async def routing(effects: list[tuple[str, Any]], **config: Any) -> AsyncIterator[EffectRouter]:
    router = build_router(effects, SendersConfig(timeout_s=2.0, **config))
    try:
        yield router
    finally:
        await router.aclose()


async def test_router_sends_email_topics_to_the_mail_api_and_webhook_topics_to_their_url(
    mail: FakeMailServer, mailbox: Path, receiver: Receiver
) -> None:
    effects = [("summaries", SUMMARY), ("triage", TRIAGE)]
    urls = {"triage": receiver.url}
    async with routing(
        effects, email_url=mail.url, webhook_secret=SPEC_SECRET, webhook_urls=urls
    ) as router:
        sent = await router.send("email.summary_ready", SUMMARY_PAYLOAD, KEY)
        await router.send("email.summary_ready", SUMMARY_PAYLOAD, KEY)
        hooked = await router.send("triage.done", TRIAGE_PAYLOAD, "triage:T-1")

    assert sent.provider_message_id is not None and hooked.provider_message_id == "hook-1"
    assert (await mail.deliveries())["by_key"] == {KEY: 2}
    [line] = mailbox_lines(mailbox)
    assert (line["to"], line["subject"]) == ("ada@example.com", "Your summary is ready (job job-1)")
    [(headers, body)] = receiver.received
    assert headers["webhook-id"] == "triage:T-1"
    assert json.loads(body)["data"] == {"ticket": "T-1", "labels": ["billing", "urgent"]}
    assert verify(SPEC_SECRET, headers, body)


async def test_an_answer_past_the_bound_is_not_read_and_a_plain_effect_is_sent_anyway(
    mail: FakeMailServer, receiver: Receiver
) -> None:
    """``call_answer_max_bytes`` bounds every answer read; a plain webhook
    or email whose provider answers more was still delivered (no message
    id), and goes out once."""
    effects = [("summaries", SUMMARY), ("triage", TRIAGE)]
    urls = {"triage": receiver.url}
    async with routing(
        effects,
        email_url=mail.url,
        webhook_secret=SPEC_SECRET,
        webhook_urls=urls,
        call_answer_max_bytes=8,
    ) as router:
        hooked = await router.send("triage.done", TRIAGE_PAYLOAD, "triage:T-1")
        mailed = await router.send("email.summary_ready", SUMMARY_PAYLOAD, KEY)

    assert (hooked.provider_message_id, mailed.provider_message_id) == (None, None)
    assert len(receiver.received) == 1
    assert (await mail.deliveries())["by_key"] == {KEY: 1}


async def test_router_refuses_an_unknown_topic_permanently(mail: FakeMailServer) -> None:
    async with routing([("summaries", SUMMARY)], email_url=mail.url) as router:
        with pytest.raises(PermanentError, match=r"email\.welcome"):
            await router.send("email.welcome", SUMMARY_PAYLOAD, KEY)

    assert (await mail.deliveries())["requests"] == 0


@pytest.mark.parametrize(
    ("topic", "payload", "reason"),
    [
        ("email.summary_ready", {"job_id": "job-1", "summary": "Short."}, "KeyError"),
        ("email.summary_ready", {**SUMMARY_PAYLOAD, "summary": None}, "AttributeError"),
        ("triage.done", {"ticket": "T-1", "labels": None}, "TypeError"),
        (
            "email.summary_ready",
            {**SUMMARY_PAYLOAD, "to": "ada@x.com\r\nBcc: e@x.com"},
            "recipient",
        ),
    ],
)
async def test_a_row_that_cannot_be_rendered_is_permanent_and_never_sent(
    mail: FakeMailServer, receiver: Receiver, topic: str, payload: dict[str, Any], reason: str
) -> None:
    effects = [("summaries", SUMMARY), ("triage", TRIAGE)]
    config = {"email_url": mail.url, "webhook_secret": "s", "default_webhook_url": receiver.url}
    async with routing(effects, **config) as router:
        with pytest.raises(PermanentError, match=reason) as caught:
            await router.send(topic, payload, KEY)

    assert reason == "recipient" or topic in str(caught.value), "the message names the topic"
    assert (await mail.deliveries())["requests"] == 0 and receiver.received == []


async def test_email_as_webhook_delivers_the_email_fields_as_a_signed_event(
    receiver: Receiver,
) -> None:
    async with routing(
        [("summaries", SUMMARY)], email="webhook", email_url=receiver.url, webhook_secret="s"
    ) as router:
        await router.send("email.summary_ready", SUMMARY_PAYLOAD, KEY)
        with pytest.raises(PermanentError, match="recipient"):
            await router.send("email.summary_ready", {**SUMMARY_PAYLOAD, "to": ""}, KEY)

    [(headers, body)] = receiver.received
    event = json.loads(body)
    assert (event["type"], headers["webhook-id"]) == ("email.summary_ready", KEY)
    assert event["data"] == {
        "to": "ada@example.com",
        "subject": "Your summary is ready (job job-1)",
        "text": "Short.\n",
    }
    assert verify("s", headers, body)


async def test_router_sends_email_over_smtp_when_configured() -> None:
    async with SmtpResponder() as server:
        url = f"smtp://127.0.0.1:{server.port}"
        async with routing(
            [("summaries", SUMMARY)], email="smtp", email_url=url, smtp_from="me@example.com"
        ) as router:
            result = await router.send("email.summary_ready", SUMMARY_PAYLOAD, KEY)

    [message] = server.messages
    assert (message["From"], message["Message-ID"]) == ("me@example.com", message_id_for(KEY))
    assert result.provider_message_id == message_id_for(KEY)


async def test_webhook_url_is_the_effects_then_the_workflows_then_the_default(
    receiver: Receiver,
) -> None:
    effects = [
        ("triage", webhook("triage.done")),
        ("billing", webhook("billing.paid", url=receiver.url)),
        ("audit", webhook("audit.logged")),
    ]
    async with serving(Receiver()) as workflow_hook, serving(Receiver()) as default_hook:
        urls = {"triage": workflow_hook.url, "billing": workflow_hook.url}
        config = {"webhook_urls": urls, "default_webhook_url": default_hook.url}
        async with routing(effects, webhook_secret="s", **config) as router:
            for topic in ("triage.done", "billing.paid", "audit.logged"):
                await router.send(topic, {"n": 1}, f"{topic}:1")

    def types(r: Receiver) -> list[str]:
        return [json.loads(body)["type"] for _, body in r.received]

    assert types(workflow_hook) == ["triage.done"]
    assert types(receiver) == ["billing.paid"]
    assert types(default_hook) == ["audit.logged"]
    [(_, body)] = workflow_hook.received
    assert json.loads(body)["data"] == {"n": 1}, "no renderer: the payload is the data"


def test_webhook_only_deployments_need_no_mail_settings() -> None:
    config = SendersConfig(email="smtp", email_url="not a url", webhook_secret="s")

    build_router([("triage", webhook("triage.done", url="http://127.0.0.1:1/hook"))], config)
    with pytest.raises(ValueError, match="smtp://"):
        build_router([("summaries", SUMMARY)], config)


async def test_a_webhook_without_url_fails_its_rows_naming_the_setting() -> None:
    """The relay still starts (other topics go out); this topic's rows fail
    permanently with the setting to fix, and the gap is logged at start."""
    config = SendersConfig(webhook_secret="s", webhook_urls={"billing": "http://127.0.0.1:1/"})

    with capture_logs() as logs:
        router = build_router([("triage", TRIAGE)], config)
    with pytest.raises(PermanentError, match="triage") as caught:
        await router.send("triage.done", TRIAGE_PAYLOAD, "triage.done:j")

    assert "ONCELY_TRIAGE_WEBHOOK_URL" in str(caught.value)
    assert "ONCELY_WEBHOOK_URL" in str(caught.value)
    assert [e["event"] for e in logs] == ["relay.effect_unconfigured"]


@pytest.mark.parametrize("email_mode", ["http", "webhook"])
async def test_webhooks_without_a_secret_fail_naming_the_setting(email_mode: str) -> None:
    config = SendersConfig(email=email_mode, default_webhook_url="http://127.0.0.1:1/")  # type: ignore[arg-type]
    effects = [("triage", TRIAGE)] if email_mode == "http" else [("summaries", SUMMARY)]
    router = build_router(effects, config)
    topic = effects[0][1].topic
    payload = TRIAGE_PAYLOAD if email_mode == "http" else SUMMARY_PAYLOAD

    with pytest.raises(PermanentError, match="ONCELY_WEBHOOK_SECRET"):
        await router.send(topic, payload, f"{topic}:j")


def test_build_router_refuses_a_topic_declared_twice() -> None:
    config = SendersConfig(webhook_secret="s", default_webhook_url="http://127.0.0.1:1/")
    effects = [("summaries", SUMMARY), ("digest", email_effect(SUMMARY.topic, render_summary))]

    with pytest.raises(ValueError, match=r"email\.summary_ready"):
        build_router(effects, config)
    with pytest.raises(ValueError, match=r"triage\.done"):
        build_router([("triage", TRIAGE), ("triage", webhook("triage.done"))], config)


class CountingSender:
    def __init__(self) -> None:
        self.closed = 0

    async def send(self, event: Event, dedupe_key: str) -> SendResult:
        return SendResult(provider_message_id=None)

    async def aclose(self) -> None:
        self.closed += 1


async def test_router_closes_each_distinct_sender_once() -> None:
    shared, other = CountingSender(), CountingSender()
    effects = [webhook("a.done"), webhook("b.done"), webhook("c.done")]
    router = EffectRouter(
        effects, event_senders={"a.done": shared, "b.done": shared, "c.done": other}
    )

    await router.aclose()

    assert (shared.closed, other.closed) == (1, 1)
