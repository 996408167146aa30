"""At most once through real `oncely api`, `worker` and `relay` processes
(``--app tests.steps_app:app``): a worker SIGKILLed while a transfer no
receiver dedupes hangs after it happened. The transfer is never sent again
on its own: a person's word (API, CLI) or a reconcile function decides
(docs/at-most-once.md). Transfers are counted in the side-calls file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from oncely.api.auth import create_api_key
from tests.helpers import scalar, webhook_events
from tests.processes import Deployment, oncely, post, wait_for
from tests.steps_app import SIDE_CALLS, side_calls
from tests.test_durable_processes import env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

__all__ = ["env"]


def transfers(env: dict[str, str], order: str) -> int:
    return len([c for c in side_calls(Path(env[SIDE_CALLS]), "transfer") if c["text"] == order])


async def kill_mid_transfer(d: Deployment, env: dict[str, str], orders: list[str]) -> None:
    """Wait until every order's transfer happened (each hangs after it), then
    SIGKILL the worker and start another."""

    async def all_sent() -> bool:
        return all(transfers(env, o) == 1 for o in orders)

    await wait_for(all_sent, within_s=60, what="every transfer sent")
    d.kill_worker()
    d.workers.append(d.start_worker())


async def view(client: httpx.AsyncClient, job_id: str) -> dict[str, Any]:
    return dict((await client.get(f"/v1/transfers/{job_id}")).json())


async def until(client: httpx.AsyncClient, job_id: str, status: str) -> dict[str, Any]:
    found: dict[str, Any] = {}

    async def reached() -> bool:
        nonlocal found
        found = await view(client, job_id)
        return found["status"] == status

    await wait_for(reached, within_s=90, what=f"job {job_id} {status}")
    return found


async def test_a_transfer_whose_worker_died_is_decided_by_a_person_never_resent_alone(
    api_key, redis, pool, providers, env, tmp_path
):
    _, mail = providers
    other = await create_api_key(pool, "globex")
    orders = ["T-result", "T-resend", "T-failed", "T-cli"]
    with Deployment(env, tmp_path) as d:
        async with d.client(api_key) as client:
            ids = {
                o: await post(
                    client, "/v1/transfers", {"order": o, "hold_s": 600}, f"amo-intake-{o}"
                )
                for o in orders
            }
            await kill_mid_transfer(d, env, orders)
            waiting = {o: await until(client, ids[o], "waiting") for o in orders}
            # Taken over, and still not sent again.
            assert [transfers(env, o) for o in orders] == [1, 1, 1, 1]
            pending = {o: w["waiting"]["uncertain"] for o, w in waiting.items()}
            for o, p in pending.items():
                assert p["tool"] == "pay" and len(p["call_id"]) == 20
                assert p["arguments"] == {"order": o, "cents": 500, "hold_s": 600, "fail": False}

            async def decide(order: str, body: dict[str, Any], idem: str) -> httpx.Response:
                call = pending[order]["call_id"]
                return await client.post(
                    f"/v1/transfers/{ids[order]}/uncertain/{call}",
                    json=body,
                    headers={"Idempotency-Key": idem},
                )

            # Not the tenant's job, not a call of oncely's, not one body: refused.
            r = await client.post(
                f"/v1/transfers/{ids['T-result']}/uncertain/{pending['T-result']['call_id']}",
                json={"resend": True},
                headers={
                    "Idempotency-Key": "amo-other-tenant-1",
                    "Authorization": f"Bearer {other}",
                },
            )
            assert r.status_code == 404, r.text
            r = await client.post(
                f"/v1/transfers/{ids['T-result']}/uncertain/call_0",
                json={"resend": True},
                headers={"Idempotency-Key": "amo-bad-call-id-1"},
            )
            assert r.status_code == 404, r.text
            r = await decide("T-result", {"resend": True, "failed": "x"}, "amo-two-choices-1")
            assert r.status_code == 422, r.text

            manual = {"transfer": "found by hand"}
            first = await decide("T-result", {"result": manual}, "amo-decide-result-1")
            assert first.status_code == 202 and first.json()["status"] == "result", first.text
            again = await decide("T-result", {"result": manual}, "amo-decide-result-1")
            assert again.json() == first.json()
            r = await decide("T-resend", {"resend": True}, "amo-decide-resend-1")
            assert r.status_code == 202, r.text
            r = await decide(
                "T-failed", {"failed": "the bank has no such transfer"}, "amo-decide-failed-1"
            )
            assert r.status_code == 202, r.text
            # From the CLI, as an operator would.
            cli = oncely(
                "jobs",
                "resolve",
                ids["T-cli"],
                pending["T-cli"]["call_id"],
                "--result",
                '{"transfer": "cli"}',
                "--json",
                env=env,
            )
            assert cli.returncode == 0, cli.stderr
            assert json.loads(cli.stdout)["status"] == "result"

            done = {o: await until(client, ids[o], "done") for o in orders}
            # Another word on a decided call: 409 (the job is done by now).
            r = await decide("T-result", {"resend": True}, "amo-decide-again-1")
            assert r.status_code == 409, r.text

    assert done["T-result"]["result"] == {"outcome": "paid", "result": manual}
    assert done["T-resend"]["result"]["outcome"] == "paid"
    assert done["T-failed"]["result"] == {
        "outcome": "failed",
        "result": "pay: the bank has no such transfer",
    }
    assert done["T-cli"]["result"]["result"] == {"transfer": "cli"}
    # Who chose what stays on the job's steps (never the result they gave).
    [resolution] = [s["resolution"] for s in done["T-failed"]["steps"] if s["resolution"]]
    assert resolution["chose"] == "failed" and resolution["by"].startswith("key:")
    assert resolution["reason"] == "the bank has no such transfer"
    [resolution] = [s["resolution"] for s in done["T-cli"]["steps"] if s["resolution"]]
    assert resolution["chose"] == "result" and resolution["by"].startswith("cli:")
    # Each transfer once, but the one a person said to send again: twice.
    assert [transfers(env, o) for o in orders] == [1, 2, 1, 1]
    by = await scalar(
        pool,
        "SELECT payload->>'by' FROM job_events WHERE job_id = %s AND name LIKE 'uncertain:%%'",
        ids["T-cli"],
    )
    assert by.startswith("cli:")
    raised = webhook_events(tmp_path / "mailbox.jsonl", "uncertain.raised")
    assert sorted(e["data"]["job_id"] for e in raised) == sorted(ids.values())
    assert (await mail.deliveries())["effects"] == len(orders)


async def test_a_reconcile_function_decides_without_a_person(
    api_key, redis, pool, providers, env, tmp_path
):
    with Deployment(env, tmp_path) as d:
        async with d.client(api_key) as client:
            body = {"order": "T-reconciled", "reconcile": True, "hold_s": 600}
            job_id = await post(client, "/v1/transfers", body, "amo-reconcile-job-1")
            await kill_mid_transfer(d, env, ["T-reconciled"])
            done = await until(client, job_id, "done")

    assert done["result"] == {
        "outcome": "paid",
        "result": {"transfer": 1, "cents": 500, "found": True},
    }
    assert transfers(env, "T-reconciled") == 1
    assert sorted(s["key"] for s in done["steps"]) == ["pay", "pay/intent", "pay/reconcile"]
