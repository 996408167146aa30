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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterPipeline, RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import (
    ClusterDownError,
    ClusterError,
    RedisClusterException,
    RedisError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError

RedisClient: TypeAlias = Redis | RedisCluster


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
    all. A pipeline, not a transaction: on a cluster the calls' keys may
    live on different nodes, and each call goes to its own. Sent as EVAL
    with the script's text, so that no node can answer NOSCRIPT (redis-py's
    cluster pipelines refuse EVALSHA, and its single-server ones would ask
    SCRIPT EXISTS first, a round trip of its own); the server caches each
    script by its digest."""
    try:
        async with redis.pipeline(transaction=False) as pipe:
            for call in calls:
                pipe.execute_command(
                    "EVAL", call.script.script, len(call.keys), *call.keys, *call.args
                )
            results: list[Any] = await pipe.execute(raise_on_error=False)
    except RedisError as exc:
        results = [exc] * len(calls)
    for call, result in zip(calls, results, strict=True):
        if isinstance(result, RedisError) and call.on_error is not None:
            call.on_error(result)
    return results
