"""The Redis client every Redis-touching module takes: one server, or a cluster.

``ONCELY_REDIS_CLUSTER=true`` makes the composition root build a
``ClusterClient`` instead of a single-server client (docs/production.md, Redis Cluster).
It follows MOVED and ASK itself. On one server over TCP the client is a
``SharedConnectionRedis``: its short commands (scripts, ``SET``, ``XADD``…)
from every task go over one connection at once (``SharedConnection``), the
rest over redis-py's pool. The states in which a cluster cannot serve
a command for now (CLUSTERDOWN, a slot no node serves, no node reachable,
redirections that never settle) are raised as ``ClusterUnavailable``, a
``redis.exceptions.ConnectionError``: the API answers 503, workers back off
and nothing is dead-lettered, exactly as when a single server does not
answer. Translated here, where they enter, so no other module knows a
cluster exists.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import inspect
import os
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, cast

import hiredis
from redis._parsers import AsyncCommandsParser
from redis._parsers.base import BaseParser
from redis.asyncio import Connection, ConnectionPool, Redis
from redis.asyncio.cluster import ClusterPipeline, RedisCluster
from redis.client import EMPTY_RESPONSE, NEVER_DECODE
from redis.cluster import PRIMARY
from redis.commands.core import AsyncScript
from redis.connection import HiredisRespSerializer
from redis.exceptions import (
    ClusterDownError,
    ClusterError,
    InvalidResponse,
    NoScriptError,
    RedisClusterException,
    RedisError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

RedisClient: TypeAlias = Redis | RedisCluster


# hiredis packing, as redis-py's synchronous client does: the pooled
# connections' and the shared connection's.
_PACKER = HiredisRespSerializer()


class HiredisPacked(Connection):
    """A TCP connection that packs its commands with hiredis, as redis-py's
    synchronous client does; its asyncio client packs them in Python, about
    7.5 µs for the intake's claim and 17 for its enqueue script, against 1
    and 6 (bench/README.md, Intake). The bytes on the wire are the same."""

    def pack_command(self, *args: Any) -> list[bytes]:
        packed: list[bytes] = _PACKER.pack(*args)
        return packed


# Short and never blocking on the server: these go over the shared
# connection. Blocking reads, scans, pipelines and transactions keep a
# pooled connection of their own.
_SHARED_COMMANDS = frozenset({"EVAL", "EVALSHA", "SET", "GET", "DEL", "PEXPIRE", "XADD", "XACK"})


class SharedConnectionRedis(Redis):
    """A single-server client that sends its short commands (``_SHARED_COMMANDS``)
    over one connection shared by every task (``SharedConnection``), with
    the same answers, errors and bounds as redis-py's pooled path: each
    command answered within the socket timeout or ``TimeoutError``, retried
    once on a fresh connection after a broken one. redis-py gives each
    command a pooled connection of its own, and its machinery costs this
    process about 45 µs a command against 14 (bench/README.md, Intake)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shared = SharedConnection.like(self.connection_pool)

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        name = args[0]
        if name not in _SHARED_COMMANDS or NEVER_DECODE in options:
            return await super().execute_command(*args, **options)  # type: ignore[no-untyped-call]
        # What redis-py's parse_response does with an answer.
        try:
            response = await self.shared.execute(args)
        except ResponseError:
            if EMPTY_RESPONSE in options:
                return options[EMPTY_RESPONSE]
            raise
        options.pop(EMPTY_RESPONSE, None)
        options.pop("keys", None)
        callback = self.response_callbacks.get(name)
        if callback is None:
            return response
        result = callback(response, **options)
        return await result if inspect.isawaitable(result) else result

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await self.shared.aclose()
        await super().aclose(close_connection_pool)


class SharedConnection:
    """One TCP connection to Redis on which any number of tasks send commands
    at once: each command is written as it comes, and the answers, which
    Redis sends in order, resolve the callers' futures in that order.

    A command not answered within ``timeout_s`` fails with ``TimeoutError``
    and closes the connection: every command sent after it is stuck behind
    it and fails with it. A closed connection (the server restarted, say)
    fails its commands with ``ConnectionError``; each is sent once more on
    a new connection, as redis-py retries one; not after ``aclose``, which
    fails them for good. A caller that stops waiting (cancelled) keeps its
    place in the order, and its answer is dropped; an answer that does not
    decode fails its own caller only."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        db: int = 0,
        username: str | None = None,
        password: str | None = None,
        timeout_s: float | None = None,
        connect_timeout_s: float | None = None,
        encoding: str | None = None,
        encoding_errors: str = "strict",
        client_name: str | None = None,
    ) -> None:
        self.address = f"{host}:{port}"
        self._host, self._port = host, port
        self._setup: list[tuple[Any, ...]] = []
        if password is not None:
            self._setup.append(
                ("AUTH", password) if username is None else ("AUTH", username, password)
            )
        if db:
            self._setup.append(("SELECT", db))
        if client_name:
            self._setup.append(("CLIENT SETNAME", client_name))
        self._timeout_s = timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._encoding = encoding
        self._encoding_errors = encoding_errors
        self._wire: _Wire | None = None
        self._connecting: asyncio.Future[_Wire] | None = None

    @classmethod
    def like(cls, pool: ConnectionPool) -> SharedConnection:
        """A shared connection to the server of ``pool``'s connections, with
        their credentials, database, timeouts and decoding."""
        kw = pool.connection_kwargs
        return cls(
            kw.get("host", "localhost"),
            int(kw.get("port", 6379)),
            db=int(kw.get("db") or 0),
            username=kw.get("username"),
            password=kw.get("password"),
            timeout_s=kw.get("socket_timeout"),
            # redis-py bounds a connect by the socket timeout when no other is set.
            connect_timeout_s=kw.get("socket_connect_timeout") or kw.get("socket_timeout"),
            encoding=kw.get("encoding", "utf-8") if kw.get("decode_responses") else None,
            encoding_errors=kw.get("encoding_errors", "strict"),
            client_name=kw.get("client_name"),
        )

    async def execute(self, args: Sequence[Any]) -> Any:
        """``args`` as one command; its answer (an error answer raised)."""
        packed = _PACKER.pack(*args)
        try:
            return await (await self._connection()).call(packed, self._timeout_s)
        except _ClosedByClient:
            raise
        except RedisConnectionError:
            return await (await self._connection()).call(packed, self._timeout_s)

    async def _connection(self) -> _Wire:
        wire = self._wire
        if wire is not None and wire.open and wire.loop is asyncio.get_running_loop():
            return wire
        connecting = self._connecting
        if connecting is None:
            connecting = self._connecting = asyncio.ensure_future(self._connect())
            connecting.add_done_callback(self._connected)
        try:
            # Shielded: one caller giving up does not stop the others' connect.
            return await asyncio.shield(connecting)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if connecting.cancelled() and task is not None and not task.cancelling():
                # ``aclose`` stopped the connect, not this caller's canceller.
                raise _ClosedByClient(f"{self.address}: closed while connecting") from None
            raise

    def _connected(self, connecting: asyncio.Future[_Wire]) -> None:
        self._connecting = None
        if not connecting.cancelled() and connecting.exception() is None:
            self._wire = connecting.result()

    async def _connect(self) -> _Wire:
        loop = asyncio.get_running_loop()
        wire: _Wire | None = None
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, wire = await loop.create_connection(
                    lambda: _Wire(loop, self.address, self._encoding, self._encoding_errors),
                    self._host,
                    self._port,
                )
                for command in self._setup:
                    await wire.call(_PACKER.pack(*command), None)
        except TimeoutError:
            if wire is not None:
                wire.close()
            raise RedisTimeoutError(f"Timeout connecting to {self.address}") from None
        except OSError as exc:
            raise RedisConnectionError(f"Error connecting to {self.address}: {exc}") from exc
        except BaseException:
            if wire is not None:
                wire.close()
            raise
        return wire

    async def aclose(self) -> None:
        if self._connecting is not None:
            self._connecting.cancel()
        if self._wire is not None:
            self._wire.close()
            self._wire = None


class _ClosedByClient(RedisConnectionError):
    """The client closed the connection (``aclose``): not sent again."""


@dataclass(frozen=True)
class _Undecodable:
    error: Exception


class _Wire(asyncio.Protocol):
    """The shared connection's transport, parser and callers in order."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        address: str,
        encoding: str | None,
        encoding_errors: str = "strict",
    ) -> None:
        self.loop = loop
        self.open = True
        self._address = address
        self._transport: asyncio.Transport | None = None
        self._waiting: collections.deque[asyncio.Future[Any]] = collections.deque()
        # Error answers become redis-py's own exception classes.
        options: dict[str, Any] = {
            "protocolError": InvalidResponse,
            "replyError": BaseParser.parse_error,
        }
        if encoding is not None:
            options["encoding"] = encoding
            options["errors"] = encoding_errors
        self._reader = hiredis.Reader(**options)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not derive from asyncio's.
        self._transport = cast(asyncio.Transport, transport)

    async def call(self, packed: list[bytes], timeout_s: float | None) -> Any:
        if not self.open or self._transport is None:
            raise RedisConnectionError(f"Connection to {self._address} closed")
        answer = self.loop.create_future()
        self._transport.writelines(packed)
        self._waiting.append(answer)
        timer = None if timeout_s is None else self.loop.call_later(timeout_s, self._expire, answer)
        try:
            reply = await answer
        finally:
            if timer is not None:
                timer.cancel()
        # As redis-py's hiredis parser: an error answer, or an array led by
        # a connection error, is raised.
        if isinstance(reply, RedisError):
            raise reply
        if isinstance(reply, _Undecodable):
            raise reply.error
        if isinstance(reply, list) and reply and isinstance(reply[0], RedisConnectionError):
            raise reply[0]
        return reply

    def data_received(self, data: bytes) -> None:
        if not self.open:
            return
        self._reader.feed(data)
        while True:
            try:
                reply = self._reader.gets()
            except InvalidResponse as exc:
                self._fail(functools.partial(RedisConnectionError, f"{self._address}: {exc}"))
                return
            except Exception as exc:
                # An answer that does not decode (not UTF-8, say): the
                # reader has consumed it, so only its caller hears of it.
                reply = _Undecodable(exc)
            if reply is False:
                return
            if not self._waiting:
                self._fail(lambda: RedisConnectionError(f"{self._address}: an unasked answer"))
                return
            answer = self._waiting.popleft()
            if not answer.done():
                answer.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(lambda: RedisConnectionError(f"Connection to {self._address} lost"))

    def _expire(self, answer: asyncio.Future[Any]) -> None:
        if not answer.done():
            self._fail(lambda: RedisTimeoutError(f"Timeout reading from {self._address}"))

    def close(self) -> None:
        self._fail(lambda: _ClosedByClient(f"Connection to {self._address} closed by the client"))

    def _fail(self, error: Callable[[], RedisError]) -> None:
        self.open = False
        while self._waiting:
            answer = self._waiting.popleft()
            if not answer.done():
                answer.set_exception(error())
        if self._transport is not None:
            self._transport.abort()


class ClusterUnavailable(RedisConnectionError):
    """The cluster cannot serve the command now; retrying later may succeed."""


# Where redis-py's asyncio connections live (``_dropped_connection``).
_CONNECTION_MODULE = os.path.join("redis", "asyncio", "connection.py")

# ClusterError covers CLUSTERDOWN, MASTERDOWN and redirections that never
# settled ("TTL exhausted").
_UNAVAILABLE = (ClusterError, TryAgainError, SlotNotCoveredError)


class _CommandTable(AsyncCommandsParser):
    """redis-py's table of the server's commands (what tells a command's
    keys), asked of the cluster's first primary each time the client
    re-reads the layout. With that node gone (a primary lost, its replica
    not yet promoted) the whole client would fail, every slot's commands
    with it (docs/production.md, "Failover"). It is read from the first
    primary that answers."""

    def __init__(self, nodes: Any) -> None:
        super().__init__()
        self._nodes = nodes

    async def initialize(self, node: Any = None) -> None:
        candidates = [node, *self._nodes.get_nodes_by_server_type(PRIMARY)]
        failure: BaseException | None = None
        for candidate in dict.fromkeys(c for c in candidates if c is not None):
            try:
                await super().initialize(candidate)
                return
            except (RedisConnectionError, RedisTimeoutError) as exc:
                failure = exc
        raise failure or RedisConnectionError("no primary answered COMMAND")


class _KeyedScript(AsyncScript):
    """A registered script as a cluster runs it: EVALSHA on its keys' node,
    and on NOSCRIPT its text by EVAL there (which caches it on that node).
    redis-py would SCRIPT LOAD it on every primary first, which fails while
    any one primary is gone, for every slot's scripts (docs/production.md,
    "Failover")."""

    async def __call__(self, keys: Any = None, args: Any = None, client: Any = None) -> Any:
        keys, args = list(keys or ()), list(args or ())
        target = client if client is not None else self.registered_client
        try:
            return await target.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            text = self.script if isinstance(self.script, str) else bytes(self.script).decode()
            return await target.eval(text, len(keys), *keys, *args)


class ClusterClient(RedisCluster):
    """``RedisCluster`` whose unavailable states are ``ClusterUnavailable``,
    and which keeps serving the slots of the nodes that answer when one is
    gone (``_CommandTable``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands_parser = _CommandTable(self.nodes_manager)

    def register_script(self, script: Any) -> AsyncScript:  # type: ignore[override]  # redis-py types the sync Script
        return _KeyedScript(self, script)

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
        except RuntimeError as exc:
            # uvloop's answer to a write on a connection whose node died
            # under it (redis-py has dropped the connection by then): seen
            # when a primary is killed mid-command (tests/test_cluster_failover.py).
            if "handler is closed" not in str(exc):
                raise
            raise ClusterUnavailable(f"a node's connection closed: {exc}") from exc
        except AttributeError as exc:
            # redis-py writing on a connection that was dropped between its
            # check and its write (its writer gone): seen once at a worker's
            # start on a loaded machine, where it ended the worker.
            if not _dropped_connection(exc):
                raise
            raise ClusterUnavailable(f"a node's connection was dropped: {exc}") from exc

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


def _dropped_connection(exc: AttributeError) -> bool:
    """``exc`` is redis-py's connection writing after it lost its socket
    (raised inside its connection module, on a None), not a bug of ours."""
    frames = traceback.extract_tb(exc.__traceback__)
    inside = bool(frames) and frames[-1].filename.endswith(_CONNECTION_MODULE)
    return inside and "'NoneType' object" in str(exc)


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
