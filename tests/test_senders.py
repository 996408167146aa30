"""Senders carry the dedupe key to the provider and classify every failure."""

from __future__ import annotations

import asyncio
import email
import email.policy
import email.utils
import json
import socket
import time
from collections.abc import AsyncIterator
from email.message import EmailMessage
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from pydantic import SecretStr

from oncely.errors import PermanentError, TransientError
from oncely.fakes.mail import FakeMailServer, Faults
from oncely.senders import (
    SUMMARY_READY,
    HttpEmailSender,
    SmtpSender,
    WebhookSender,
    build_sender,
    classify_status,
    parse_smtp_url,
    render_email,
    verify_signature,
)
from oncely.senders.base import parse_retry_after
from oncely.senders.smtp import message_id_for
from oncely.settings import Settings

PAYLOAD: dict[str, Any] = {"job_id": "job-1", "to": "ada@example.com", "summary": "Short."}


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


# --- classification and rendering -------------------------------------------------------


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


def test_summary_ready_renders_to_the_recipient() -> None:
    to, subject, text = render_email(SUMMARY_READY, PAYLOAD)

    assert to == "ada@example.com"
    assert "job-1" in subject
    assert text.startswith("Short.")


@pytest.mark.parametrize(
    ("topic", "payload"),
    [
        ("email.unknown", PAYLOAD),
        (SUMMARY_READY, {"job_id": "job-1", "summary": "Short."}),
        (SUMMARY_READY, {**PAYLOAD, "to": "ada@example.com\r\nBcc: eve@example.com"}),
        (SUMMARY_READY, {**PAYLOAD, "summary": None}),
    ],
)
def test_unrenderable_rows_are_permanent(topic: str, payload: dict[str, Any]) -> None:
    with pytest.raises(PermanentError):
        render_email(topic, payload)


# --- HTTP email API against the fake provider ---------------------------------------------


@pytest.fixture
def mailbox(tmp_path: Path) -> Path:
    return tmp_path / "mailbox.jsonl"


@pytest.fixture
async def mail(mailbox: Path) -> AsyncIterator[FakeMailServer]:
    async with FakeMailServer(mailbox) as server:
        yield server


def mailbox_lines(mailbox: Path) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in mailbox.read_text().splitlines()]


@pytest.fixture
async def sender(mail: FakeMailServer) -> AsyncIterator[HttpEmailSender]:
    s = HttpEmailSender(mail.url, timeout_s=2.0)
    yield s
    await s.aclose()


async def test_same_dedupe_key_twice_is_one_email(
    sender: HttpEmailSender, mail: FakeMailServer, mailbox: Path
) -> None:
    first = await sender.send(SUMMARY_READY, PAYLOAD, "summary_ready:job-1")
    second = await sender.send(SUMMARY_READY, PAYLOAD, "summary_ready:job-1")

    assert first.provider_message_id is not None
    assert first == second
    assert await mail.deliveries() == {
        "requests": 2,
        "effects": 1,
        "by_key": {"summary_ready:job-1": 2},
    }
    [line] = mailbox_lines(mailbox)
    assert (line["idempotency_key"], line["to"]) == ("summary_ready:job-1", "ada@example.com")
    assert line["text"].startswith("Short.")


async def test_concurrent_sends_share_one_session(
    sender: HttpEmailSender, mail: FakeMailServer
) -> None:
    keys = [f"summary_ready:job-{n}" for n in range(64)]

    await asyncio.gather(*(sender.send(SUMMARY_READY, PAYLOAD, key) for key in keys))

    deliveries = await mail.deliveries()
    assert (deliveries["requests"], deliveries["effects"]) == (64, 64)


async def test_provider_503_with_retry_after_is_transient(
    sender: HttpEmailSender, mail: FakeMailServer
) -> None:
    mail.state.script(Faults(fail_next=1, status=503, retry_after=1))

    with pytest.raises(TransientError) as caught:
        await sender.send(SUMMARY_READY, PAYLOAD, "summary_ready:job-1")

    assert caught.value.retry_after_s == 1.0
    assert (await mail.deliveries())["effects"] == 0


@pytest.mark.parametrize("status", [400, 422])
async def test_provider_4xx_is_permanent(
    sender: HttpEmailSender, mail: FakeMailServer, status: int
) -> None:
    mail.state.script(Faults(fail_next=1, status=status))

    with pytest.raises(PermanentError):
        await sender.send(SUMMARY_READY, PAYLOAD, "summary_ready:job-1")

    assert (await mail.deliveries())["effects"] == 0


async def test_connection_refused_is_transient() -> None:
    sender = HttpEmailSender(f"http://127.0.0.1:{closed_port()}/v1/messages", timeout_s=2.0)
    try:
        with pytest.raises(TransientError):
            await sender.send(SUMMARY_READY, PAYLOAD, "summary_ready:job-1")
    finally:
        await sender.aclose()


async def test_invalid_url_is_permanent() -> None:
    sender = HttpEmailSender("not a url", timeout_s=2.0)
    try:
        with pytest.raises(PermanentError):
            await sender.send(SUMMARY_READY, PAYLOAD, "summary_ready:job-1")
    finally:
        await sender.aclose()


async def test_timeout_is_transient_and_the_resend_is_still_one_email(
    mail: FakeMailServer,
) -> None:
    mail.state.script(Faults(delay_s=0.2))
    sender = HttpEmailSender(mail.url, timeout_s=0.05)
    try:
        with pytest.raises(TransientError):
            await sender.send(SUMMARY_READY, PAYLOAD, "summary_ready:job-1")
        # The provider acts after we gave up: the residual window that the
        # same dedupe key closes on the resend.
        await until_delivered(mail, effects=1)
        mail.state.script(Faults())
        await sender.send(SUMMARY_READY, PAYLOAD, "summary_ready:job-1")
    finally:
        await sender.aclose()

    assert await mail.deliveries() == {
        "requests": 2,
        "effects": 1,
        "by_key": {"summary_ready:job-1": 2},
    }


async def until_delivered(mail: FakeMailServer, *, effects: int) -> None:
    for _ in range(200):
        if (await mail.deliveries())["effects"] >= effects:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never reached {effects} effects")


# --- webhook --------------------------------------------------------------------------------


class Receiver:
    """A tiny webhook endpoint that records what it got and answers as scripted."""

    def __init__(self, status: int = 200, headers: dict[str, str] | None = None) -> None:
        self.status, self.headers = status, headers or {}
        self.received: list[tuple[dict[str, str], bytes]] = []
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        self.received.append((dict(request.headers), await request.read()))
        body = {"id": "hook-1"} if self.status < 300 else {"error": "busy"}
        return web.json_response(body, status=self.status, headers=self.headers)


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    r = Receiver()
    app = web.Application()
    app.router.add_post("/hook", r.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    r.url = f"http://{host}:{port}/hook"
    yield r
    await runner.cleanup()


async def send_webhook(receiver: Receiver, secret: str = "s3cret") -> tuple[dict[str, str], bytes]:
    sender = WebhookSender(receiver.url, secret, timeout_s=2.0)
    try:
        result = await sender.send(SUMMARY_READY, PAYLOAD, "summary_ready:job-1")
    finally:
        await sender.aclose()
    assert result.provider_message_id == "hook-1"
    [received] = receiver.received
    return received


async def test_webhook_signature_verifies_with_the_right_secret(receiver: Receiver) -> None:
    headers, body = await send_webhook(receiver)

    assert headers["Idempotency-Key"] == "summary_ready:job-1"
    assert json.loads(body) == {
        "topic": SUMMARY_READY,
        "payload": PAYLOAD,
        "dedupe_key": "summary_ready:job-1",
    }
    ts, signature = headers["X-Oncely-Timestamp"], headers["X-Oncely-Signature"]
    assert signature.startswith("v1=")
    assert verify_signature("s3cret", ts, body, signature, tolerance_s=300)


async def test_webhook_signature_fails_with_wrong_secret_tampered_body_or_stale_time(
    receiver: Receiver,
) -> None:
    headers, body = await send_webhook(receiver)
    ts, signature = headers["X-Oncely-Timestamp"], headers["X-Oncely-Signature"]

    assert not verify_signature("wrong", ts, body, signature, tolerance_s=300)
    assert not verify_signature("s3cret", ts, body + b" ", signature, tolerance_s=300)
    assert not verify_signature("s3cret", str(int(ts) - 1), body, signature, tolerance_s=300)
    stale = int(ts) + 301
    assert not verify_signature("s3cret", ts, body, signature, tolerance_s=300, now=stale)
    assert not verify_signature("s3cret", "nan", body, signature, tolerance_s=300)


async def test_webhook_signature_accepts_any_listed_secret_while_rotating(
    receiver: Receiver,
) -> None:
    headers, body = await send_webhook(receiver, secret="new")
    rotated = "v1=" + "0" * 64 + ", " + headers["X-Oncely-Signature"]

    assert verify_signature("new", headers["X-Oncely-Timestamp"], body, rotated)


async def test_webhook_receiver_503_is_transient(receiver: Receiver) -> None:
    receiver.status, receiver.headers = 503, {"Retry-After": "2"}

    with pytest.raises(TransientError) as caught:
        await send_webhook(receiver)

    assert caught.value.retry_after_s == 2.0


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
        first = await sender.send(SUMMARY_READY, PAYLOAD, "summary_ready:job-1")
        again = await sender.send(SUMMARY_READY, PAYLOAD, "summary_ready:job-1")
        other = await sender.send(SUMMARY_READY, PAYLOAD, "summary_ready:job-2")

    ids = [message["Message-ID"] for message in server.messages]
    assert ids == [first.provider_message_id, again.provider_message_id, other.provider_message_id]
    assert ids[0] == ids[1] == message_id_for("summary_ready:job-1")
    assert ids[2] != ids[0]
    message = server.messages[0]
    assert (message["To"], message["From"]) == ("ada@example.com", "oncely@example.com")
    assert message.get_content().startswith("Short.")


async def test_smtp_carries_non_ascii_text_intact() -> None:
    payload = {**PAYLOAD, "summary": "Grüße — naïve café, 東京."}
    async with SmtpResponder() as server:
        await smtp_sender(server.port).send(SUMMARY_READY, payload, "summary_ready:job-1")

    assert server.messages[0].get_content().startswith(payload["summary"])


async def test_smtp_5xx_reply_is_permanent() -> None:
    async with SmtpResponder(rcpt_reply="550 5.1.1 no such user") as server:
        with pytest.raises(PermanentError):
            await smtp_sender(server.port).send(SUMMARY_READY, PAYLOAD, "summary_ready:job-1")

    assert server.messages == []


async def test_smtp_4xx_reply_is_transient() -> None:
    async with SmtpResponder(data_reply="451 4.3.0 try again later") as server:
        with pytest.raises(TransientError):
            await smtp_sender(server.port).send(SUMMARY_READY, PAYLOAD, "summary_ready:job-1")


async def test_smtp_server_that_never_answers_is_transient_within_the_timeout() -> None:
    async with SmtpResponder(stall=True) as server:
        sender = SmtpSender(
            "127.0.0.1", server.port, "oncely@example.com", 0.1, local_hostname="test.local"
        )
        started = time.monotonic()
        with pytest.raises(TransientError):
            await sender.send(SUMMARY_READY, PAYLOAD, "summary_ready:job-1")

    assert time.monotonic() - started < 1.0


async def test_smtp_connection_refused_is_transient() -> None:
    with pytest.raises(TransientError):
        await smtp_sender(closed_port()).send(SUMMARY_READY, PAYLOAD, "summary_ready:job-1")


# --- the factory --------------------------------------------------------------------------------


def test_build_sender_picks_the_configured_adapter() -> None:
    secret = SecretStr("s3cret")

    assert isinstance(build_sender(Settings(sender="http")), HttpEmailSender)
    assert isinstance(
        build_sender(Settings(sender="webhook", webhook_secret=secret)), WebhookSender
    )
    smtp = Settings(sender="smtp", sender_url="smtp://127.0.0.1:2525")
    assert isinstance(build_sender(smtp), SmtpSender)


def test_smtp_url_gives_host_port_tls_and_credentials() -> None:
    plain = parse_smtp_url("smtp://mail.local:2525")
    tls = parse_smtp_url("smtps://user:p%40ss@mail.example.com")

    assert (plain.host, plain.port, plain.use_tls) == ("mail.local", 2525, False)
    assert (tls.port, tls.use_tls, tls.username, tls.password) == (465, True, "user", "p@ss")
    assert parse_smtp_url("smtp://mail.local").port == 25


def test_smtp_sender_refuses_an_http_url() -> None:
    with pytest.raises(ValueError, match="smtp://"):
        build_sender(Settings(sender="smtp", sender_url="http://127.0.0.1:8102/v1/messages"))
