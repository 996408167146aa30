"""Child processes: started with their output in a log, SIGKILLed if the
benchmark dies, stopped when it ends (also on an error or SIGTERM)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[2]


def _libc() -> Any:
    with contextlib.suppress(OSError):
        return ctypes.CDLL("libc.so.6", use_errno=True)
    return None


# Loaded once here: the child after fork must not dlopen (another thread of
# ours may hold the loader's lock at that instant).
_LIBC = _libc()


def die_with_parent() -> None:
    """PR_SET_PDEATHSIG: a child is SIGKILLed if its parent dies first."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGKILL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def clean_env(**onc: str) -> dict[str, str]:
    """The parent's environment without its ONCELY_* settings, plus ``onc``
    as ONCELY_<NAME> settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONCELY_")}
    return env | {f"ONCELY_{k.upper()}": v for k, v in onc.items()}


def sigterm_unwinds() -> None:
    """SIGTERM unwinds like Ctrl-C, so every ``finally`` (children, servers) runs."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


class Children:
    """Every process a benchmark starts; ``close`` stops all that still run."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        """``argv`` from the repository root (``-m bench.…`` imports), output to ``<name>.log``."""
        with (self.log_dir / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(
                argv,
                env=env,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,
            )
        self._procs.append(proc)
        return proc

    def python(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        return self.start(name, [sys.executable, *args], env)

    def log_tail(self, name: str, chars: int = 2000) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    @staticmethod
    def stop(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    @staticmethod
    def kill(proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        for proc in self._procs:
            self.stop(proc, grace_s=3.0)
        self._procs.clear()


async def wait_http(
    url: str, proc: subprocess.Popen[bytes], name: str, children: Children, within_s: float = 60.0
) -> None:
    """Until ``url`` answers 200; fails at once if ``proc`` (logging to ``name``) exits."""
    deadline = time.monotonic() + within_s
    timeout = aiohttp.ClientTimeout(total=2)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(url) as response:
                    if response.status == 200:
                        return
            await asyncio.sleep(0.05)
    raise RuntimeError(f"{name} did not come up ({url}): {children.log_tail(name)}")


async def oncely(*args: str, env: dict[str, str], timeout_s: float = 120.0) -> str:
    """One ``oncely`` command to completion, as an operator runs it; its stdout."""
    argv = [sys.executable, "-m", "oncely", *args]
    done = await asyncio.to_thread(
        subprocess.run, argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s
    )
    if done.returncode != 0:
        raise RuntimeError(f"oncely {args[0]} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout.strip()
