"""``redis_client.HiredisPacked``: the single-server client's connections
pack commands with hiredis; the bytes must be redis-py's own, and every
kind of value must go to Redis and come back unchanged."""

from __future__ import annotations

import pytest
from redis.asyncio import Connection, ConnectionPool, Redis
from redis.exceptions import DataError

from oncely.redis_client import HiredisPacked, RedisClient
from tests.conftest import CLUSTER

COMMANDS: list[tuple[object, ...]] = [
    ("SET", "oncely:idem:abc", '{"state":"running","fp":"é—✓"}', "NX", "PX", 30000, "GET"),
    ("ZADD", "due", 1733059200.123456, "job-1", 0.1, "job-2", -3, "job-3"),
    ("XADD", "stream", "*", "payload", b"\x00\xff raw bytes", "n", 12345678901234567890),
    ("CONFIG GET", "maxmemory"),  # a command name of two words
    ("EVAL", "return 1", 0),
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: str(c[0]))
def test_the_bytes_are_redis_pys_own(command: tuple[object, ...]) -> None:
    python_packed = Connection().pack_command(*command)  # type: ignore[arg-type]
    assert b"".join(HiredisPacked().pack_command(*command)) == b"".join(python_packed)


def test_a_value_redis_py_refuses_is_refused_the_same_way() -> None:
    for value in (True, None):
        with pytest.raises(DataError):
            Connection().pack_command("SET", "k", value)  # type: ignore[arg-type]
        with pytest.raises(DataError):
            HiredisPacked().pack_command("SET", "k", value)


@pytest.mark.skipif(CLUSTER, reason="a cluster's nodes keep redis-py's own connections")
async def test_values_go_to_redis_and_come_back_unchanged(redis: RedisClient) -> None:
    assert isinstance(redis, Redis)
    assert redis.connection_pool.connection_class is HiredisPacked
    values = {"text": "é—✓ 𝄞", "int": 12345678901234567890, "float": 0.1, "empty": ""}
    await redis.hset("packed", mapping=values)  # type: ignore[arg-type]
    assert await redis.hgetall("packed") == {k: str(v) for k, v in values.items()}
    kwargs = redis.connection_pool.connection_kwargs
    raw = Redis(
        connection_pool=ConnectionPool(
            connection_class=HiredisPacked, **kwargs | {"decode_responses": False}
        )
    )
    try:
        await raw.set("bytes", b"\x00\xff\r\n")
        assert await raw.get("bytes") == b"\x00\xff\r\n"
    finally:
        await raw.aclose()
