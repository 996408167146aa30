"""The fake model and the fake mail provider, each in its own process so its
CPU is its own (``oncely fake-llm``, ``oncely fake-mail``)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import psutil

from bench.harness.processes import Children, clean_env, free_port, wait_http
from oncely.fakes.mail import MESSAGES_PATH

API_KEY = "oncely-bench"  # what every contender sends the fake model


class Fake(Protocol):
    """What a benchmark needs of either fake: to wait for it, and its CPU."""

    async def ready(self) -> None: ...

    @property
    def process(self) -> psutil.Process: ...


async def _get(url: str) -> Any:
    async with aiohttp.ClientSession() as session, session.get(url) as r:
        r.raise_for_status()
        return await r.json()


async def _post(url: str, body: Any = None) -> None:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as r:
        r.raise_for_status()


@dataclass(frozen=True)
class FakeModel:
    name: str
    children: Children
    port: int
    proc: subprocess.Popen[bytes]

    @classmethod
    def start(cls, children: Children, name: str = "fake-llm") -> FakeModel:
        port = free_port()
        argv = ["-m", "oncely", "fake-llm", "--port", str(port)]
        proc = children.python(name, argv, clean_env(log_level="WARNING"))
        return cls(name, children, port, proc)

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """The OpenAI-compatible base URL."""
        return f"{self.root_url}/v1"

    @property
    def process(self) -> psutil.Process:
        return psutil.Process(self.proc.pid)

    async def ready(self) -> None:
        await wait_http(f"{self.root_url}/_calls", self.proc, self.name, self.children)

    async def reset(self) -> None:
        await _post(f"{self.root_url}/_reset")

    async def calls(self) -> dict[str, Any]:
        """``GET /_calls``: total, in_flight, max_in_flight, per prompt billed."""
        answer: dict[str, Any] = await _get(f"{self.root_url}/_calls")
        return answer


@dataclass(frozen=True)
class FakeMail:
    name: str
    children: Children
    port: int
    proc: subprocess.Popen[bytes]
    mailbox: Path | None

    @classmethod
    def start(cls, children: Children, name: str, mailbox: Path | None = None) -> FakeMail:
        port = free_port()
        argv = ["-m", "oncely", "fake-mail", "--port", str(port)]
        argv += ["--mailbox", str(mailbox)] if mailbox else []
        proc = children.python(name, argv, clean_env(log_level="WARNING"))
        return cls(name, children, port, proc, mailbox)

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def messages_url(self) -> str:
        return self.root_url + MESSAGES_PATH

    @property
    def process(self) -> psutil.Process:
        return psutil.Process(self.proc.pid)

    async def ready(self) -> None:
        await wait_http(f"{self.root_url}/_deliveries", self.proc, self.name, self.children)

    async def reset(self, delay_s: float = 0.0) -> None:
        """Forget every delivery (and empty the mailbox); then answer after ``delay_s``."""
        await _post(f"{self.root_url}/_reset")
        await _post(f"{self.root_url}/_faults", {"delay_s": delay_s})

    async def deliveries(self) -> dict[str, Any]:
        """``GET /_deliveries``: requests, effects, by_key."""
        answer: dict[str, Any] = await _get(f"{self.root_url}/_deliveries")
        return answer
