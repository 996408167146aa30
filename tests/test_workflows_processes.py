"""Both built-in workflows side by side in one deployment, through real
`oncely api`, `worker` and `relay` processes; operator commands per workflow;
and a third workflow from `examples/` loaded with `--app`."""

from __future__ import annotations

import asyncio
import json

import pytest

from oncely.api.auth import create_api_key
from oncely.senders.webhook import verify
from tests.helpers import mailbox_lines, scalar
from tests.processes import SECRET, Deployment, deployment_env, oncely, wait_for

pytestmark = pytest.mark.slow

SUMMARY = {"text": "Retries are safe. Effects happen once.", "notify": "ada@example.com"}
TICKET = {
    "subject": "Urgent: refund for a double charge",
    "body": "My billing statement shows the same order twice. Please refund one.",
}


async def test_summaries_and_triage_side_by_side_each_with_one_effect(
    redis_url, database_url, api_key, redis, pool, providers, tmp_path
):
    model, mail = providers
    env = deployment_env(redis_url, database_url, model, mail)
    with Deployment(env, tmp_path) as d:
        async with d.client(api_key) as client:
            posts = {}
            for route, body in (("/v1/summaries", SUMMARY), ("/v1/triage", TICKET)):
                headers = {"Idempotency-Key": f"side-by-side-{route[4:]}-0001"}
                first = await client.post(route, json=body, headers=headers)
                again = await client.post(route, json=body, headers=headers)
                reused = await client.post(
                    route,
                    json={**body, **{k: v + "!" for k, v in body.items() if k != "notify"}},
                    headers=headers,
                )
                assert first.status_code == 202, first.text
                assert again.status_code in (202, 409)
                assert reused.status_code == 422
                assert reused.json()["type"].endswith("/idempotency-key-reused")
                posts[route] = first.json()["job_id"]
            assert posts["/v1/summaries"] != posts["/v1/triage"]

            async def both_delivered() -> bool:
                return (await mail.deliveries())["effects"] == 2

            await wait_for(both_delivered, what="one email and one webhook")
            summary = (await client.get(f"/v1/summaries/{posts['/v1/summaries']}")).json()
            triage = (await client.get(f"/v1/triage/{posts['/v1/triage']}")).json()
            crossed = await client.get(f"/v1/triage/{posts['/v1/summaries']}")

    assert summary["status"] == "done" and summary["summary"]
    assert summary["usage"]["model_calls"] == 1 and summary["usage"]["prompt_tokens"] > 0
    assert triage["status"] == "done"
    assert triage["result"]["category"] == "billing"
    assert triage["result"]["priority"] == "urgent"
    assert crossed.status_code == 404, "a job is read through its own workflow's route"
    assert await scalar(pool, "SELECT count(*) FROM jobs") == 2
    assert await scalar(pool, "SELECT count(*) FROM results") == 2
    deliveries = await mail.deliveries()
    assert deliveries["requests"] == 2
    triage_id = posts["/v1/triage"]
    assert set(deliveries["by_key"]) == {
        f"summary_ready:{posts['/v1/summaries']}",
        f"ticket_triaged:{triage_id}",
    }
    lines = mailbox_lines(tmp_path / "mailbox.jsonl")
    [event] = [line for line in lines if line["kind"] == "event"]
    assert verify(SECRET, event["headers"], event["body"].encode())
    assert not verify(
        "whsec_" + "b3RoZXItc2VjcmV0LTEyMzQ1Njc4OTA=", event["headers"], event["body"].encode()
    )
    body = json.loads(event["body"])
    assert body["type"] == "ticket.triaged"
    assert body["data"]["job_id"] == triage_id
    assert body["data"]["category"] == "billing"
    assert model.stats().total == 2, model.stats()


async def test_dead_triage_job_is_replayed_by_the_cli_and_status_reports_per_workflow(
    redis_url, database_url, api_key, redis, pool, providers, tmp_path
):
    model, mail = providers
    env = deployment_env(redis_url, database_url, model, mail)
    ticket = {"subject": "Broken", "body": "Garbage, then fine. [[fake:400*1]]"}
    with Deployment(env, tmp_path) as d:
        async with d.client(api_key) as c:
            r = await c.post(
                "/v1/triage", json=ticket, headers={"Idempotency-Key": "dead-then-replayed"}
            )
            job_id = r.json()["job_id"]

            async def status_is(expected: str) -> bool:
                return bool((await c.get(f"/v1/triage/{job_id}")).json()["status"] == expected)

            await wait_for(lambda: status_is("dead"), what="the job dead-lettered")
            listed = await asyncio.to_thread(oncely, "dlq", "list", "--json", env=env)
            assert listed.returncode == 0, listed.stderr
            [letter] = json.loads(listed.stdout)
            assert (letter["workflow"], letter["job_id"]) == ("triage", job_id)
            assert letter["reason"] == "permanent" and "400" in letter["last_error"]
            status = await asyncio.to_thread(oncely, "status", "--json", env=env)
            report = json.loads(status.stdout)
            assert report["workflows"]["triage"]["dead_letters"] == 1
            assert report["workflows"]["triage"]["jobs"]["dead"] == 1
            assert report["workflows"]["summaries"]["dead_letters"] == 0

            replayed = await asyncio.to_thread(
                oncely, "dlq", "replay", letter["dead_id"], "--workflow", "triage", env=env
            )
            assert replayed.returncode == 0, replayed.stderr
            await wait_for(lambda: status_is("done"), what="the replayed job done")

            async def delivered() -> bool:
                return (await mail.deliveries())["effects"] == 1

            await wait_for(delivered, what="its webhook")
    assert model.stats(contains="Garbage").prompts[0].count == 2
    status = json.loads((await asyncio.to_thread(oncely, "status", "--json", env=env)).stdout)
    assert status["workflows"]["triage"]["dead_letters"] == 0
    assert status["workflows"]["triage"]["jobs"] == {
        "queued": 0,
        "held": 0,
        "waiting": 0,
        "done": 1,
        "dead": 0,
        "cancelled": 0,
    }


async def test_the_example_workflow_runs_through_processes_started_with_app(
    redis_url, database_url, redis, pool, providers, tmp_path
):
    """examples/refunds.py: a clear refund is decided by the model at once; an
    unclear one asks a person, waits for the approval event, and is decided
    by it. One signed webhook per effect."""
    model, mail = providers
    key = await create_api_key(pool, "shop")
    env = deployment_env(redis_url, database_url, model, mail)
    clear = {"order_id": "A-1001", "amount_cents": 2599, "reason": "Arrived damaged: approve?"}
    unclear = {"order_id": "B-2002", "amount_cents": 9900, "reason": "Please escalate: odd case."}
    with Deployment(env, tmp_path, app="examples.refunds:app") as d:
        async with d.client(key) as c:
            builtin = await c.post(
                "/v1/summaries", json=SUMMARY, headers={"Idempotency-Key": "not-served-here-01"}
            )
            jobs = {}
            for name, body in (("clear", clear), ("unclear", unclear)):
                r = await c.post(
                    "/v1/refunds", json=body, headers={"Idempotency-Key": f"refund-{name}-first"}
                )
                assert r.status_code == 202, r.text
                jobs[name] = r.json()["job_id"]

            async def asked_for_approval() -> bool:
                job = (await c.get(f"/v1/refunds/{jobs['unclear']}")).json()
                return bool(job["status"] == "waiting")

            await wait_for(asked_for_approval, what="the unclear refund waiting")
            event = await c.post(
                f"/v1/refunds/{jobs['unclear']}/events/approval",
                json={"approved": True, "by": "ada", "note": "goodwill"},
                headers={"Idempotency-Key": "approval-B-2002-01"},
            )
            assert event.status_code == 202, event.text

            async def delivered() -> bool:
                return (await mail.deliveries())["effects"] == 3

            await wait_for(delivered, what="three refund webhooks")
            done = {
                name: (await c.get(f"/v1/refunds/{job_id}")).json() for name, job_id in jobs.items()
            }
    assert builtin.status_code == 404, "the example app serves only its own workflow"
    clear = done["clear"]["result"]
    assert (clear["decision"], clear["decided_by"]) == ("approve", "model")
    assert clear["note"], "the model's note"
    assert done["unclear"]["result"] == {
        "decision": "approve",
        "note": "goodwill",
        "decided_by": "person",
    }
    assert [s["key"] for s in done["unclear"]["steps"]] == ["model", "approval"]
    lines = mailbox_lines(tmp_path / "mailbox.jsonl")
    ids = sorted(line["headers"]["webhook-id"] for line in lines)
    assert ids == sorted(
        [
            f"refund.decided:{jobs['clear']}",
            f"refund.approval_requested:{jobs['unclear']}",
            f"refund.decided:{jobs['unclear']}",
        ]
    )
    for line in lines:
        assert verify(SECRET, line["headers"], line["body"].encode())
    assert model.stats().total == 2  # one review each; the wait cost no call
    assert await scalar(pool, "SELECT DISTINCT kind FROM jobs") == "refunds"
