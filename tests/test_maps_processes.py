"""A 40-item map through real `oncely api`, `worker` and `relay` processes
while workers are SIGKILLed and restarted (docs/fanout.md): no child is
started twice (40 child rows, one model checkpoint each), every child's
webhook and the parent's are delivered once, and the parent ends done once
with every result in item order."""

from __future__ import annotations

import asyncio
import random
import signal
from typing import Any

import httpx
import pytest

from oncely.api.auth import create_api_key
from tests.helpers import scalar, webhook_events
from tests.processes import deployment_env, free_port, running, start, wait_for, wait_healthy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


APP = "tests.maps_app:app"


async def test_a_map_survives_sigkilled_workers_with_each_child_once(
    redis_url, database_url, pool, providers, tmp_path
):
    model, mail = providers
    key = await create_api_key(pool, "acme")
    port = free_port()
    env = deployment_env(
        redis_url,
        database_url,
        model,
        mail,
        ONCELY_CLAIM_IDLE_MS="1500",
        ONCELY_RECONCILE_AFTER_S="3",
        ONCELY_REDELIVERY_BASE_S="0.5",
        ONCELY_REDELIVERY_MAX_S="2",
    )
    api = start(["--app", APP, "api", "--port", str(port)], env, tmp_path / "api.log")
    relay = start(["--app", APP, "relay"], env, tmp_path / "relay.log")
    logs = iter(range(1000))

    def spawn() -> Any:
        return start(["--app", APP, "worker"], env, tmp_path / f"worker{next(logs)}.log")

    workers = [spawn(), spawn()]
    rng = random.Random(11)
    base = f"http://127.0.0.1:{port}"
    texts = [f"Item {n} of the batch. [[fake:sleep=0.3]] Its second sentence." for n in range(40)]
    try:
        await wait_healthy(base, api, tmp_path / "api.log")
        async with httpx.AsyncClient(
            base_url=base, headers={"Authorization": f"Bearer {key}"}
        ) as client:
            r = await client.post(
                "/v1/batches",
                json={"texts": texts, "concurrency": 8},
                headers={"Idempotency-Key": "map-soak-000000001"},
            )
            assert r.status_code == 202, r.text
            parent = r.json()["job_id"]

            async def parent_done() -> bool:
                return (await client.get(f"/v1/batches/{parent}")).json()["status"] == "done"

            for _ in range(12):
                if await parent_done():
                    break
                await asyncio.sleep(0.4 + rng.random() / 2)
                victim = workers.pop(rng.randrange(len(workers)))
                victim.send_signal(signal.SIGKILL)
                victim.wait(10)
                workers.append(spawn())
            await wait_for(parent_done, within_s=240, what="the parent done")
            view = (await client.get(f"/v1/batches/{parent}")).json()

            async def delivered() -> bool:
                return (await mail.deliveries())["effects"] == 41

            await wait_for(delivered, within_s=120, what="41 webhooks")
    finally:
        with running(api, relay, *workers):
            pass

    assert view["result"]["statuses"] == ["done"] * 40
    assert view["result"]["said"] == [
        f"Item {n} of the batch. Its second sentence." for n in range(40)
    ]
    children = await scalar(
        pool, "SELECT count(DISTINCT job_id) FROM jobs WHERE parent_id = %s", parent
    )
    assert children == 40
    models = await scalar(
        pool,
        "SELECT (SELECT count(*) FROM results r JOIN jobs j USING (job_id),"
        "         jsonb_array_elements(r.steps) s"
        "        WHERE j.parent_id = %s AND s->>'kind' = 'model')"
        "     + (SELECT count(*) FROM checkpoints c JOIN jobs j USING (job_id)"
        "        WHERE j.parent_id = %s AND c.kind = 'model')",
        parent,
        parent,
    )
    assert models == 40, "one model checkpoint per child"
    by_key = (await mail.deliveries())["by_key"]
    assert sorted(k.split(":")[0] for k in by_key) == ["batch.done"] + ["item.said"] * 40
    events = webhook_events(tmp_path / "mailbox.jsonl")
    assert len(events) == 41, "each effect once at the receiver"
    assert await scalar(pool, "SELECT count(*) FROM job_maps WHERE parent_id = %s", parent) == 1
