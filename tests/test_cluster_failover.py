"""A Redis Cluster primary killed under load (README: Redis Cluster): its
replica takes over, and every accepted request is still one job, one result
and one email.

The module starts its own cluster, three primaries with a replica each and
a node timeout of 1 s, in every run. Real api, worker and relay processes
run against it while clients post, each retrying its key until accepted;
the primary serving the summaries stream's slot is SIGKILLed mid-load.
Writes it had answered but not yet passed to its replica are lost with it:
the reconciler re-enqueues a job whose stream entry is gone, and a retried
key whose idempotency record is gone finds its job row (a replay).
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis as sync_redis
from psycopg_pool import AsyncConnectionPool
from redis.crc import key_slot

from oncely.api.auth import create_api_key
from oncely.builtin.summaries import summaries
from oncely.embedded import EmbeddedCluster
from oncely.fakes.llm import FakeLLMServer
from oncely.fakes.mail import FakeMailServer
from tests.helpers import count
from tests.processes import (
    free_port,
    later,
    running,
    start,
    submit_until_accepted,
    tail,
    wait_for,
    wait_healthy,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SLOT = key_slot(summaries.keys.stream.encode())
REQUESTS = 40


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedCluster]:
    nodes = EmbeddedCluster(
        tmp_path_factory.mktemp("failover-cluster"),
        replicas=1,
        full_coverage=False,
        node_timeout_ms=1000,
    )
    nodes.start()
    yield nodes
    nodes.stop()


def _role(url: str) -> str:
    with sync_redis.Redis.from_url(url, decode_responses=True, socket_timeout=2) as node:
        return str(node.info("replication")["role"])


async def test_a_primary_killed_mid_load_fails_over_and_every_job_happens_once(
    cluster: EmbeddedCluster, database_url: str, pool: AsyncConnectionPool, tmp_path: Path
) -> None:
    victim = cluster.primary_urls.index(cluster.url_of_slot_owner(SLOT))
    replica = cluster.urls[cluster.size + victim]
    assert _role(replica) == "slave"
    key = await create_api_key(pool, "acme")
    port = free_port()
    async with FakeLLMServer() as model, FakeMailServer() as mail:
        env = {
            # A node that stays up; the client learns the others from it.
            "ONCELY_REDIS_URL": cluster.url_not_owning(SLOT),
            "ONCELY_REDIS_CLUSTER": "true",
            "ONCELY_DATABASE_URL": database_url,
            "ONCELY_LLM_BASE_URL": model.url,
            "ONCELY_SENDER_URL": mail.url,
            "ONCELY_LOG_FORMAT": "json",
            "ONCELY_BLOCK_MS": "50",
            "ONCELY_RECONCILE_AFTER_S": "2",
            "ONCELY_CLAIM_IDLE_MS": "3000",
            "ONCELY_REDELIVERY_BASE_S": "0.5",
            "ONCELY_REDELIVERY_MAX_S": "2",
            "ONCELY_RELAY_POLL_S": "0.5",
            "ONCELY_REDIS_TIMEOUT_S": "2",
            "ONCELY_CONNECT_TIMEOUT_S": "2",
        }
        names = ("api.log", "worker.log", "relay.log")
        procs = [
            start(["api", "--port", str(port)], env, tmp_path / names[0]),
            start(["worker"], env, tmp_path / names[1]),
            start(["relay"], env, tmp_path / names[2]),
        ]
        base = f"http://127.0.0.1:{port}"
        with running(*procs):
            await wait_healthy(base, procs[0], tmp_path / names[0])
            async with httpx.AsyncClient(
                base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=30
            ) as client:
                load = [
                    asyncio.create_task(
                        later(i * 0.1, submit_until_accepted(client, i, "cluster-failover"))
                    )
                    for i in range(REQUESTS)
                ]

                async def some_delivered() -> bool:
                    for task in load:  # a client that failed fails the test now
                        if task.done():
                            task.result()
                    return (await mail.deliveries())["effects"] >= 5

                await wait_for(some_delivered, within_s=60, what="the first emails")
                with sync_redis.Redis.from_url(cluster.primary_urls[victim]) as node:
                    pid = int(node.info("server")["process_id"])
                os.kill(pid, signal.SIGKILL)

                async def promoted() -> bool:
                    return await asyncio.to_thread(_role, replica) == "master"

                await wait_for(promoted, within_s=60, what="the replica taking over")
                accepted = await asyncio.gather(*load)

            async def all_delivered() -> bool:
                return (await mail.deliveries())["effects"] >= len(set(accepted))

            await wait_for(all_delivered, within_s=120, what="every accepted job's email")
            alive = [p.poll() is None for p in procs]
        assert all(alive), [tail(tmp_path / n) for n in names]
        deliveries = await mail.deliveries()
        model_calls = model.stats().total
    assert len(set(accepted)) == REQUESTS, "one job per key"
    assert await count(pool, "SELECT count(*) FROM jobs") == REQUESTS
    assert await count(pool, "SELECT count(*) FROM jobs WHERE status = 'done'") == REQUESTS
    assert await count(pool, "SELECT count(*) FROM results") == REQUESTS
    assert await count(pool, "SELECT count(*) FROM outbox") == REQUESTS
    assert deliveries["effects"] == REQUESTS, "one email per job, none twice"
    assert set(deliveries["by_key"]) == {f"summary_ready:{j}" for j in accepted}
    # A job whose delivery was lost mid-call may be called twice, no more.
    assert REQUESTS <= model_calls <= REQUESTS * 2
