"""A live stream through real `oncely api`, `worker` and `relay` processes
while the worker is SIGKILLed mid-answer (docs/streaming.md): the stream,
read with an SSE client library, says ``reset`` when the next worker starts
the call over, and the tokens kept after it are exactly the stored answer;
the email is sent once, and the killed call is in the ledger as sent."""

from __future__ import annotations

import json
import signal
from typing import Any

import httpx
import pytest
from httpx_sse import aconnect_sse

from oncely.api.auth import create_api_key
from tests.helpers import count
from tests.processes import free_port, running, start, wait_for, wait_healthy
from tests.test_streams import streamed_text
from tests.test_workflows_processes import deployment_env, processes, providers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

__all__ = ["providers"]


async def test_a_worker_killed_mid_stream_resets_and_the_kept_tokens_are_the_answer(
    redis_url, database_url, pool, providers, tmp_path
):
    model, mail = providers
    key = await create_api_key(pool, "acme")
    port = free_port()
    env = deployment_env(redis_url, database_url, model, mail, ONCELY_CLAIM_IDLE_MS="1500")
    api, worker, relay = processes(env, tmp_path, port)
    base = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {key}"}
    # A word every 0.2 s: the worker is killed while the answer is typing.
    text = "[[fake:typing=0.2]] Killed workers start over. The stream says reset first. Done."
    events: list[tuple[str, Any]] = []
    replacement = None
    with running(api, worker, relay):
        await wait_healthy(base, api, tmp_path / "api.log")
        async with httpx.AsyncClient(base_url=base, headers=auth, timeout=60) as http:
            posted = await http.post(
                "/v1/summaries",
                json={"text": text, "notify": "ada@example.com"},
                headers={"Idempotency-Key": "killed-mid-stream-0001"},
            )
            assert posted.status_code == 202, posted.text
            job_id = posted.json()["job_id"]
            async with aconnect_sse(http, "GET", f"/v1/summaries/{job_id}/stream") as source:
                async for sse in source.aiter_sse():
                    events.append((sse.event, json.loads(sse.data)))
                    tokens = sum(kind == "token" for kind, _ in events)
                    # A few words in: the call has been in flight across
                    # several of the ledger's batches.
                    if tokens == 4 and replacement is None:
                        worker.send_signal(signal.SIGKILL)
                        worker.wait()
                        replacement = start(["worker"], env, tmp_path / "worker2.log")
                    if sse.event == "end":
                        break
            got = (await http.get(f"/v1/summaries/{job_id}")).json()

            async def emailed() -> bool:
                return (await mail.deliveries())["effects"] >= 1

            await wait_for(emailed, what="the summary's email")

            async def billed() -> bool:
                return (
                    await count(pool, "SELECT count(*) FROM model_calls WHERE outcome = 'ok'") == 1
                )

            await wait_for(billed, what="the answered call's ledger row")
        assert replacement is not None
        replacement.send_signal(signal.SIGTERM)
        replacement.wait(30)

    assert got["status"] == "done" and events[-1] == ("end", got)
    kinds = [kind for kind, _ in events]
    assert "reset" in kinds, "the next worker's attempt said reset"
    assert kinds.index("token") < kinds.index("reset")
    assert streamed_text([("", k, d) for k, d in events]) == got["result"]["summary"]
    assert (await mail.deliveries())["effects"] == 1
    # The killed call reached the provider: it is in the ledger as sent.
    outcomes = "SELECT outcome FROM model_calls WHERE job_id = %s ORDER BY outcome"
    async with pool.connection() as conn:
        rows = await (await conn.execute(outcomes, (job_id,))).fetchall()
    assert [r[0] for r in rows] == ["ok", "sent"]
