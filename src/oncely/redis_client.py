"""The Redis client every Redis-touching module takes: one server, or a cluster.

``ONCELY_REDIS_CLUSTER=true`` makes the composition root build a
``ClusterClient`` instead of a single-server client (README: Redis Cluster).
It follows MOVED and ASK itself. The states in which a cluster cannot serve
a command for now (CLUSTERDOWN, a slot no node serves, no node reachable,
redirections that never settle) are raised as ``ClusterUnavailable``, a
``redis.exceptions.ConnectionError``: the API answers 503, workers back off
and nothing is dead-lettered, exactly as when a single server does not
answer. Translated here, where they enter, so no other module knows a
cluster exists.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from redis.asyncio import Connection, Redis
from redis.asyncio.cluster import ClusterPipeline, RedisCluster
from redis.commands.core import AsyncScript
from redis.connection import HiredisRespSerializer
from redis.exceptions import (
    ClusterDownError,
    ClusterError,
    RedisClusterException,
    RedisError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError

RedisClient: TypeAlias = Redis | RedisCluster


class HiredisPacked(Connection):
    """A TCP connection that packs its commands with hiredis, as redis-py's
    synchronous client does; its asyncio client packs them in Python, about
    7.5 µs for the intake's claim and 17 for its enqueue script, against 1
    and 6 (bench/README.md, Intake). The bytes on the wire are the same."""

    _packer = HiredisRespSerializer()

    def pack_command(self, *args: Any) -> list[bytes]:
        packed: list[bytes] = self._packer.pack(*args)
        return packed


class ClusterUnavailable(RedisConnectionError):
    """The cluster cannot serve the command now; retrying later may succeed."""


# ClusterError covers CLUSTERDOWN, MASTERDOWN and redirections that never
# settled ("TTL exhausted").
_UNAVAILABLE = (ClusterError, TryAgainError, SlotNotCoveredError)


class ClusterClient(RedisCluster):
    """``RedisCluster`` whose unavailable states are ``ClusterUnavailable``."""

    # What a command is retried on once, after the client re-reads the
    # cluster's layout: as the single-server client retries a broken
    # connection once. A timeout is not retried: that would double the bound.
    ERRORS_ALLOW_RETRY = (  # type: ignore[assignment]  # the base's type names TimeoutError
        RedisConnectionError,
        ClusterDownError,
        SlotNotCoveredError,
    )

    async def initialize(self, *args: Any, **kwargs: Any) -> RedisCluster:
        # Learning the layout fails with a bare RedisClusterException when no
        # node answers or the answers do not cover every slot.
        try:
            return await super().initialize(*args, **kwargs)
        except RedisClusterException as exc:
            raise ClusterUnavailable(str(exc)) from exc

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().execute_command(*args, **kwargs)
        except _UNAVAILABLE as exc:
            raise _unavailable(exc) from exc

    def pipeline(
        self, transaction: Any | None = None, shard_hint: Any | None = None
    ) -> ClusterPipeline:
        if shard_hint:
            raise RedisClusterException("shard_hint is not supported in cluster mode")
        # redis' typing declares an attribute abstract that ClusterPipeline
        # itself leaves to its client; RedisCluster.pipeline builds it the same way.
        return _Pipeline(self, transaction)  # type: ignore[abstract]


class _Pipeline(ClusterPipeline):
    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> Any:
        try:
            results = await super().execute(raise_on_error, allow_redirections)
        except _UNAVAILABLE as exc:
            raise _unavailable(exc) from exc
        # Without raise_on_error, a command's error is its result: the same.
        return [_unavailable(r) if isinstance(r, _UNAVAILABLE) else r for r in results]


def _unavailable(exc: BaseException) -> ClusterUnavailable:
    unavailable = ClusterUnavailable(f"{type(exc).__name__}: {exc}")
    unavailable.__cause__ = exc
    return unavailable


async def ping(redis: RedisClient) -> bool:
    """Whether Redis answers; on a cluster, whether every primary does (a
    readiness check asking one node would call a cluster with a frozen
    primary ready, while every key of that primary's slots fails)."""
    if isinstance(redis, RedisCluster):
        return bool(await redis.ping(target_nodes=RedisCluster.PRIMARIES))
    return bool(await redis.ping())


@dataclass(frozen=True)
class ScriptCall:
    """One call of a registered Lua script, to send with others in one
    round trip (``call_together``)."""

    script: AsyncScript
    keys: Sequence[str]
    args: Sequence[Any]
    # Told of this call's failure, so that whoever sends a batch need not
    # know what each of its calls is for.
    on_error: Callable[[RedisError], None] | None = None


async def call_together(redis: RedisClient, calls: Sequence[ScriptCall]) -> list[Any]:
    """Every call in one round trip; each result is the script's answer or
    the ``RedisError`` it met (also given to its ``on_error``). One failing
    call does not stop the others; a batch Redis did not answer fails them
    all.

    A single call is one EVAL. On one server several calls run as one
    script made of theirs (each under ``pcall``), a single command, which
    costs this process less CPU than a pipeline (bench/README.md, Intake),
    and runs them atomically. On a cluster the
    calls' keys may live on different nodes, so they go as a pipeline, each
    to its own node. Either way each is sent with its script's text, as
    EVAL, so that no node can answer NOSCRIPT (redis-py's cluster pipelines
    refuse EVALSHA); the server caches each script by its digest."""
    try:
        if len(calls) == 1:
            results = [await _eval(redis, calls[0])]
        elif isinstance(redis, RedisCluster):
            results = await _pipelined(redis, calls)
        else:
            results = await _as_one_script(redis, calls)
    except RedisError as exc:
        results = [exc] * len(calls)
    for call, result in zip(calls, results, strict=True):
        if isinstance(result, RedisError) and call.on_error is not None:
            call.on_error(result)
    return results


async def _eval(redis: RedisClient, call: ScriptCall) -> Any:
    return await redis.execute_command("EVAL", _text(call), len(call.keys), *call.keys, *call.args)


async def _pipelined(redis: RedisClient, calls: Sequence[ScriptCall]) -> list[Any]:
    async with redis.pipeline(transaction=False) as pipe:
        for call in calls:
            pipe.execute_command("EVAL", _text(call), len(call.keys), *call.keys, *call.args)
        return list(await pipe.execute(raise_on_error=False))


async def _as_one_script(redis: RedisClient, calls: Sequence[ScriptCall]) -> list[Any]:
    script = _composed(tuple(_text(call) for call in calls))
    keys = [key for call in calls for key in call.keys]
    counts = [n for call in calls for n in (len(call.keys), len(call.args))]
    args = [arg for call in calls for arg in call.args]
    reply: list[list[Any]] = await redis.execute_command(
        "EVAL", script, len(keys), *keys, *counts, *args
    )
    return [answer if ok == 1 else ResponseError(answer) for ok, answer in reply]


def _text(call: ScriptCall) -> str:
    script = call.script.script
    return script if isinstance(script, str) else bytes(script).decode()


# Each call's script becomes a function of its own KEYS and ARGV, called
# under pcall: its answer or its error, in order. ARGV starts with each
# call's number of keys and of arguments.
_COMPOSED = """
local calls = {%s}
local answers, key, arg = {}, 0, 2 * #calls
for i, call in ipairs(calls) do
  local nkeys, nargs = tonumber(ARGV[2 * i - 1]), tonumber(ARGV[2 * i])
  local keys, args = {}, {}
  for j = 1, nkeys do keys[j] = KEYS[key + j] end
  for j = 1, nargs do args[j] = ARGV[arg + j] end
  key, arg = key + nkeys, arg + nargs
  local ok, answer = pcall(call, keys, args)
  if ok then
    if answer == nil then answer = false end
    answers[i] = {1, answer}
  else
    answers[i] = {0, type(answer) == 'table' and answer.err or tostring(answer)}
  end
end
return answers
"""


@functools.lru_cache(maxsize=64)
def _composed(scripts: tuple[str, ...]) -> str:
    return _COMPOSED % ",\n".join(f"function(KEYS, ARGV)\n{s}\nend" for s in scripts)
