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
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import httpx

from oncely.bootstrap import make_redis
from oncely.fakes.llm import FakeLLMServer
from oncely.fakes.mail import FakeMailServer
from tests.helpers import scalar

ROOT = Path(__file__).resolve().parent.parent
# The webhook secret of every deployment the tests start.
SECRET = "whsec_" + "c2VjcmV0LWZvci10ZXN0cy1vbmx5LTEyMzQ1Njc4"


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


async def wait_effects(
    mail: FakeMailServer, at_least: int = 1, within_s: float = 30.0, what: str = "an effect"
) -> None:
    """Wait until the fake receiver has counted ``at_least`` effects."""

    async def counted() -> bool:
        return bool((await mail.deliveries())["effects"] >= at_least)

    await wait_for(counted, within_s, what)


async def wait_outcome(pool: Any, job_id: str, outcome: str, what: str) -> None:
    """Wait until the job's last delivery is recorded with ``outcome``."""

    async def recorded() -> bool:
        last = "SELECT outcome FROM job_deliveries WHERE job_id = %s ORDER BY id DESC"
        return bool(await scalar(pool, last, job_id) == outcome)

    await wait_for(recorded, what=what)


async def post(client: httpx.AsyncClient, route: str, body: dict[str, Any], key: str) -> str:
    """``body`` posted to ``route`` under idempotency key ``key``, accepted: the job's id."""
    r = await client.post(route, json=body, headers={"Idempotency-Key": key})
    assert r.status_code == 202, r.text
    return str(r.json()["job_id"])


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


def deployment_env(
    redis_url: str, database_url: str, model: FakeLLMServer, mail: FakeMailServer, **extra: str
) -> dict[str, str]:
    """The settings of processes on the test's servers and the fake model,
    mail and webhook receiver (``extra`` added or overriding)."""
    return servers_env(
        redis_url,
        database_url,
        ONCELY_LLM_BASE_URL=model.url,
        ONCELY_SENDER_URL=mail.url,
        ONCELY_WEBHOOK_URL=mail.events_url,
        ONCELY_WEBHOOK_SECRET=SECRET,
        ONCELY_LOG_FORMAT="json",
        ONCELY_BLOCK_MS="50",
        **extra,
    )


def servers_env(redis_url: str, database_url: str, **extra: str) -> dict[str, str]:
    """The settings naming the test's Redis and PostgreSQL (``extra`` added)."""
    return {"ONCELY_REDIS_URL": redis_url, "ONCELY_DATABASE_URL": database_url, **extra}


class Deployment:
    """An API, a relay, and a worker on ``env`` (of ``app``, else of the app
    ``env`` names) that a test may kill and start again; ``with deployment:``
    stops every one of them, the ones started later included."""

    def __init__(self, env: dict[str, str], tmp_path: Path, app: str | None = None) -> None:
        self.env = env
        self.tmp_path = tmp_path
        self.prefix = ["--app", app] if app else []
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.api = self.start("api", "--port", str(self.port), log="api.log")
        self.relays = [self.start("relay", log="relay.log")]
        self.workers: list[subprocess.Popen[bytes]] = []
        self.workers.append(self.start_worker())

    @property
    def relay(self) -> subprocess.Popen[bytes]:
        return self.relays[0]

    def start(self, *args: str, log: str) -> subprocess.Popen[bytes]:
        """``oncely <args>`` of this deployment's app, output to ``log``."""
        return start([*self.prefix, *args], self.env, self.tmp_path / log)

    def start_worker(self) -> subprocess.Popen[bytes]:
        """Another worker (the caller adds it to ``workers``)."""
        return self.start("worker", log=f"worker-{len(self.workers)}.log")

    def kill_worker(self) -> None:
        """SIGKILL the first worker, waited for."""
        self.workers[0].send_signal(signal.SIGKILL)
        self.workers[0].wait(10)

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *_: object) -> None:
        with running(self.api, *self.relays, *self.workers):
            pass

    def log(self, name: str) -> str:
        return tail(self.tmp_path / name, 4000)

    @asynccontextmanager
    async def client(
        self, key: str, within_s: float = 30.0, **options: Any
    ) -> AsyncIterator[httpx.AsyncClient]:
        """A client of the API, once it is healthy, with ``key`` as its bearer."""
        log = self.tmp_path / "api.log"
        async with api_client(self.base, self.api, log, key, within_s, **options) as client:
            yield client


@asynccontextmanager
async def api_client(
    base: str,
    api: subprocess.Popen[bytes],
    log: Path,
    key: str,
    within_s: float = 30.0,
    **options: Any,
) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the API process ``api`` at ``base``, once it is healthy
    (its output in ``log``), with ``key`` as its bearer."""
    await wait_healthy(base, api, log, within_s)
    auth = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=base, headers=auth, **options) as client:
        yield client


@contextmanager
def api_with_key(
    redis_url: str, database_url: str, directory: Path, tenant: str, **extra: str
) -> Iterator[tuple[str, str, Path]]:
    """A key of ``tenant`` made with ``oncely keys create``, and a real
    ``oncely api`` (see ``serving_api``) on the servers named, logging JSON
    to ``directory``/api.log (``extra`` settings added): (base URL, key, log)."""
    env = servers_env(redis_url, database_url, ONCELY_LOG_FORMAT="json", **extra)
    created = oncely("keys", "create", "--tenant", tenant, env=env)
    assert created.returncode == 0, created.stderr
    log = directory / "api.log"
    with serving_api(env, log) as url:
        yield url, created.stdout.strip(), log


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
