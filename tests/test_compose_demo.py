"""compose.yaml's demo profile, run without a container engine: each demo
service's own command and environment, as written in the file, started as a
local process. Only the host names are mapped to this machine (the demo's
Valkey and PostgreSQL to the suite's servers, the fakes to free ports).
A summary POSTed with the key `demo-key` prints ends done with one email at
the fake mail provider: the profile is a working stack, needing no
variable."""

from __future__ import annotations

import asyncio
import re
import subprocess
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.processes import ROOT, free_port, running, start_command, tail, wait_for, wait_healthy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

yaml = pytest.importorskip("yaml")


def _demo() -> dict[str, Any]:
    services: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    return {name: s for name, s in services.items() if name.startswith("demo-")}


def _command(service: dict[str, Any], ports: dict[str, int], mailbox: Path) -> list[str]:
    """The service's command, its container ports (and the mailbox in the
    container's /tmp) replaced by this machine's."""
    swapped = {"8101": ports["llm"], "8102": ports["mail"], "8000": ports["api"]}
    swapped["/tmp/mailbox.jsonl"] = mailbox
    return [str(swapped.get(arg, arg)) for arg in service["command"]]


def _environment(service: dict[str, Any], urls: dict[str, str]) -> dict[str, str]:
    env = {}
    for name, value in service.get("environment", {}).items():
        value = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(value))  # the file's defaults
        for container, here in urls.items():
            value = value.replace(container, here)
        env[name] = value
    return env


async def test_the_demo_profile_runs_as_written(redis_url, database_url, tmp_path: Path) -> None:
    demo = _demo()
    ports = {"llm": free_port(), "mail": free_port(), "api": free_port()}
    urls = {
        "redis://demo-valkey:6379/0": redis_url,
        "postgresql://oncely:oncely-demo@demo-postgres:5432/oncely": database_url,
        "http://demo-llm:8101": f"http://127.0.0.1:{ports['llm']}",
        "http://demo-mail:8102": f"http://127.0.0.1:{ports['mail']}",
    }
    # Every URL of the demo's oncely services is one of those (none left unmapped).
    for name in ("demo-api", "demo-worker", "demo-relay", "demo-migrate", "demo-key"):
        env = _environment(demo[name], urls)
        assert not any("demo-" in v for v in env.values()), (name, env)

    def launch(name: str) -> subprocess.Popen[bytes]:
        args = ["-m", "oncely", *_command(demo[name], ports, tmp_path / "mailbox.jsonl")]
        return start_command(args, _environment(demo[name], urls), tmp_path / f"{name}.log")

    fakes = [launch("demo-llm"), launch("demo-mail")]
    with running(*fakes):
        for name in ("demo-migrate", "demo-key"):
            one_shot = launch(name)
            assert await asyncio.to_thread(one_shot.wait, 60) == 0, tail(tmp_path / f"{name}.log")
        [key] = re.findall(r"^onc_\S+$", (tmp_path / "demo-key.log").read_text(), flags=re.M)

        api = launch("demo-api")
        processes = [api, launch("demo-worker"), launch("demo-relay")]
        with running(*processes):
            base = f"http://127.0.0.1:{ports['api']}"
            await wait_healthy(base, api, tmp_path / "demo-api.log")
            headers = {"Authorization": f"Bearer {key}", "Idempotency-Key": f"demo-{uuid.uuid4()}"}
            body = {"text": "The demo runs as written. It needs no variable.", "notify": "a@b.c"}
            async with httpx.AsyncClient(base_url=base, headers=headers) as client:
                accepted = await client.post("/v1/summaries", json=body)
                assert accepted.status_code == 202, accepted.text
                job_id = accepted.json()["job_id"]

                async def done() -> bool:
                    job = (await client.get(f"/v1/summaries/{job_id}")).json()
                    return bool(job["status"] == "done")

                await wait_for(done, within_s=60, what="the demo job done")

            async def emailed() -> bool:
                async with httpx.AsyncClient() as mail:
                    found = await mail.get(f"http://127.0.0.1:{ports['mail']}/_deliveries")
                    return bool(found.json()["effects"] == 1)

            await wait_for(emailed, within_s=60, what="one email at the demo's mail provider")
