"""A Redis Cluster primary killed under load (docs/production.md, Redis Cluster): its
replica takes over, and every accepted request is still one job, one result
and one email.

The module starts its own cluster, three primaries with a replica each and
a node timeout of 1 s, in every run. Real api, worker and relay processes
run against it while clients post, each retrying its key until accepted;
the primary serving the summaries stream's slot is SIGKILLed mid-load.
Writes it had answered but not yet passed to its replica are lost with it:
the reconciler re-enqueues a job whose stream entry is gone, and a retried
key whose idempotency record is gone finds its job row (a replay). With the
reconciler's and the claim's default times, every email is out within a
minute of the promotion.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as sync_redis
from redis.crc import key_slot

from oncely.builtin.summaries import summaries
from oncely.embedded import EmbeddedCluster
from tests.processes import wait_for
from tests.under_load import every_job_once_under

pytestmark = [pytest.mark.slow, pytest.mark.soak, pytest.mark.timeout(240)]

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
    cluster: EmbeddedCluster, database_url: str, tmp_path: Path
) -> None:
    victim = cluster.primary_urls.index(cluster.url_of_slot_owner(SLOT))
    replica = cluster.urls[cluster.size + victim]
    assert _role(replica) == "slave"

    async def fail_over() -> None:
        with sync_redis.Redis.from_url(cluster.primary_urls[victim]) as node:
            pid = int(node.info("server")["process_id"])
        os.kill(pid, signal.SIGKILL)

        async def promoted() -> bool:
            return await asyncio.to_thread(_role, replica) == "master"

        await wait_for(promoted, within_s=60, what="the replica taking over")

    await every_job_once_under(
        fail_over,
        database_url=database_url,
        # A node that stays up; the processes learn the others from it.
        redis_env={
            "ONCELY_REDIS_URL": cluster.url_not_owning(SLOT),
            "ONCELY_REDIS_CLUSTER": "true",
        },
        tmp_path=tmp_path,
        label="cluster-failover",
        requests=REQUESTS,
        workers=1,
        # With the defaults a deployment runs with (docs/production.md,
        # "Failover"): every accepted job done within a minute of the
        # promotion, the lost ones re-dispatched by the reconciler.
        defaults=("ONCELY_RECONCILE_AFTER_S", "ONCELY_CLAIM_IDLE_MS"),
        recovered_within_s=60,
    )
