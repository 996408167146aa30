"""One Redis Cluster node lost, no replica to take over yet (docs/production.md,
"Failover"): only the work whose keys it held stalls.

The node serving the summaries stream also serves the fleet limiter's
`{limiter}` slot, every model call's pause key. It is SIGKILLed and its
replica frozen (SIGSTOP), so its slots stay unserved. Triage, whose stream
lives on another node, keeps running: its jobs are accepted and done while
the node is gone (the limiter failing open to the local limit). Then the
replica is let go, takes over, and the summaries jobs accepted before the
loss are done too, each once.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
import redis as sync_redis
from psycopg_pool import AsyncConnectionPool
from redis.crc import key_slot

from oncely import names
from oncely.api.auth import create_api_key
from oncely.builtin import summaries, triage
from oncely.embedded import EmbeddedCluster
from oncely.fakes.llm import FakeLLMServer
from oncely.fakes.mail import FakeMailServer
from oncely.identity import Scope
from tests.helpers import all_done
from tests.processes import Deployment, wait_for
from tests.test_cluster_failover import _role, cluster

pytestmark = [pytest.mark.slow, pytest.mark.soak, pytest.mark.timeout(300)]

SUMMARIES = key_slot(summaries.keys.stream.encode())
TRIAGE = key_slot(triage.keys.stream.encode())
LIMITER = key_slot(names.LLM_PAUSE.encode())

__all__ = ["cluster"]  # the failover tests' cluster, one of its own for this module


def _pid(url: str) -> int:
    with sync_redis.Redis.from_url(url, socket_timeout=2) as node:
        return int(node.info("server")["process_id"])


def _keys_served_elsewhere(cluster: EmbeddedCluster, victim: str, route: str, n: int) -> list[str]:
    """Idempotency keys whose records live on a node other than ``victim``
    (a request whose record the lost node held is refused 503, as it
    should be: that is its own key's node)."""
    found = []
    for i in range(1000):
        key = f"partial-outage-{route.strip('/').replace('/', '-')}-{i:04d}"
        digest = Scope("acme", "POST", route, key).digest
        if cluster.url_of_slot_owner(key_slot(names.idempotency_key(digest).encode())) != victim:
            found.append(key)
        if len(found) == n:
            return found
    raise AssertionError("not enough keys served elsewhere")


async def test_a_lost_node_stalls_only_the_work_whose_keys_it_held(
    cluster: EmbeddedCluster, database_url: str, tmp_path: Path
) -> None:
    victim = cluster.url_of_slot_owner(SUMMARIES)
    if cluster.url_of_slot_owner(LIMITER) != victim or cluster.url_of_slot_owner(TRIAGE) == victim:
        pytest.skip("the slots' layout changed: this test needs summaries and the limiter together")
    replica = cluster.urls[cluster.size + cluster.primary_urls.index(victim)]
    async with (
        FakeLLMServer() as model,
        FakeMailServer() as mail,
        AsyncConnectionPool(database_url, open=False, kwargs={"autocommit": True}) as pool,
    ):
        await pool.open(wait=True)
        key = await create_api_key(pool, "acme")
        env = {
            "ONCELY_REDIS_URL": cluster.url_not_owning(SUMMARIES),
            "ONCELY_REDIS_CLUSTER": "true",
            "ONCELY_DATABASE_URL": database_url,
            "ONCELY_LLM_BASE_URL": model.url,
            "ONCELY_SENDER_URL": mail.url,
            "ONCELY_WEBHOOK_URL": mail.events_url,
            "ONCELY_WEBHOOK_SECRET": "whsec_" + "c2VjcmV0LWZvci10ZXN0cy1vbmx5LTEyMzQ1Njc4",
            "ONCELY_LOG_FORMAT": "json",
        }
        with Deployment(env, tmp_path) as d:
            async with d.client(key, timeout=30) as client:
                # Summaries accepted before the loss: their stream is on the victim.
                before = []
                for k in _keys_served_elsewhere(cluster, victim, "/v1/summaries", 3):
                    body = {
                        "text": f"Before the loss {k}. [[fake:sleep=2]]",
                        "notify": "a@x.io",
                    }
                    r = await client.post(
                        "/v1/summaries", json=body, headers={"Idempotency-Key": k}
                    )
                    assert r.status_code == 202, r.text
                    before.append(r.json()["job_id"])

                replica_pid = _pid(replica)
                os.kill(replica_pid, signal.SIGSTOP)  # frozen: no one takes over
                os.kill(_pid(victim), signal.SIGKILL)
                try:
                    during = []
                    for k in _keys_served_elsewhere(cluster, victim, "/v1/triage", 5):
                        body = {"subject": f"Lost node {k}", "body": "Triage still runs."}
                        for _ in range(100):
                            r = await client.post(
                                "/v1/triage", json=body, headers={"Idempotency-Key": k}
                            )
                            if r.status_code == 202:
                                break
                            assert r.status_code in (409, 503), r.text
                            await asyncio.sleep(0.2)
                        assert r.status_code == 202, r.text
                        during.append(r.json()["job_id"])

                    # While the node is still gone: nothing of triage's was on it.
                    await wait_for(
                        lambda: all_done(pool, during),
                        within_s=120,
                        what="triage done without the node",
                    )
                finally:
                    os.kill(replica_pid, signal.SIGCONT)

                async def promoted() -> bool:
                    return await asyncio.to_thread(_role, replica) == "master"

                await wait_for(promoted, within_s=60, what="the replica taking over")

                await wait_for(
                    lambda: all_done(pool, before), within_s=120, what="the stalled summaries done"
                )

                async def all_effects() -> bool:
                    return (await mail.deliveries())["effects"] >= len(before) + len(during)

                await wait_for(all_effects, within_s=120, what="every job's effect")
                deliveries = await mail.deliveries()
        worker_log = (tmp_path / "worker-0.log").read_text()
    assert "limiter.fail_open" in worker_log, "the limiter's node was gone: calls paced locally"
    # One effect per job, each once, whatever the loss cost on the way.
    assert deliveries["effects"] == len(before) + len(during)
    assert len(deliveries["by_key"]) == len(before) + len(during)
    assert all(n == 1 for n in deliveries["by_key"].values()), deliveries["by_key"]
