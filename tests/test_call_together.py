"""``redis_client.call_together``: several Lua script calls in one round trip,
each with its own answer or error (the intake sends its enqueue with the
stored response this way). Also run on a Redis Cluster, where the calls'
keys live on different nodes."""

from __future__ import annotations

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError

from oncely.bootstrap import make_redis
from oncely.redis_client import RedisClient, ScriptCall, call_together
from tests.conftest import CLUSTER
from tests.processes import free_port

SET_AND_ECHO = "redis.call('SET', KEYS[1], ARGV[1]); return ARGV[1]"
APPEND_TO_STREAM = "return redis.call('XADD', KEYS[1], '*', 'v', ARGV[1])"
# Three keys in different slots (on the test cluster: on two of its nodes).
KEYS = ["together:a", "together:b", "together:c"]


async def test_every_call_answers_in_order(redis: RedisClient) -> None:
    script = redis.register_script(SET_AND_ECHO)
    calls = [ScriptCall(script, [key], [f"v{i}"]) for i, key in enumerate(KEYS)]
    assert await call_together(redis, calls) == ["v0", "v1", "v2"]
    assert [await redis.get(key) for key in KEYS] == ["v0", "v1", "v2"]


async def test_each_call_gets_its_own_keys_and_arguments(redis: RedisClient) -> None:
    """Calls of different shapes in one batch (on one server: one script made
    of theirs), one answering nothing."""
    count_args = redis.register_script("return {#KEYS, #ARGV, ARGV[#ARGV]}")
    nothing = redis.register_script("redis.call('SET', KEYS[1], ARGV[1])")
    results = await call_together(
        redis,
        [
            ScriptCall(count_args, [], ["a", "b", "c"]),
            ScriptCall(nothing, [KEYS[0]], ["set"]),
            ScriptCall(count_args, [KEYS[1]], ["only"]),
        ],
    )
    assert results == [[0, 3, "c"], None, [1, 1, "only"]]
    assert await redis.get(KEYS[0]) == "set"


async def test_a_failing_call_does_not_stop_the_others(redis: RedisClient) -> None:
    await redis.set(KEYS[0], "a string, not a stream")
    stream = redis.register_script(APPEND_TO_STREAM)
    setter = redis.register_script(SET_AND_ECHO)
    failed: list[RedisError] = []
    results = await call_together(
        redis,
        [
            ScriptCall(stream, [KEYS[0]], ["x"], on_error=failed.append),
            ScriptCall(setter, [KEYS[1]], ["kept"]),
        ],
    )
    assert isinstance(results[0], ResponseError) and failed == [results[0]]
    assert results[1] == "kept"
    assert await redis.get(KEYS[1]) == "kept"


async def test_scripts_the_server_forgot_still_run(redis: RedisClient) -> None:
    """SCRIPT FLUSH (a restarted Redis, a failover) loses no call: each goes
    with its script's text."""
    script = redis.register_script(SET_AND_ECHO)
    assert await call_together(redis, [ScriptCall(script, [KEYS[0]], ["before"])]) == ["before"]
    await redis.script_flush()
    failed: list[RedisError] = []
    calls = [ScriptCall(script, [key], ["after"], on_error=failed.append) for key in KEYS[:2]]
    assert await call_together(redis, calls) == ["after", "after"]
    assert failed == []
    assert await redis.get(KEYS[1]) == "after"


async def test_a_batch_redis_did_not_answer_fails_every_call() -> None:
    down = make_redis(f"redis://127.0.0.1:{free_port()}", cluster=CLUSTER, timeout_s=2)
    script = down.register_script(SET_AND_ECHO)
    failed: list[RedisError] = []
    calls = [ScriptCall(script, [key], ["v"], on_error=failed.append) for key in KEYS[:2]]
    try:
        results = await call_together(down, calls)
    finally:
        await down.aclose()
    assert len(results) == 2
    assert all(isinstance(r, RedisConnectionError) for r in results)
    assert failed == results
