"""`oncely dev`'s embedded Valkey keeps its data across restarts (an
append-only file under the data directory), as PostgreSQL does."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from oncely.embedded import EmbeddedServers


@pytest.mark.slow
def test_the_dev_servers_keep_redis_data_across_a_restart(servers_dir: Path) -> None:
    servers = EmbeddedServers(servers_dir / "dev", durable=True)
    urls = servers.start()
    try:
        client = redis.Redis.from_url(urls.redis_url)
        client.xadd("oncely:{summaries}:dead", {"job_id": "kept"})
        client.set("oncely:kept", "yes")
        client.close()
    finally:
        servers.stop()
    again = EmbeddedServers(servers_dir / "dev", durable=True)
    urls = again.start()
    try:
        client = redis.Redis.from_url(urls.redis_url, decode_responses=True)
        assert client.get("oncely:kept") == "yes"
        assert client.xlen("oncely:{summaries}:dead") == 1
        client.close()
    finally:
        again.stop()
