"""`oncely dev` as a newcomer meets it: the banner's curl is for the app's
own first workflow and works as printed; every `oncely` command run with the
same data dir finds the running stack without a URL; a second stack there,
or one whose port is taken, is refused before it starts anything; the
stack's address is gone once it stops."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.processes import ROOT, free_port, tail, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

# The servers come from `oncely dev` itself, never from the environment.
_SERVERS = ("ONCELY_REDIS_URL", "ONCELY_DATABASE_URL", "ONCELY_REDIS_CLUSTER", "ONCELY_APP")


def _env(data_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _SERVERS}
    return {**env, "ONCELY_DATA_DIR": str(data_dir), "NO_COLOR": "1", "COLUMNS": "80"}


def _oncely(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "oncely", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _free_with_fakes() -> int:
    """A free port whose + 101 and + 102 (the fakes') are free too.

    Chosen below the kernel's ephemeral range: a port from there (as
    `free_port` gives) has neighbours that any outgoing connection of a test
    running meanwhile may take before `oncely dev` binds them."""
    low, _ = _ephemeral_range()
    for _ in range(200):
        port = random.randrange(10_000, low - 103)
        if all(_bindable(port + n) for n in (0, 101, 102)):
            return port
    raise AssertionError("no free port with its two neighbours free")


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    except (OSError, ValueError):
        return 32768, 60999
    return int(low), int(high)


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "oncely", *args],
        env=env,
        cwd=ROOT,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )


async def test_the_cli_finds_a_running_dev_stack_and_a_second_is_refused(
    tmp_path: Path, servers_dir: Path
) -> None:
    data_dir = servers_dir / "stack"
    # As a newcomer's shell may be: no NO_COLOR, no XDG_RUNTIME_DIR (a
    # container, ssh); the output goes to a file.
    hidden = ("NO_COLOR", "XDG_RUNTIME_DIR")
    env = {k: v for k, v in _env(data_dir).items() if k not in hidden}
    port = _free_with_fakes()
    log = tmp_path / "dev.log"
    dev = _start(["--app", "examples.refunds:app", "dev", "--port", str(port)], env, log)
    try:

        async def up() -> bool:
            if dev.poll() is not None:
                raise AssertionError(f"oncely dev exited {dev.returncode}: {tail(log)}")
            return "/v1/refunds/<job_id>" in log.read_text()

        await wait_for(up, within_s=180, what="the dev banner")
        banner = log.read_text()
        assert (data_dir / "dev.json").exists()
        assert "\x1b[" not in banner, "no colour codes in a file"
        assert "Warning" not in banner, banner[:2000]

        # The banner's curl: the app's own route and a body of its request,
        # each on one line (never wrapped at 80 columns).
        [body] = re.findall(r"^ {4}-d '(.*)'$", banner, flags=re.M)
        assert json.loads(body) == {
            "order_id": "A-1001",
            "amount_cents": 4999,
            "reason": "It arrived broken.",
        }
        assert f"curl -i -X POST http://127.0.0.1:{port}/v1/refunds " in banner
        key = (data_dir / "dev-api-key").read_text().strip()
        headers = {
            "Authorization": f"Bearer {key}",
            "Idempotency-Key": "dev-stack-key-0001",
            "Content-Type": "application/json",
        }
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as api:
            posted = await api.post("/v1/refunds", content=body, headers=headers)
            assert posted.status_code == 202, posted.text
            job_id = posted.json()["job_id"]

        # Another terminal, no URL set: the commands find the stack.
        status = await asyncio.to_thread(_oncely, "status", "--json", env=env)
        assert status.returncode == 0, status.stderr
        assert "using the oncely dev stack running from" in status.stderr
        assert list(json.loads(status.stdout)["workflows"]) == ["refunds"]
        shown = await asyncio.to_thread(_oncely, "jobs", "show", job_id, "--json", env=env)
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["workflow"] == "refunds"

        # A second stack in the same data dir: refused, naming the first.
        again = await asyncio.to_thread(_oncely, "dev", "--port", str(free_port()), env=env)
        assert again.returncode == 69
        assert f"already running from {data_dir} (pid {dev.pid}" in again.stderr

        # Another data dir on the same port: refused before starting anything.
        elsewhere = tmp_path / "elsewhere"
        taken = await asyncio.to_thread(_oncely, "dev", "--port", str(port), env=_env(elsewhere))
        assert taken.returncode == 69
        assert f"port {port} is taken, and the API (--port) needs it" in taken.stderr
        assert not (elsewhere / "postgres").exists()
        assert not (elsewhere / "dev.json").exists()
    finally:
        dev.send_signal(signal.SIGINT)
        await asyncio.to_thread(dev.wait, 60)

    assert dev.returncode == 0, tail(log)
    assert not (data_dir / "dev.json").exists()
    alone = await asyncio.to_thread(_oncely, "status", env=env)
    assert alone.returncode != 0
    assert "set ONCELY_REDIS_URL and ONCELY_DATABASE_URL" in alone.stderr
    assert "no oncely dev is running from" in alone.stderr  # its data is there, it is not


def _alive(pid: int) -> bool:
    return (
        Path(f"/proc/{pid}").exists()
        and b"zombie" not in Path(f"/proc/{pid}/status").read_bytes().lower()
    )


async def test_a_killed_dev_leaves_no_server_running_and_one_valkey_per_data_dir(
    tmp_path: Path, servers_dir: Path
) -> None:
    """kill -9 of `oncely dev`: its watchdog stops the Valkey and PostgreSQL
    it started. A Valkey left behind anyway (its watchdog killed too) is
    stopped by the next start, which never puts a second one on the same
    append-only file; two processes never run one data dir's servers."""
    from oncely.embedded import VALKEY_PIDFILE, DataDirBusy, EmbeddedServers

    data_dir = servers_dir / "stack"
    env = _env(data_dir)
    port = _free_with_fakes()
    log = tmp_path / "dev.log"
    dev = _start(["dev", "--port", str(port)], env, log)

    async def up() -> bool:
        if dev.poll() is not None:
            raise AssertionError(f"oncely dev exited {dev.returncode}: {tail(log)}")
        return (data_dir / "dev.json").exists() and (data_dir / "valkey" / VALKEY_PIDFILE).exists()

    await wait_for(up, within_s=180, what="the dev stack")
    valkey = int((data_dir / "valkey" / VALKEY_PIDFILE).read_text())
    postmaster = int((data_dir / "postgres" / "postmaster.pid").read_text().split()[0])
    assert _alive(valkey) and _alive(postmaster)
    dev.send_signal(signal.SIGKILL)
    dev.wait(30)

    async def servers_stopped() -> bool:
        return not _alive(valkey) and not _alive(postmaster)

    await wait_for(servers_stopped, within_s=60, what="the watchdog stopping the servers")

    # A live owner keeps the data dir to itself; a Valkey orphaned without a
    # watchdog is stopped by the next start.
    first = EmbeddedServers(data_dir, durable=True)
    first.start()
    try:
        with pytest.raises(DataDirBusy):
            EmbeddedServers(data_dir, durable=True).start()
        orphan = int((data_dir / "valkey" / VALKEY_PIDFILE).read_text())
        assert first._watchdog is not None
        first._watchdog.kill()
    finally:
        if first._lock is not None:  # the owner gone, its servers left running
            first._lock.close()
    second = EmbeddedServers(data_dir, durable=True)
    second.start()
    try:
        assert not _alive(orphan)
        assert int((data_dir / "valkey" / VALKEY_PIDFILE).read_text()) != orphan
    finally:
        second.stop()


async def test_dev_without_its_worker_and_relay_serves_ones_run_apart(
    tmp_path: Path, servers_dir: Path
) -> None:
    """`oncely dev --no-worker --no-relay` runs the servers, the fakes and the
    API only; `oncely worker` and `oncely relay` started apart from the same
    directory find its servers and its fakes, and finish the job: one email."""
    data_dir = servers_dir / "apart"
    env = _env(data_dir)
    port = _free_with_fakes()
    app = ["--app", "examples.refunds:app"]
    dev = _start(
        [*app, "dev", "--port", str(port), "--no-worker", "--no-relay"], env, tmp_path / "d"
    )
    apart: list[subprocess.Popen[bytes]] = []
    try:

        async def up() -> bool:
            if dev.poll() is not None:
                raise AssertionError(f"oncely dev exited: {tail(tmp_path / 'd')}")
            return (data_dir / "dev.json").exists()

        await wait_for(up, within_s=180, what="the dev stack")
        key = (data_dir / "dev-api-key").read_text().strip()
        headers = {"Authorization": f"Bearer {key}", "Idempotency-Key": "apart-key-00000001"}
        body = {"order_id": "A-1", "amount_cents": 100, "reason": "broken"}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as api:
            posted = await api.post("/v1/refunds", json=body, headers=headers)
            assert posted.status_code == 202, posted.text
            job_id = posted.json()["job_id"]
            apart = [
                _start([*app, "worker"], env, tmp_path / "w"),
                _start([*app, "relay"], env, tmp_path / "r"),
            ]

            async def done() -> bool:
                view = (await api.get(f"/v1/refunds/{job_id}", headers=headers)).json()
                return view["status"] == "done"

            await wait_for(done, within_s=120, what="the job done by the worker apart")
        mailbox = data_dir / "mailbox.jsonl"

        async def delivered() -> bool:
            return mailbox.exists() and job_id in mailbox.read_text()

        await wait_for(delivered, within_s=60, what="the relay apart's delivery")
    finally:
        for process in [*apart, dev]:
            process.send_signal(signal.SIGINT)
        for process in [*apart, dev]:
            await asyncio.to_thread(process.wait, 60)
