"""SMTP sender on aiosmtplib.

SMTP has no idempotency key, so the dedupe key becomes the ``Message-ID``:
a resend is the same message, which mail stores and clients collapse.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import hashlib
import socket
from dataclasses import dataclass
from email.message import EmailMessage
from urllib.parse import unquote, urlsplit

import aiosmtplib

from oncely.effects import Email
from oncely.errors import OncelyError, PermanentError, TransientError
from oncely.senders.base import SendResult, check_recipient

# A polite goodbye after the message is accepted; not worth the full timeout.
_QUIT_TIMEOUT_S = 1.0


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


def message_id_for(dedupe_key: str) -> str:
    return f"<{hashlib.sha256(dedupe_key.encode()).hexdigest()[:32]}@oncely>"


def classify_smtp_error(exc: aiosmtplib.SMTPException | OSError) -> OncelyError:
    """5xx replies are permanent; 4xx replies, timeouts and lost connections transient."""
    if isinstance(exc, aiosmtplib.SMTPRecipientsRefused):
        codes = [refused.code for refused in exc.recipients]
    elif isinstance(exc, aiosmtplib.SMTPResponseException):
        codes = [exc.code]
    elif isinstance(exc, aiosmtplib.SMTPNotSupported):
        return PermanentError(f"SMTP server lacks a needed extension: {exc}")
    else:
        return TransientError(f"SMTP send failed: {type(exc).__name__}: {exc}")
    message = f"SMTP server answered {codes}: {exc}"
    if codes and all(500 <= code < 600 for code in codes):
        return PermanentError(message)
    return TransientError(message)


class SmtpSender:
    """Sends emails over SMTP, one connection per message: SMTP sessions carry
    one transaction at a time."""

    def __init__(
        self,
        host: str,
        port: int,
        from_addr: str,
        timeout_s: float,
        *,
        username: str | None = None,
        password: str | None = None,
        use_tls: bool = False,
        start_tls: bool | None = None,
        local_hostname: str | None = None,
    ) -> None:
        self._host, self._port, self._from = host, port, from_addr
        self._timeout_s = timeout_s
        self._username, self._password = username, password
        self._use_tls, self._start_tls = use_tls, start_tls
        self._local_hostname = local_hostname

    @classmethod
    def from_url(cls, url: str, from_addr: str, timeout_s: float) -> SmtpSender:
        """A sender for ``smtp://`` or ``smtps://`` ``url`` (see ``parse_smtp_url``)."""
        target = parse_smtp_url(url)
        return cls(
            target.host,
            target.port,
            from_addr,
            timeout_s,
            username=target.username,
            password=target.password,
            use_tls=target.use_tls,
        )

    async def send(self, email: Email, dedupe_key: str) -> SendResult:
        check_recipient(email)
        try:
            message = self._compose(email, dedupe_key)
        except ValueError as exc:  # the email package refuses line breaks in any header
            raise PermanentError(f"cannot compose the email: {exc}") from exc
        await self._deliver(message, email.to)
        return SendResult(provider_message_id=message["Message-ID"])

    def _compose(self, mail: Email, dedupe_key: str) -> EmailMessage:
        message = EmailMessage()
        message["From"] = self._from
        message["To"] = mail.to
        message["Subject"] = mail.subject
        message["Date"] = email.utils.formatdate(usegmt=True)
        message["Message-ID"] = message_id_for(dedupe_key)
        message.set_content(mail.text)
        return message

    async def _deliver(self, message: EmailMessage, to: str) -> None:
        client = aiosmtplib.SMTP(
            hostname=self._host,
            port=self._port,
            timeout=self._timeout_s,
            username=self._username,
            password=self._password,
            use_tls=self._use_tls,
            start_tls=self._start_tls,
            local_hostname=await self._ehlo_name(),
        )
        try:
            # aiosmtplib times each command; this bounds the whole exchange, as
            # the HTTP senders' total timeout does. The QUIT stays outside it.
            async with asyncio.timeout(self._timeout_s):
                await client.connect()
                await client.send_message(message, sender=self._from, recipients=[to])
        except (aiosmtplib.SMTPException, OSError) as exc:  # TimeoutError is an OSError
            raise classify_smtp_error(exc) from exc
        else:
            await _quit_quietly(client, min(_QUIT_TIMEOUT_S, self._timeout_s))
        finally:
            client.close()  # a no-op after QUIT; drops the socket on any failure

    async def _ehlo_name(self) -> str:
        # aiosmtplib would run getfqdn (a DNS lookup) on every connection.
        if self._local_hostname is None:
            self._local_hostname = await asyncio.to_thread(socket.getfqdn)
        return self._local_hostname

    async def aclose(self) -> None:
        """Nothing to release: connections live only for one message."""


async def _quit_quietly(client: aiosmtplib.SMTP, timeout_s: float) -> None:
    # Once DATA is accepted the message is delivered; a failed QUIT must not
    # turn that into a retry (a second delivery).
    with contextlib.suppress(aiosmtplib.SMTPException, OSError):
        await client.quit(timeout=timeout_s)
