"""Starting real `oncely` processes for end-to-end tests, and waiting on state."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from oncely.bootstrap import make_redis

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """``python -m oncely <args>`` from the repository root (so ``examples`` imports)."""
    return start_command(["-m", "oncely", *args], env, log)


def start_command(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """``python <args>`` from the repository root, output to ``log``."""
    return subprocess.Popen(
        [sys.executable, *args],
        env={**os.environ, **env},
        cwd=ROOT,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )


def oncely(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run ``oncely <args>`` to completion from the repository root; its output."""
    return subprocess.run(
        [sys.executable, "-m", "oncely", *args],
        env={**os.environ, **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def tail(log: Path, chars: int = 3000) -> str:
    return log.read_text()[-chars:]


@contextmanager
def running(*procs: subprocess.Popen[bytes]) -> Iterator[None]:
    """Stop every process with SIGTERM at the end (SIGKILL if it lingers)."""
    try:
        yield
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


async def wait_for(
    predicate: Callable[[], Awaitable[bool]], within_s: float = 30.0, what: str = "condition"
) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while not await predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{what} not reached within {within_s} s")
        await asyncio.sleep(0.05)


async def wait_healthy(
    base_url: str, proc: subprocess.Popen[bytes], log: Path, within_s: float = 30.0
) -> None:
    async def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"process exited {proc.returncode}: {tail(log)}")
        try:
            async with httpx.AsyncClient() as client:
                return (await client.get(f"{base_url}/healthz")).status_code == 200
        except httpx.TransportError:
            return False

    await wait_for(up, within_s, what=f"{base_url}/healthz")


@contextmanager
def serving_api(env: dict[str, str], log: Path) -> Iterator[str]:
    """A real ``oncely api`` with ``env``, healthy (waited for without an
    event loop, for module-scoped fixtures): its base URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start(["api", "--port", str(port)], env, log)
    with running(proc):
        deadline = time.monotonic() + 30
        while not _healthy(url):
            assert proc.poll() is None, f"the API exited {proc.returncode}: {tail(log)}"
            assert time.monotonic() < deadline, f"the API did not start: {tail(log)}"
            time.sleep(0.05)
        yield url
        assert proc.poll() is None, f"the API exited {proc.returncode}: {tail(log)}"


def flush_redis(redis_url: str) -> None:
    """FLUSHDB without an event loop (for module-scoped fixtures)."""

    async def flush() -> None:
        client = make_redis(redis_url)
        await client.flushdb()
        await client.aclose()

    asyncio.run(flush())


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz").status_code == 200
    except httpx.TransportError:
        return False


@contextlib.contextmanager
def frozen(pids: list[int]) -> Iterator[None]:
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def postgres_pids(pgdata: Path) -> list[int]:
    """The postmaster and every process it started: the whole cluster."""
    postmaster = int((pgdata / "postmaster.pid").read_text().split()[0])
    pids = [postmaster]
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = (proc / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == postmaster:
                pids.append(int(proc.name))
    return pids


async def repays_allowed(pool: Any, ids: list[str]) -> dict[str, int]:
    """How many model turns each job may have paid twice: one per delivery
    lost mid-run (SIGKILLed: its number is a gap, it left no row), one per
    delivery that ran beside another under the same number (an overtaken
    worker's), and one per delivery that ended in a retry (a turn that
    timed out may have been billed). Resumes after a wait pay nothing again."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT job_id::text, (max(delivery) - count(DISTINCT delivery))"
            " + (count(*) - count(DISTINCT delivery))"
            " + count(*) FILTER (WHERE outcome = 'retry') FROM job_deliveries"
            " WHERE job_id = ANY(%s::uuid[]) GROUP BY job_id",
            (ids,),
        )
        return {job: int(n) for job, n in await cur.fetchall()}
