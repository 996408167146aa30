"""What a short Redis command costs this process: redis-py's pooled path
against the shared connection (``redis_client.SharedConnectionRedis``).

32 tasks send the intake's claim (``SET NX PX GET``) or a one-line script
(``EVALSHA``) until ``--commands`` have gone, on uvloop; the two paths
alternate round by round, so a shared machine's drift hits both alike.
Prints JSON: CPU µs per command (user + system of this process), the
median of the rounds and every round's value.

    .venv/bin/python -m bench.redis_commands --redis-url redis://127.0.0.1:6379/15

The given database is FLUSHED before and after; never point it at data you keep.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
from collections.abc import Awaitable, Callable
from typing import Any

import uvloop
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from oncely.bootstrap import make_redis
from oncely.redis_client import HiredisPacked, RedisClient

TASKS = 32


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _cpu_us_per_command(send: Callable[[int], Awaitable[Any]], commands: int) -> float:
    sent = 0

    async def task() -> None:
        nonlocal sent
        while sent < commands:
            sent += 1
            await send(sent)

    before = _cpu_s()
    await asyncio.gather(*(task() for _ in range(TASKS)))
    return (_cpu_s() - before) / commands * 1e6


def _pooled(url: str) -> Redis:
    """``bootstrap.make_redis``'s single-server client without the shared
    connection: the same pool, packing, retry and bounds."""
    return Redis.from_url(
        url,
        decode_responses=True,
        health_check_interval=30,
        socket_timeout=5.0,
        socket_connect_timeout=5.0,
        connection_class=HiredisPacked,
        retry=Retry(NoBackoff(), 1),
    )


async def run(url: str, commands: int, rounds: int) -> dict[str, Any]:
    clients: dict[str, RedisClient] = {"pooled": _pooled(url), "shared": make_redis(url)}
    marker = json.dumps({"state": "running", "fp": "f" * 64, "token": "t" * 32})
    results: dict[str, dict[str, list[float]]] = {
        name: {"set_nx_px_get": [], "evalsha": []} for name in clients
    }
    try:
        await clients["pooled"].flushdb()
        for _ in range(rounds):
            for name, client in clients.items():
                script = client.register_script("return redis.call('SET', KEYS[1], ARGV[1])")

                async def claim(i: int, client: RedisClient = client, name: str = name) -> Any:
                    return await client.set(
                        f"bench:{name}:{i}", marker, nx=True, px=30000, get=True
                    )

                async def call(i: int, script: Any = script, name: str = name) -> Any:
                    return await script(keys=[f"bench:{name}:s:{i}"], args=["v"])

                results[name]["set_nx_px_get"].append(await _cpu_us_per_command(claim, commands))
                results[name]["evalsha"].append(await _cpu_us_per_command(call, commands))
                await client.flushdb()
    finally:
        for client in clients.values():
            await client.aclose()
    return {
        "benchmark": "redis_commands",
        "tasks": TASKS,
        "commands_per_round": commands,
        "rounds": rounds,
        "cpu_us_per_command": {
            name: {
                command: {
                    "median": round(statistics.median(v), 1),
                    "per_round": [round(x, 1) for x in v],
                }
                for command, v in by_command.items()
            }
            for name, by_command in results.items()
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default=os.environ.get("ONCELY_BENCH_REDIS_URL"))
    parser.add_argument("--commands", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not args.redis_url:
        parser.error("--redis-url (or ONCELY_BENCH_REDIS_URL) is required")
    print(json.dumps(uvloop.run(run(args.redis_url, args.commands, args.rounds)), indent=2))


if __name__ == "__main__":
    main()
