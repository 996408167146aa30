"""oncely on a real three-node Valkey cluster (docs/production.md, Redis Cluster), in every
run: the module starts its own cluster, so a slot can be taken away
(``CLUSTER DELSLOTS``: the node then answers CLUSTERDOWN for it) and given
back without disturbing other tests. Clients are pointed at a node that
does not own the summaries stream's slot, so every stream command is MOVED.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import redis as sync_redis
from redis.crc import key_slot
from structlog.testing import capture_logs

from oncely.api.auth import create_api_key
from oncely.api.store import IdempotencyStore
from oncely.bootstrap import make_redis
from oncely.builtin.summaries import summaries
from oncely.embedded import EmbeddedCluster
from oncely.fakes.llm import FakeLLMServer
from oncely.fakes.mail import FakeMailServer
from oncely.jobs.reconcile import Reconciler
from oncely.names import tenant_digest as tenant_tag
from oncely.queue.stream import JobMessage, Stream
from oncely.queue.worker import Delivery
from oncely.redis_client import ClusterUnavailable, RedisClient
from oncely.settings import Settings
from tests.helpers import asgi_app, count, drain, job_status, make_worker, submit
from tests.processes import Deployment, free_port, oncely, wait_for, wait_healthy

SLOT = key_slot(summaries.keys.stream.encode())
# A key in a slot of its own, far from every workflow's: a step's Redis call
# that meets CLUSTERDOWN.
ELSEWHERE = "oncely:{elsewhere}:probe"
BODY = {"text": "Clusters route every key to its slot.", "notify": "ada@example.com"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedCluster]:
    # Not full coverage: a slot taken away leaves its node serving the others.
    nodes = EmbeddedCluster(tmp_path_factory.mktemp("private-cluster"), full_coverage=False)
    nodes.start()
    yield nodes
    nodes.stop()


@pytest.fixture
def redis_url(cluster: EmbeddedCluster) -> str:
    """Overrides conftest's: a node of this module's cluster that is MOVED for
    the summaries stream."""
    return cluster.url_not_owning(SLOT)


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[RedisClient]:
    client = make_redis(redis_url, cluster=True, timeout_s=2.0, connect_timeout_s=2.0)
    await client.flushdb()
    yield client
    await client.aclose()


@pytest.fixture
def settings(settings: Settings, redis_url: str) -> Settings:
    return settings.model_copy(update={"redis_url": redis_url, "redis_cluster": True})


class SlotsDown:
    """Takes ``slot`` (default: every slot) away from its owner and gives it
    back: meanwhile the cluster answers CLUSTERDOWN for every key in it."""

    def __init__(self, cluster: EmbeddedCluster, slot: int | None = None) -> None:
        ranges = cluster.slot_ranges if slot is None else [(slot, slot)]
        self._owners = [
            (sync_redis.Redis.from_url(cluster.url_of_slot_owner(first)), first, last)
            for first, last in ranges
        ]

    def __enter__(self) -> SlotsDown:
        for owner, first, last in self._owners:
            owner.cluster("DELSLOTSRANGE", first, last)
        return self

    def __exit__(self, *_: object) -> None:
        for owner, first, last in self._owners:
            owner.cluster("ADDSLOTSRANGE", first, last)
            owner.close()


async def test_the_node_handed_out_is_moved_for_the_stream_and_the_client_follows(
    redis_url, redis, stream
):
    plain = sync_redis.Redis.from_url(redis_url)
    with pytest.raises(sync_redis.exceptions.MovedError):
        plain.xlen(stream.stream)
    plain.close()
    await stream.ensure_group()
    entry = await stream.enqueue(JobMessage.new("job-1", "acme", {"text": "x"}))
    assert await stream.index_entries(["job-1"]) == [entry]


@pytest.fixture
async def client(settings, redis, pool, auth) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=asgi_app(settings, redis, pool))
    async with httpx.AsyncClient(transport=transport, base_url="http://t", headers=auth) as c:
        yield c


ACCEPTED = "SELECT count(*) FROM jobs WHERE status <> 'withdrawn'"


async def test_a_cluster_serving_no_slot_answers_503_and_the_same_request_is_accepted_once_after(
    cluster, client, pool, redis, stream
):
    headers = {"Idempotency-Key": "cluster-down-0001"}
    with SlotsDown(cluster):
        down = await client.post("/v1/summaries", json=BODY, headers=headers)
    assert down.status_code == 503, down.text
    assert down.headers["content-type"] == "application/problem+json"
    assert down.json()["type"].endswith("/problems/unavailable")
    assert down.headers["Retry-After"] == "1"
    assert await count(pool, ACCEPTED) == 0

    async def retry_accepted() -> bool:
        r = await client.post("/v1/summaries", json=BODY, headers=headers)
        return r.status_code == 202

    await wait_for(retry_accepted, 10, "the same request accepted")
    again = await client.post("/v1/summaries", json=BODY, headers=headers)
    assert again.status_code == 202
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert await count(pool, ACCEPTED) == 1
    assert await redis.xlen(stream.stream) == 1


async def test_with_only_the_streams_slot_down_the_row_is_accepted_and_reconciled_once_back(
    cluster, client, pool, redis, jobs, stream
):
    """The job row is the record of acceptance (docs/guarantees.md): an
    enqueue that met CLUSTERDOWN is redone by the process as soon as the
    slot is back (docs/production.md, "Failover"), once: the reconciler
    then has nothing to do."""
    headers = {"Idempotency-Key": "stream-slot-down-0001"}
    with SlotsDown(cluster, SLOT), capture_logs() as logs:
        r = await client.post("/v1/summaries", json=BODY, headers=headers)
    assert r.status_code == 202, r.text
    assert [e["error"] for e in logs if e["event"] == "jobs.enqueue_failed"] == [
        "ClusterUnavailable"
    ]

    async def dispatched() -> bool:
        return bool(await redis.exists(stream.stream)) and await redis.xlen(stream.stream) == 1

    await wait_for(dispatched, 30, "the job dispatched again once the slot is back")
    reconciler = Reconciler(jobs, "summaries", after_s=0.001)
    assert await reconciler.run_once() == 0
    assert await stream.index_entries([r.json()["job_id"]]) != [None]
    assert await redis.xlen(stream.stream) == 1
    assert await count(pool, ACCEPTED) == 1


async def test_a_worker_started_while_its_slot_is_down_waits_then_does_the_job_once(
    cluster, pool, stream, summary_job, fake_llm
):
    job_id = await submit(pool, stream, "The slot comes back. The job runs once.")
    worker = make_worker(stream, summary_job, pool)
    with capture_logs() as logs:
        with SlotsDown(cluster, SLOT):
            task = asyncio.create_task(worker.run())

            async def backing_off() -> bool:
                assert not task.done(), task
                return any(e["event"] == "worker.redis_unavailable" for e in logs)

            await wait_for(backing_off, 10, "the worker backing off")

        async def done() -> bool:
            return await job_status(pool, job_id) == "done"

        await wait_for(done, 15, "the job done")
        worker.stop()
        await task
    assert fake_llm.stats().total == 1
    assert await redis_dead_letters(stream) == 0
    assert worker.stats["dead"] == 0


async def test_a_step_that_meets_clusterdown_is_deferred_never_dead_lettered(
    cluster, redis, pool, stream
):
    async def step_touching_redis(message: JobMessage, delivery: Delivery) -> str:
        await redis.get(ELSEWHERE)
        return "done"

    await stream.ensure_group()
    job_id = await submit(pool, stream, "A transient cluster state.")
    worker = make_worker(stream, step_touching_redis, pool)
    with SlotsDown(cluster, key_slot(ELSEWHERE.encode())), capture_logs() as logs:
        await drain(worker)
    [deferred] = [e for e in logs if e["event"] == "job.deferred"]
    assert deferred["job_id"] == job_id
    assert deferred["error"].startswith("ClusterUnavailable")
    assert await stream.index_entries([job_id]) == ["delayed"]
    assert await redis_dead_letters(stream) == 0
    assert await job_status(pool, job_id) == "queued"


def move_slot(cluster: EmbeddedCluster, slot: int, source: str, target: str) -> None:
    """Reshard ``slot`` from node ``source`` to node ``target`` as
    ``valkey-cli --cluster reshard`` does: IMPORTING / MIGRATING, MIGRATE
    its keys, then every node told the new owner."""
    nodes = {url: sync_redis.Redis.from_url(url, decode_responses=True) for url in cluster.urls}
    src, dst = nodes[source], nodes[target]
    src_id, dst_id = src.cluster("MYID"), dst.cluster("MYID")
    dst.cluster("SETSLOT", slot, "IMPORTING", src_id)
    src.cluster("SETSLOT", slot, "MIGRATING", dst_id)
    host, port = target.removeprefix("redis://").split(":")
    while keys := src.cluster("GETKEYSINSLOT", slot, 100):
        src.migrate(host, int(port), keys, 0, 5000)
    for node in nodes.values():
        node.cluster("SETSLOT", slot, "NODE", dst_id)
        node.close()


async def test_jobs_keep_flowing_while_the_streams_slot_moves_to_another_node(
    cluster, redis, jobs, pool, stream, summary_job, fake_llm
):
    """Resharding under load: ASK and MOVED followed, a TRYAGAIN is transient;
    every job ends done with one model call and nothing dead."""
    await stream.ensure_group()
    worker = make_worker(stream, summary_job, pool, claim_idle_ms=1000)
    reconciler = Reconciler(jobs, "summaries", after_s=1.0)
    owner = cluster.url_of_slot_owner(SLOT)
    other = next(url for url in cluster.urls if url != owner)
    running = [asyncio.create_task(worker.run()), asyncio.create_task(reconciler.run())]
    job_ids: list[str] = []

    async def keep_submitting(n: int) -> None:
        for i in range(n):
            job_ids.append(await submit(pool, stream, f"Moving slot, job {len(job_ids)} ({i})."))
            await asyncio.sleep(0.01)

    try:
        await keep_submitting(10)
        await asyncio.gather(
            keep_submitting(30), asyncio.to_thread(move_slot, cluster, SLOT, owner, other)
        )
        old_owner = sync_redis.Redis.from_url(owner)
        with pytest.raises(sync_redis.exceptions.MovedError):
            old_owner.xlen(stream.stream)
        old_owner.close()
        await keep_submitting(10)

        async def all_done() -> bool:
            done = "SELECT count(*) FROM jobs WHERE status = 'done'"
            return await count(pool, done) == len(job_ids)

        await wait_for(all_done, 30, "every job done")
    finally:
        worker.stop()
        reconciler.stop()
        await asyncio.gather(*running)
        await asyncio.to_thread(move_slot, cluster, SLOT, other, owner)
    assert len(job_ids) == 50
    assert fake_llm.stats().total == len(job_ids)
    assert await redis_dead_letters(stream) == 0
    assert await count(pool, "SELECT count(*) FROM outbox") == len(job_ids)


async def test_tenant_erasure_reaches_idempotency_records_on_every_primary(redis):
    store = IdempotencyStore(redis, lock_ttl_s=60, result_ttl_s=60)
    for i in range(60):
        await store.claim(f"acme-{i:03d}", "fp", "token", tenant="acme")
        await store.claim(f"other-{i:03d}", "fp", "token", tenant="globex")
    primaries = redis.get_primaries()
    per_node = [await redis.dbsize(target_nodes=node) for node in primaries]
    assert len(per_node) == 3 and all(n > 0 for n in per_node), per_node

    assert await store.erase_tenant("acme", batch=7) == 60

    left = [key async for key in redis.scan_iter(match="oncely:idem:*")]
    assert len(left) == 60
    values = [json.loads(await redis.get(k)) for k in left]
    assert {v["t"] for v in values} == {tenant_tag("globex")}


@pytest.mark.slow
async def test_no_reachable_node_is_unavailable_for_clients_and_the_cli(database_url):
    nowhere = f"redis://127.0.0.1:{free_port()}"
    client = make_redis(nowhere, cluster=True, timeout_s=1.0, connect_timeout_s=1.0)
    with pytest.raises(ClusterUnavailable):
        await client.ping()
    await client.aclose()
    with pytest.raises(SystemExit, match=r"ONCELY_REDIS_CLUSTER: .*must be 0"):
        make_redis(f"{nowhere}/3", cluster=True)  # a cluster has database 0 only
    env = {
        "ONCELY_REDIS_URL": nowhere,
        "ONCELY_REDIS_CLUSTER": "true",
        "ONCELY_DATABASE_URL": database_url,
    }
    result = oncely("status", env=env)
    assert result.returncode == 69, result.stdout + result.stderr
    assert "Redis did not answer" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
async def test_api_worker_and_relay_processes_on_a_node_not_owning_the_stream_do_each_job_once(
    redis_url, database_url, redis, pool, tmp_path: Path
):
    key = await create_api_key(pool, "acme")
    async with FakeLLMServer() as model, FakeMailServer(tmp_path / "mail.jsonl") as mail:
        env = {
            "ONCELY_REDIS_URL": redis_url,
            "ONCELY_REDIS_CLUSTER": "true",
            "ONCELY_DATABASE_URL": database_url,
            "ONCELY_LLM_BASE_URL": model.url,
            "ONCELY_SENDER_URL": mail.url,
            "ONCELY_LOG_FORMAT": "json",
            "ONCELY_BLOCK_MS": "50",
        }
        with Deployment(env, tmp_path) as d:
            await wait_healthy(d.base, d.api, tmp_path / "api.log")
            job_ids = await post_twice_each(d.base, key, jobs=8)

            async def all_sent() -> bool:
                for proc in (d.api, *d.relays, *d.workers):
                    assert proc.poll() is None, proc.args
                return (await mail.deliveries())["effects"] == len(job_ids)

            await wait_for(all_sent, 30, "one email per job")
            status = oncely("status", "--json", env=env)
        deliveries = await mail.deliveries()
        calls = model.stats().total
    assert status.returncode == 0, status.stderr
    shown = json.loads(status.stdout)["workflows"]["summaries"]
    assert shown["dead_letters"] == 0 and shown["jobs"]["done"] == len(job_ids)
    done = "SELECT count(*) FROM jobs WHERE status = 'done'"
    assert await count(pool, done) == len(job_ids) == 8
    assert deliveries["requests"] == len(job_ids)
    assert set(deliveries["by_key"]) == {f"summary_ready:{j}" for j in job_ids}
    assert calls == len(job_ids)
    assert await count(pool, "SELECT count(*) FROM outbox") == len(job_ids)


async def post_twice_each(base: str, api_key: str, jobs: int) -> list[str]:
    """POST each job, then the same request again (a client's retry)."""
    auth = {"Authorization": f"Bearer {api_key}"}
    job_ids = []
    async with httpx.AsyncClient(base_url=base, headers=auth) as client:
        for i in range(jobs):
            body = {**BODY, "text": f"{BODY['text']} (job {i})"}
            headers = {"Idempotency-Key": f"cluster-processes-{i:04d}"}
            first = await client.post("/v1/summaries", json=body, headers=headers)
            again = await client.post("/v1/summaries", json=body, headers=headers)
            assert first.status_code == 202, first.text
            assert again.status_code in (202, 409)
            job_ids.append(first.json()["job_id"])
    return job_ids


async def redis_dead_letters(stream: Stream) -> int:
    return int(await stream.redis.xlen(stream.dead))


async def test_readiness_asks_every_primary(cluster, client, redis):
    """A primary that does not answer makes /readyz 503 even when the node
    the client asks by default answers: every key of its slots would fail."""
    assert (await client.get("/readyz")).json()["redis"] is True
    default = redis.get_default_node()
    other = next(url for url in cluster.urls if urlsplit(url).port != default.port)
    frozen = sync_redis.Redis.from_url(other)
    frozen.execute_command("CLIENT", "PAUSE", 4000, "ALL")  # answers nobody for 4 s
    try:
        ready = await client.get("/readyz")
        assert ready.status_code == 503
        assert ready.json() == {"ready": False, "redis": False, "postgres": True}
    finally:
        frozen.close()

    async def ready_again() -> bool:
        return (await client.get("/readyz")).status_code == 200

    await wait_for(ready_again, 30, "/readyz once the primary answers again")


async def test_a_connection_dropped_between_its_check_and_its_write_is_unavailable_not_a_crash(
    redis: RedisClient,
) -> None:
    """redis-py writes on a node's connection whose socket another task
    dropped after the connection was checked (its writer None): the command
    fails as ``ClusterUnavailable``, which every loop retries later, never
    as the bare AttributeError that once ended a worker at its start."""
    await redis.set("dropped", "1")
    node = redis.get_node_from_key("dropped")
    [conn] = [c for c in node._connections if c.is_connected][:1]
    write = conn._send_packed_command

    async def dropped_meanwhile(command: object) -> None:
        conn._writer = None
        await write(command)

    conn._send_packed_command = dropped_meanwhile
    with pytest.raises(ClusterUnavailable, match="dropped"):
        await redis.get("dropped")
    conn._send_packed_command = write
    assert await redis.get("dropped") == "1", "the next command reconnects"
