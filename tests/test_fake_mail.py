"""The fake mail provider dedupes like a real one and scripts faults for tests."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from oncely.fakes.mail import FakeMailServer, serve_fake_mail

MESSAGE = {"to": "ada@example.com", "subject": "Hello", "text": "Your summary."}


@pytest.fixture
def mailbox(tmp_path: Path) -> Path:
    return tmp_path / "mailbox.jsonl"


@pytest.fixture
async def mail(mailbox: Path) -> AsyncIterator[FakeMailServer]:
    async with FakeMailServer(mailbox) as server:
        yield server


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


def mailbox_lines(mailbox: Path) -> list[dict[str, Any]]:
    if not mailbox.exists():
        return []
    return [json.loads(line) for line in mailbox.read_text().splitlines()]


async def test_same_key_twice_is_one_effect_with_one_message_id(
    mail: FakeMailServer, http: aiohttp.ClientSession, mailbox: Path
) -> None:
    first = await post_message(http, mail.url, "k-1")
    second = await post_message(http, mail.url, "k-1")

    assert (first[0], second[0]) == (201, 200)
    assert first[1]["id"] == second[1]["id"]
    assert await mail.deliveries() == {"requests": 2, "effects": 1, "by_key": {"k-1": 2}}
    [line] = mailbox_lines(mailbox)
    assert line["idempotency_key"] == "k-1"
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
