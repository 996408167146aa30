"""The fake mail provider dedupes like a real one and scripts faults for tests."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from typer.testing import CliRunner

from oncely.cli.commands import app as cli
from oncely.effects import Email
from oncely.errors import TransientError
from oncely.fakes.mail import EVENTS_PATH, FakeMailServer, serve_fake_mail
from oncely.senders.http import HttpEmailSender
from tests.helpers import mailbox_lines

MESSAGE = {"to": "ada@example.com", "subject": "Hello", "text": "Your summary."}
EVENT = {"type": "summary.ready", "timestamp": "2024-05-01T12:00:00Z", "data": {"job": "j-1"}}
SECRET = b"test-secret"


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def post_message(
    http: aiohttp.ClientSession, url: str, key: str | None, body: Any = MESSAGE
) -> tuple[int, dict[str, Any], dict[str, str]]:
    headers = {} if key is None else {"Idempotency-Key": key}
    async with http.post(url, json=body, headers=headers) as response:
        return response.status, await response.json(), dict(response.headers)


async def script(http: aiohttp.ClientSession, mail: FakeMailServer, **faults: Any) -> None:
    async with http.post(mail.base_url + "/_faults", json=faults) as response:
        assert response.status == 200


async def sent_twice(
    post: Any, http: aiohttp.ClientSession, mail: FakeMailServer, url: str, key: str
) -> tuple[tuple[int, dict[str, Any], dict[str, str]], dict[str, Any]]:
    """``post`` to ``url`` twice under ``key``: one effect, one id, one line
    in the mailbox. The first answer and that line."""
    first = await post(http, url, key)
    second = await post(http, url, key)
    assert (first[0], second[0]) == (201, 200)
    assert first[1]["id"] == second[1]["id"]
    assert await mail.deliveries() == {"requests": 2, "effects": 1, "by_key": {key: 2}}
    [line] = mailbox_lines(mail.mailbox)
    return first, line


async def test_same_key_twice_is_one_effect_with_one_message_id(
    mail: FakeMailServer, http: aiohttp.ClientSession, mailbox: Path
) -> None:
    first, line = await sent_twice(post_message, http, mail, mail.url, "k-1")
    assert (line["kind"], line["idempotency_key"], line["id"]) == ("email", "k-1", first[1]["id"])
    assert {k: line[k] for k in ("to", "subject", "text")} == MESSAGE
    assert line["received_at"]


async def test_distinct_keys_are_distinct_effects(
    mail: FakeMailServer, http: aiohttp.ClientSession, mailbox: Path
) -> None:
    a = await post_message(http, mail.url, "k-a")
    b = await post_message(http, mail.url, "k-b")

    assert a[1]["id"] != b[1]["id"]
    assert (await mail.deliveries())["effects"] == 2
    assert [line["idempotency_key"] for line in mailbox_lines(mailbox)] == ["k-a", "k-b"]


async def test_concurrent_requests_with_one_key_deliver_once(
    mail: FakeMailServer, http: aiohttp.ClientSession, mailbox: Path
) -> None:
    answers = await asyncio.gather(*(post_message(http, mail.url, "k-race") for _ in range(20)))

    assert len({body["id"] for _, body, _ in answers}) == 1
    assert await mail.deliveries() == {"requests": 20, "effects": 1, "by_key": {"k-race": 20}}
    assert len(mailbox_lines(mailbox)) == 1


async def test_missing_idempotency_key_is_rejected_with_no_effect(
    mail: FakeMailServer, http: aiohttp.ClientSession, mailbox: Path
) -> None:
    status, _, _ = await post_message(http, mail.url, None)

    assert status == 400
    assert await mail.deliveries() == {"requests": 1, "effects": 0, "by_key": {}}
    assert mailbox_lines(mailbox) == []


async def test_invalid_message_is_rejected_with_no_effect(
    mail: FakeMailServer, http: aiohttp.ClientSession
) -> None:
    status, _, _ = await post_message(http, mail.url, "k-bad", {"to": "", "subject": "x"})

    assert status == 422
    assert (await mail.deliveries())["effects"] == 0


async def test_fail_next_fails_that_many_requests_then_delivers(
    mail: FakeMailServer, http: aiohttp.ClientSession
) -> None:
    await script(http, mail, fail_next=2, status=503, retry_after=1)

    answers = [await post_message(http, mail.url, "k-retry") for _ in range(3)]

    assert [status for status, _, _ in answers] == [503, 503, 201]
    assert answers[0][2]["Retry-After"] == "1"
    assert await mail.deliveries() == {"requests": 3, "effects": 1, "by_key": {"k-retry": 3}}


async def test_delay_applies_to_following_requests(
    mail: FakeMailServer, http: aiohttp.ClientSession
) -> None:
    await script(http, mail, delay_s=0.1)

    started = time.monotonic()
    status, _, _ = await post_message(http, mail.url, "k-slow")

    assert status == 201
    assert time.monotonic() - started >= 0.1


async def test_unknown_fault_fields_are_rejected(
    mail: FakeMailServer, http: aiohttp.ClientSession
) -> None:
    async with http.post(mail.base_url + "/_faults", json={"fail_nxt": 1}) as response:
        assert response.status == 400

    status, _, _ = await post_message(http, mail.url, "k-1")
    assert status == 201


async def test_deliveries_endpoint_reports_requests_and_effects(
    mail: FakeMailServer, http: aiohttp.ClientSession
) -> None:
    await post_message(http, mail.url, "k-1")
    await post_message(http, mail.url, "k-1")

    async with http.get(mail.base_url + "/_deliveries") as response:
        assert await response.json() == {"requests": 2, "effects": 1, "by_key": {"k-1": 2}}


async def test_reset_forgets_counts_faults_and_mailbox(
    mail: FakeMailServer, http: aiohttp.ClientSession, mailbox: Path
) -> None:
    await post_message(http, mail.url, "k-1")
    await script(http, mail, fail_next=5)

    async with http.post(mail.base_url + "/_reset") as response:
        assert response.status == 200

    assert await mail.deliveries() == {"requests": 0, "effects": 0, "by_key": {}}
    assert mailbox_lines(mailbox) == []
    status, _, _ = await post_message(http, mail.url, "k-1")
    assert status == 201


async def test_restart_on_the_same_mailbox_keeps_deduping(
    http: aiohttp.ClientSession, mailbox: Path
) -> None:
    async with FakeMailServer(mailbox) as before:
        _, first, _ = await post_message(http, before.url, "k-1")
    async with FakeMailServer(mailbox) as after:
        status, again, _ = await post_message(http, after.url, "k-1")
        assert (await after.deliveries())["effects"] == 1

    assert (status, again["id"]) == (200, first["id"])
    assert len(mailbox_lines(mailbox)) == 1


async def test_a_line_torn_by_a_kill_does_not_swallow_the_next_effect(
    http: aiohttp.ClientSession, mailbox: Path
) -> None:
    write_torn_line(mailbox)

    async with FakeMailServer(mailbox) as mail:
        await post_message(http, mail.url, "k-next")

    _torn, last = raw_lines(mailbox)
    assert json.loads(last)["idempotency_key"] == "k-next"


def write_torn_line(mailbox: Path) -> None:
    mailbox.write_text('{"idempotency_key": "k-torn", "to": "a')


def raw_lines(mailbox: Path) -> list[str]:
    return mailbox.read_text().splitlines()


async def test_serve_fake_mail_answers_until_cancelled(
    http: aiohttp.ClientSession, mailbox: Path
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1/messages"
    server = asyncio.create_task(serve_fake_mail("127.0.0.1", port, mailbox))

    status = await _post_when_up(http, url)
    server.cancel()
    with pytest.raises(asyncio.CancelledError):
        await server

    assert status == 201
    assert len(mailbox_lines(mailbox)) == 1
    with pytest.raises(aiohttp.ClientConnectionError):
        await post_message(http, url, "k-after")


async def _post_when_up(http: aiohttp.ClientSession, url: str) -> int:
    for _ in range(100):
        try:
            status, _, _ = await post_message(http, url, "k-served")
        except aiohttp.ClientConnectionError:
            await asyncio.sleep(0.01)
        else:
            return status
    raise AssertionError("serve_fake_mail never came up")


# --- webhooks (POST /v1/events) ------------------------------------------------------


def signed(webhook_id: str, timestamp: int, body: bytes) -> str:
    """A Standard Webhooks signature, as a sender computes it."""
    digest = hmac.new(SECRET, f"{webhook_id}.{timestamp}.".encode() + body, hashlib.sha256)
    return "v1," + base64.b64encode(digest.digest()).decode()


async def post_event(
    http: aiohttp.ClientSession, url: str, webhook_id: str | None, body: bytes | None = None
) -> tuple[int, dict[str, Any]]:
    raw = json.dumps(EVENT, separators=(",", ":")).encode() if body is None else body
    headers = {"Content-Type": "application/json", "webhook-timestamp": "1714564800"}
    if webhook_id is not None:
        headers["webhook-id"] = webhook_id
        headers["webhook-signature"] = signed(webhook_id, 1714564800, raw)
    async with http.post(url, data=raw, headers=headers) as response:
        return response.status, await response.json()


async def get_events(http: aiohttp.ClientSession, mail: FakeMailServer) -> list[dict[str, Any]]:
    async with http.get(mail.base_url + "/_events") as response:
        assert response.status == 200
        events: list[dict[str, Any]] = await response.json()
        return events


async def test_events_url_is_the_base_url_and_events_path(mail: FakeMailServer) -> None:
    assert mail.events_url == mail.base_url + EVENTS_PATH == mail.base_url + "/v1/events"


async def test_same_webhook_id_twice_is_one_event_line_with_headers_and_raw_body(
    mail: FakeMailServer, http: aiohttp.ClientSession, mailbox: Path
) -> None:
    first, line = await sent_twice(post_event, http, mail, mail.events_url, "evt-1")
    raw = json.dumps(EVENT, separators=(",", ":"))
    assert line == {
        "kind": "event",
        "idempotency_key": "evt-1",
        "id": first[1]["id"],
        "type": "summary.ready",
        "data": {"job": "j-1"},
        "timestamp": "2024-05-01T12:00:00Z",
        "headers": {
            "webhook-id": "evt-1",
            "webhook-timestamp": "1714564800",
            "webhook-signature": signed("evt-1", 1714564800, raw.encode()),
        },
        "body": raw,
        "received_at": line["received_at"],
    }
    assert line["received_at"]


async def test_events_route_answers_what_a_receiver_needs_to_check_signatures(
    mail: FakeMailServer, http: aiohttp.ClientSession
) -> None:
    await post_event(http, mail.events_url, "evt-sig")

    [event] = await get_events(http, mail)

    headers = event["headers"]
    timestamp = int(headers["webhook-timestamp"])
    expected = signed(headers["webhook-id"], timestamp, event["body"].encode())
    assert headers["webhook-signature"] == expected
    assert await mail.events() == [event]


async def test_events_and_emails_are_counted_together(
    mail: FakeMailServer, http: aiohttp.ClientSession, mailbox: Path
) -> None:
    await post_message(http, mail.url, "k-mail")
    await post_event(http, mail.events_url, "evt-1")
    await post_event(http, mail.events_url, "evt-1")

    assert await mail.deliveries() == {
        "requests": 3,
        "effects": 2,
        "by_key": {"k-mail": 1, "evt-1": 2},
    }
    assert [line["kind"] for line in mailbox_lines(mailbox)] == ["email", "event"]
    assert [event["idempotency_key"] for event in await get_events(http, mail)] == ["evt-1"]


async def test_an_event_and_an_email_with_the_same_key_are_two_effects(
    mail: FakeMailServer, http: aiohttp.ClientSession, mailbox: Path
) -> None:
    email = await post_message(http, mail.url, "same")
    event = await post_event(http, mail.events_url, "same")

    assert (email[0], event[0]) == (201, 201)
    assert email[1]["id"] != event[1]["id"]
    assert await mail.deliveries() == {"requests": 2, "effects": 2, "by_key": {"same": 2}}


async def test_missing_webhook_id_is_rejected_with_no_effect(
    mail: FakeMailServer, http: aiohttp.ClientSession, mailbox: Path
) -> None:
    status, body = await post_event(http, mail.events_url, None)

    assert (status, body) == (400, {"error": "webhook-id header is required"})
    assert await mail.deliveries() == {"requests": 1, "effects": 0, "by_key": {}}
    assert mailbox_lines(mailbox) == []


@pytest.mark.parametrize("body", [b"[1, 2]", b'"text"', b"{not json", b"\xff\xfe"])
async def test_event_body_that_is_not_a_json_object_is_rejected_with_no_effect(
    mail: FakeMailServer, http: aiohttp.ClientSession, mailbox: Path, body: bytes
) -> None:
    status, _ = await post_event(http, mail.events_url, "evt-bad", body)

    assert status == 400
    assert (await mail.deliveries())["effects"] == 0
    assert mailbox_lines(mailbox) == []


async def test_any_json_object_is_an_event_with_null_for_missing_fields(
    mail: FakeMailServer, http: aiohttp.ClientSession
) -> None:
    status, _ = await post_event(http, mail.events_url, "evt-any", b'{"hello": "world"}')

    [event] = await get_events(http, mail)
    assert status == 201
    assert (event["type"], event["data"], event["timestamp"]) == (None, None, None)
    assert event["body"] == '{"hello": "world"}'


async def test_fail_next_applies_to_events_too(
    mail: FakeMailServer, http: aiohttp.ClientSession
) -> None:
    await script(http, mail, fail_next=2, status=503)

    statuses = [(await post_event(http, mail.events_url, "evt-retry"))[0] for _ in range(3)]

    assert statuses == [503, 503, 201]
    assert await mail.deliveries() == {"requests": 3, "effects": 1, "by_key": {"evt-retry": 3}}
    assert len(await get_events(http, mail)) == 1


async def test_events_without_a_mailbox_are_kept_in_memory_until_reset(
    http: aiohttp.ClientSession,
) -> None:
    async with FakeMailServer() as mail:
        await post_event(http, mail.events_url, "evt-1")
        await post_event(http, mail.events_url, "evt-2")
        await post_message(http, mail.url, "k-mail")

        assert [e["idempotency_key"] for e in await get_events(http, mail)] == ["evt-1", "evt-2"]
        async with http.post(mail.base_url + "/_reset") as response:
            assert response.status == 200
        assert await get_events(http, mail) == []


async def test_reset_forgets_events_in_the_mailbox(
    mail: FakeMailServer, http: aiohttp.ClientSession, mailbox: Path
) -> None:
    await post_event(http, mail.events_url, "evt-1")

    async with http.post(mail.base_url + "/_reset") as response:
        assert response.status == 200

    assert await get_events(http, mail) == []
    assert (await post_event(http, mail.events_url, "evt-1"))[0] == 201


async def test_restart_on_the_same_mailbox_keeps_deduping_events_and_emails(
    http: aiohttp.ClientSession, mailbox: Path
) -> None:
    async with FakeMailServer(mailbox) as before:
        _, email, _ = await post_message(http, before.url, "k-1")
        _, event = await post_event(http, before.events_url, "evt-1")
    async with FakeMailServer(mailbox) as after:
        email_again = await post_message(http, after.url, "k-1")
        event_again = await post_event(http, after.events_url, "evt-1")
        assert (await after.deliveries())["effects"] == 2
        assert [e["id"] for e in await get_events(http, after)] == [event["id"]]

    assert (email_again[0], email_again[1]["id"]) == (200, email["id"])
    assert (event_again[0], event_again[1]["id"]) == (200, event["id"])
    assert [line["kind"] for line in mailbox_lines(mailbox)] == ["email", "event"]


async def test_mailbox_lines_without_a_kind_are_recovered_as_emails(
    http: aiohttp.ClientSession, mailbox: Path
) -> None:
    write_line_without_kind(mailbox, "k-old", "msg_old")

    async with FakeMailServer(mailbox) as mail:
        email = await post_message(http, mail.url, "k-old")
        event = await post_event(http, mail.events_url, "k-old")

    assert (email[0], email[1]["id"]) == (200, "msg_old")
    assert event[0] == 201


def write_line_without_kind(mailbox: Path, key: str, message_id: str) -> None:
    """An email line as written before events existed."""
    line = {"idempotency_key": key, "id": message_id, **MESSAGE, "received_at": "earlier"}
    mailbox.write_text(json.dumps(line) + "\n")


# --- random faults ------------------------------------------------------------------


async def test_a_random_503_delivers_nothing_and_is_counted(
    http: aiohttp.ClientSession, mailbox: Path
) -> None:
    async with FakeMailServer(mailbox, faults={"503": 1.0}) as mail:
        status, body, _ = await post_message(http, mail.url, "k-down")
        deliveries = await mail.deliveries()

    assert (status, body["error"]) == (503, "injected fault (random)")
    assert deliveries == {
        "requests": 1,
        "effects": 0,
        "by_key": {"k-down": 1},
        "faults": {"503": 1},
    }
    assert mailbox_lines(mailbox) == []


async def test_a_drop_delivers_then_closes_the_connection_without_an_answer(
    http: aiohttp.ClientSession, mailbox: Path
) -> None:
    async with FakeMailServer(mailbox, faults={"drop": 1.0}) as mail:
        for _ in range(2):
            with pytest.raises(aiohttp.ServerDisconnectedError):
                await post_message(http, mail.url, "k-dropped")
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await post_event(http, mail.events_url, "evt-dropped")
        deliveries = await mail.deliveries()

    assert (deliveries["requests"], deliveries["effects"]) == (3, 2)
    assert deliveries["faults"] == {"drop": 3}
    keys = [line["idempotency_key"] for line in mailbox_lines(mailbox)]
    assert keys == ["k-dropped", "evt-dropped"]


async def test_the_relays_sender_hears_a_drop_as_a_transient_failure_and_a_resend_is_one_effect(
    mailbox: Path,
) -> None:
    email = Email(to="ada@example.com", subject="Hello", text="Once.")
    async with FakeMailServer(mailbox, faults={"drop": 1.0}) as mail:
        sender = HttpEmailSender(mail.url, timeout_s=2.0)
        try:
            for _ in range(2):
                with pytest.raises(TransientError):
                    await sender.send(email, "summary_ready:job-1")
        finally:
            await sender.aclose()
        deliveries = await mail.deliveries()

    assert (deliveries["requests"], deliveries["effects"]) == (2, 1)
    assert len(mailbox_lines(mailbox)) == 1


async def test_a_timeout_holds_the_request_past_the_client_and_then_delivers(
    http: aiohttp.ClientSession, mailbox: Path
) -> None:
    async with FakeMailServer(mailbox, faults={"timeout": 1.0}, hold_s=0.4) as mail:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.1):
                await post_message(http, mail.url, "k-held")
        assert mailbox_lines(mailbox) == []
        await asyncio.sleep(0.5)
        deliveries = await mail.deliveries()

    assert (deliveries["effects"], deliveries["faults"]) == (1, {"timeout": 1})
    assert [line["idempotency_key"] for line in mailbox_lines(mailbox)] == ["k-held"]


async def test_random_faults_are_reproducible_per_key_with_a_seed(
    http: aiohttp.ClientSession,
) -> None:
    rates = {"503": 0.5}

    async def statuses(seed: int, keys: list[str]) -> dict[str, list[int]]:
        seen: dict[str, list[int]] = {}
        async with FakeMailServer(faults=rates, seed=seed) as mail:
            for key in keys:
                status, _, _ = await post_message(http, mail.url, key)
                seen.setdefault(key, []).append(status)
        return seen

    keys = [f"k-{n % 5}" for n in range(30)]
    first = await statuses(7, keys)
    again = await statuses(7, sorted(keys))
    other = await statuses(8, keys)

    assert first == again
    assert first != other
    assert {s for seen in first.values() for s in seen} == {503, 201, 200}


async def test_a_scripted_fault_wins_over_a_random_one(
    http: aiohttp.ClientSession,
) -> None:
    async with FakeMailServer(faults={"drop": 1.0}) as mail:
        await script(http, mail, fail_next=1, status=429)
        status, _, _ = await post_message(http, mail.url, "k-scripted")
        deliveries = await mail.deliveries()

    assert status == 429
    assert (deliveries["effects"], deliveries["faults"]) == (0, {})


def test_fake_mail_command_refuses_unknown_faults_as_a_usage_error() -> None:
    result = CliRunner().invoke(cli, ["fake-mail", "--faults", "429=0.1"])

    assert result.exit_code == 2
    assert "unknown fault '429'" in result.output
