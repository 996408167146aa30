"""``redis_client.SharedConnectionRedis``: on one server, short commands from
every task go over one shared connection (``SharedConnection``). Their
answers and errors must be the pooled path's own, and the bounds the same:
a server that does not answer fails the commands within the timeout, a
broken connection is replaced, and a caller that gives up does not shift
the answers of the others."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import hiredis
import pytest
from redis.asyncio import Redis
from redis.exceptions import AuthenticationError, NoScriptError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from oncely.bootstrap import make_redis
from oncely.redis_client import HiredisPacked, RedisClient, SharedConnection, SharedConnectionRedis
from tests.processes import wait_for

pytestmark = pytest.mark.standalone_redis("a cluster's nodes keep redis-py's own connections")


@pytest.fixture
async def pooled(redis_url: str) -> AsyncIterator[Redis]:
    """The same server through redis-py's pool only."""
    client = Redis.from_url(redis_url, decode_responses=True)
    yield client
    await client.aclose()


async def _shared_connections(pooled: Redis, name: str) -> list[dict[str, str]]:
    return [c for c in await pooled.client_list() if c.get("name") == name]


async def test_answers_and_errors_are_the_pooled_paths_own(
    redis: RedisClient, pooled: Redis
) -> None:
    assert isinstance(redis, SharedConnectionRedis)
    script = (
        "if ARGV[1] == 'fail' then return redis.error_reply('BAD nope') end "
        "return {1, ARGV[1], false}"
    )

    async def run(client: Redis, prefix: str) -> list[object]:
        answers: list[object] = [
            await client.set(f"{prefix}:k", "é—✓", nx=True, px=30000, get=True),
            await client.set(f"{prefix}:k", "other", nx=True, px=30000, get=True),
            await client.set(f"{prefix}:plain", "v"),
            await client.get(f"{prefix}:k"),
            await client.get(f"{prefix}:missing"),
            await client.eval(script, 0, "x"),
            await client.xadd(f"{prefix}:s", {"a": "1"}, id="1-1"),
            await client.pexpire(f"{prefix}:k", 60000),
            await client.delete(f"{prefix}:plain", f"{prefix}:none"),
        ]
        for command in (
            lambda: client.eval(script, 0, "fail"),
            lambda: client.evalsha("0" * 40, 0),
            lambda: client.xadd(f"{prefix}:k", {"a": "1"}),  # a string, not a stream
        ):
            try:
                await command()
            except ResponseError as exc:
                answers.append((type(exc), str(exc)))
        return answers

    shared = await run(redis, "shared")
    assert shared == await run(pooled, "pooled")
    assert shared[:2] == [None, "é—✓"]
    assert [type(e) for e in shared[-3:]] == [tuple] * 3
    assert [e[0] for e in shared[-3:]] == [ResponseError, NoScriptError, ResponseError]  # type: ignore[index]
    # The shared path wrote to the URL's database, where the pool reads.
    assert await redis.exists("shared:k") == 1
    assert await pooled.get("shared:k") == "é—✓"


async def test_a_registered_script_is_loaded_on_noscript(redis: RedisClient) -> None:
    await redis.script_flush()
    script = redis.register_script("return ARGV[1] .. '!'")
    assert await script(args=["hi"]) == "hi!"
    assert await redis.script_exists(script.sha) == [True]


async def test_commands_of_many_tasks_share_one_connection(redis_url: str, pooled: Redis) -> None:
    name = f"shared-{uuid.uuid4().hex[:8]}"
    client = make_redis(f"{redis_url}?client_name={name}")
    try:
        assert isinstance(client, SharedConnectionRedis)
        values = await asyncio.gather(
            *(client.set(f"many:{i}", str(i), get=True) for i in range(200))
        )
        assert values == [None] * 200
        answers = await asyncio.gather(*(client.get(f"many:{i}") for i in range(200)))
        assert answers == [str(i) for i in range(200)]
        assert len(await _shared_connections(pooled, name)) == 1
        # A command of another kind takes a pooled connection of its own.
        assert await client.exists("many:1") == 1
        assert len(await _shared_connections(pooled, name)) == 2
    finally:
        await client.aclose()

    async def closed() -> bool:
        # The server drops a closed connection from its list on its next turn.
        return await _shared_connections(pooled, name) == []

    await wait_for(closed, what="both connections closed at the server")


async def test_a_killed_connection_is_replaced(redis_url: str, pooled: Redis) -> None:
    name = f"shared-{uuid.uuid4().hex[:8]}"
    client = make_redis(f"{redis_url}?client_name={name}")
    try:
        await client.set("killed", "1")
        (before,) = await _shared_connections(pooled, name)
        await pooled.client_kill_filter(_id=before["id"])
        assert await client.get("killed") == "1"
        (after,) = await _shared_connections(pooled, name)
        assert after["id"] != before["id"]
    finally:
        await client.aclose()


async def test_credentials_from_the_url(redis_url: str, pooled: Redis) -> None:
    user, password = f"shared-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    await pooled.acl_setuser(
        user, enabled=True, passwords=[f"+{password}"], keys=["*"], commands=["+@all"]
    )
    host_and_db = redis_url.removeprefix("redis://")
    client = make_redis(f"redis://{user}:{password}@{host_and_db}")
    wrong = make_redis(f"redis://{user}:wrong@{host_and_db}")
    try:
        await client.set("authed", "yes")
        assert await pooled.get("authed") == "yes"
        with pytest.raises(AuthenticationError):
            await wrong.get("authed")
    finally:
        await client.aclose()
        await wrong.aclose()
        await pooled.acl_deluser(user)


# -- against a server that answers when told ------------------------------------


class Puppet:
    """A TCP server speaking just enough RESP: it answers each command with
    its last argument, in order, once ``released`` is set, or closes the
    connection on the commands ``drop`` names."""

    def __init__(self) -> None:
        self.connections = 0
        self.received: list[list[bytes]] = []
        self.released = asyncio.Event()
        self.drop: Callable[[int, list[bytes]], bool] = lambda connection, command: False
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        connection = self.connections
        commands: asyncio.Queue[list[bytes] | None] = asyncio.Queue()
        answering = asyncio.create_task(self._answer(connection, commands, writer))
        parser = hiredis.Reader()
        try:
            while data := await reader.read(65536):
                parser.feed(data)
                while (command := parser.gets()) is not False:
                    self.received.append(command)
                    commands.put_nowait(command)
        except ConnectionError:
            pass
        finally:
            commands.put_nowait(None)
            await asyncio.gather(answering, return_exceptions=True)
            writer.close()

    async def _answer(
        self,
        connection: int,
        commands: asyncio.Queue[list[bytes] | None],
        writer: asyncio.StreamWriter,
    ) -> None:
        while (command := await commands.get()) is not None:
            if self.drop(connection, command):
                writer.close()
                return
            await self.released.wait()
            writer.write(b"+" + command[-1] + b"\r\n")
            await writer.drain()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()


@pytest.fixture
async def puppet() -> AsyncIterator[Puppet]:
    server = Puppet()
    await server.start()
    yield server
    await server.stop()


def _received(puppet: Puppet, n: int) -> Callable[[], Awaitable[bool]]:
    async def received() -> bool:
        return len(puppet.received) >= n

    return received


def _shared(puppet: Puppet, timeout_s: float = 5.0) -> SharedConnection:
    assert puppet.server is not None
    port = int(puppet.server.sockets[0].getsockname()[1])
    return SharedConnection(
        "127.0.0.1", port, timeout_s=timeout_s, connect_timeout_s=5.0, encoding="utf-8"
    )


async def test_a_caller_that_gives_up_does_not_shift_the_others(puppet: Puppet) -> None:
    shared = _shared(puppet)
    try:
        first = asyncio.create_task(shared.execute(("ECHO", "1")))
        second = asyncio.create_task(shared.execute(("ECHO", "2")))
        await wait_for(_received(puppet, 2), what="both commands at the server")
        first.cancel()
        puppet.released.set()
        assert await second == "2"
        assert await shared.execute(("ECHO", "3")) == "3"
        assert first.cancelled()
        assert puppet.connections == 1
    finally:
        await shared.aclose()


async def test_a_server_that_does_not_answer_fails_every_waiting_command(
    puppet: Puppet,
) -> None:
    shared = _shared(puppet, timeout_s=0.5)
    try:
        calls = [asyncio.create_task(shared.execute(("ECHO", str(i)))) for i in range(5)]
        # Does not hang: all five fail at the first one's bound (wide slack).
        done, pending = await asyncio.wait(calls, timeout=15)
        assert not pending
        assert all(isinstance(c.exception(), RedisTimeoutError) for c in done)
        # The next command opens a new connection, which answers.
        puppet.released.set()
        assert await shared.execute(("ECHO", "after")) == "after"
        assert puppet.connections == 2
    finally:
        await shared.aclose()


async def test_a_command_whose_connection_broke_is_sent_once_more(puppet: Puppet) -> None:
    shared = _shared(puppet)
    puppet.released.set()
    try:
        puppet.drop = lambda connection, command: connection == 1
        assert await shared.execute(("ECHO", "x")) == "x"
        assert puppet.connections == 2
        assert puppet.received == [[b"ECHO", b"x"], [b"ECHO", b"x"]]
        # Broken again on the retry: the caller hears it.
        puppet.drop = lambda connection, command: True
        with pytest.raises(RedisConnectionError):
            await shared.execute(("ECHO", "y"))
        assert puppet.connections == 3
        assert puppet.received[2:] == [[b"ECHO", b"y"], [b"ECHO", b"y"]]
    finally:
        await shared.aclose()


async def test_a_server_that_is_down_is_a_connection_error() -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = int(server.sockets[0].getsockname()[1])
    server.close()
    await server.wait_closed()
    shared = SharedConnection("127.0.0.1", port, timeout_s=5.0, connect_timeout_s=5.0)
    with pytest.raises(RedisConnectionError):
        await shared.execute(("PING",))
    await shared.aclose()


async def test_an_answer_that_does_not_decode_fails_its_caller_alone(
    redis_url: str, pooled: Redis
) -> None:
    """As on the pooled path: that caller gets the decoding error; the
    commands around it are answered, once each, on the same connection."""
    name = f"shared-{uuid.uuid4().hex[:8]}"
    client = make_redis(f"{redis_url}?client_name={name}")
    raw = Redis.from_url(redis_url)
    try:
        await raw.set("not-utf8", b"\xff\xfe")
        calls = [
            client.xadd("undecodable:s", {"n": "1"}),
            client.get("not-utf8"),
            client.xadd("undecodable:s", {"n": "2"}),
        ]
        first, bad, second = await asyncio.gather(*calls, return_exceptions=True)
        assert isinstance(bad, UnicodeDecodeError)
        assert not isinstance(first, BaseException) and not isinstance(second, BaseException)
        assert await pooled.xlen("undecodable:s") == 2
        assert len(await _shared_connections(pooled, name)) == 1
    finally:
        await client.aclose()
        await raw.aclose()


async def test_closing_the_client_sends_nothing_again(puppet: Puppet) -> None:
    """A command still waiting when the client closes fails; it is not sent
    once more on a new connection (one that would outlive the client)."""
    shared = _shared(puppet)
    waiting = asyncio.create_task(shared.execute(("ECHO", "in-flight")))
    await wait_for(_received(puppet, 1), what="the command at the server")
    await shared.aclose()
    with pytest.raises(RedisConnectionError):
        await waiting
    assert puppet.connections == 1
    assert puppet.received == [[b"ECHO", b"in-flight"]]


async def test_closing_the_client_while_it_connects_is_a_connection_error(
    puppet: Puppet,
) -> None:
    """Not a cancellation of callers nobody cancelled."""
    assert puppet.server is not None
    port = int(puppet.server.sockets[0].getsockname()[1])
    shared = SharedConnection("127.0.0.1", port, db=1, timeout_s=5.0, connect_timeout_s=5.0)
    waiting = asyncio.create_task(shared.execute(("ECHO", "x")))
    await wait_for(_received(puppet, 1), what="the SELECT of the connect")
    assert puppet.received == [[b"SELECT", b"1"]]
    await shared.aclose()
    with pytest.raises(RedisConnectionError):
        await waiting
    assert not waiting.cancelled()


async def test_without_a_connect_timeout_the_socket_timeout_bounds_connecting(
    puppet: Puppet,
) -> None:
    """As redis-py: a server that never answers the setup (here ``SELECT``)
    fails the command within the socket timeout."""
    assert puppet.server is not None
    port = int(puppet.server.sockets[0].getsockname()[1])
    client = SharedConnectionRedis.from_url(f"redis://127.0.0.1:{port}/1", socket_timeout=0.5)
    try:
        # Does not hang (wide slack): the bound is half a second.
        with pytest.raises(RedisTimeoutError):
            await asyncio.wait_for(client.get("k"), 15)
    finally:
        await client.aclose()


async def test_the_shared_connection_can_be_turned_off(settings) -> None:
    """ONCELY_REDIS_SHARED_CONNECTION=false: every process's client is
    redis-py's own, with its pool only, answering the same."""
    from oncely.bootstrap import open_resources

    async with open_resources(
        settings.model_copy(update={"redis_shared_connection": False})
    ) as res:
        assert type(res.redis) is Redis
        assert res.redis.connection_pool.connection_class is not HiredisPacked
        await res.redis.set("oncely:plain", "é")
        assert await res.redis.get("oncely:plain") == "é"
    async with open_resources(settings) as res:
        assert isinstance(res.redis, SharedConnectionRedis)
