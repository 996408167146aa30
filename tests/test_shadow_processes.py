"""Shadow mode end to end through real `oncely api`, `worker` and `relay`
processes with ONCELY_SHADOW at 100 %, then `oncely eval report` and
`oncely eval gate` as a deploy pipeline runs them."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.helpers import scalar
from tests.processes import Deployment, deployment_env, free_port, oncely, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


JOBS = 16


def ticket(i: int) -> dict[str, str]:
    # Every fourth ticket names two categories: the v2 model picks the second.
    body = "My billing page shows a bug." if i % 4 == 0 else "My billing page is wrong."
    return {"subject": f"Urgent ticket {i}", "body": f"{body} Case {i}."}


async def test_full_shadow_on_triage_sends_one_webhook_per_job_and_the_gate_decides(
    redis_url, database_url, api_key, redis, pool, providers, tmp_path
):
    model, mail = providers
    env = deployment_env(
        redis_url, database_url, model, mail, ONCELY_SHADOW="triage=oncely-fake-v2:1"
    )
    with Deployment(env, tmp_path) as d:
        async with d.client(api_key) as client:
            ids = []
            for i in range(JOBS):
                r = await client.post(
                    "/v1/triage",
                    json=ticket(i),
                    headers={"Idempotency-Key": f"shadow-end-to-end-{i:04}"},
                )
                assert r.status_code == 202, r.text
                ids.append(r.json()["job_id"])

        async def all_shadowed() -> bool:
            return await scalar(pool, "SELECT count(*) FROM shadow_results") == JOBS

        async def all_delivered() -> bool:
            return (await mail.deliveries())["effects"] == JOBS

        await wait_for(all_shadowed, what="a shadow result per job")
        await wait_for(all_delivered, what="a webhook per job")
        # Anything a shadow might wrongly send would have left by now too.
        await asyncio.sleep(0.5)

    deliveries = await mail.deliveries()
    assert deliveries["requests"] == JOBS, "one webhook per job, none from shadow runs"
    assert set(deliveries["by_key"]) == {f"ticket_triaged:{i}" for i in ids}
    assert await scalar(pool, "SELECT count(*) FROM outbox") == JOBS
    assert await scalar(pool, "SELECT count(DISTINCT job_id) FROM outbox") == JOBS
    assert await scalar(pool, "SELECT count(*) FROM jobs WHERE status = 'done'") == JOBS
    assert model.stats().models == {"oncely-fake": JOBS, "oncely-fake-v2": JOBS}

    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT r.result, s.result FROM shadow_results s JOIN results r USING (job_id)"
        )
        pairs = await cur.fetchall()
    scores = [sum(p[f] == s[f] for f in ("category", "priority")) / 2 for p, s in pairs]
    agreement = sum(scores) / len(scores)
    assert len(pairs) == JOBS and agreement == pytest.approx(1 - 0.5 * 4 / JOBS)

    report = await asyncio.to_thread(
        oncely, "eval", "report", "--workflow", "triage", "--json", env=env
    )
    assert report.returncode == 0, report.stderr
    [variant] = json.loads(report.stdout)["variants"]
    assert variant["variant"] == "oncely-fake-v2"
    assert (variant["pairs"], variant["errors"]) == (JOBS, 0)
    assert variant["agreement"] == pytest.approx(agreement)
    assert variant["fields"]["priority"] == 1.0
    assert variant["scores"] == {"0-0.25": 0, "0.25-0.5": 0, "0.5-0.75": 4, "0.75-1": 0, "1": 12}
    assert variant["per_job"]["primary"]["model_calls"] == 1.0
    assert variant["deltas"]["tokens"] < 0, "the v2 model answers one sentence, not two"

    text = await asyncio.to_thread(oncely, "eval", "report", "-w", "triage", env=env)
    assert text.returncode == 0 and "oncely-fake-v2" in text.stdout and "16 pairs" in text.stdout

    def gate(min_agreement: float, *extra: str):
        args = ["eval", "gate", "-w", "triage", "--variant", "oncely-fake-v2"]
        return oncely(*args, "--min-agreement", str(min_agreement), *extra, env=env)

    passed = await asyncio.to_thread(gate, agreement - 0.01, "--min-pairs", str(JOBS))
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert passed.stdout.startswith("pass: triage / oncely-fake-v2")
    failed = await asyncio.to_thread(gate, agreement + 0.01)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert failed.stdout.startswith("fail:") and "agreement" in failed.stdout
    too_few = await asyncio.to_thread(gate, 0.5, "--min-pairs", str(JOBS + 1), "--json")
    assert too_few.returncode == 1
    assert json.loads(too_few.stdout)["failures"] == [f"pairs {JOBS} (need >= {JOBS + 1})"]
    cheaper = await asyncio.to_thread(gate, 0.5, "--max-cost-ratio", "1.0")
    assert cheaper.returncode == 0, cheaper.stdout
    unknown = await asyncio.to_thread(
        oncely, "eval", "gate", "-w", "triage", "--variant", "nope", "--min-agreement", "0", env=env
    )
    assert unknown.returncode == 1 and "no shadow runs" in unknown.stdout


async def test_eval_commands_keep_the_cli_exit_codes(redis_url, database_url, tmp_path):
    env = {"ONCELY_REDIS_URL": redis_url, "ONCELY_DATABASE_URL": database_url}
    args = ["eval", "gate", "-w", "triage", "--variant", "v", "--min-agreement"]
    usage = await asyncio.to_thread(oncely, *args, "1.5", env=env)
    assert usage.returncode == 2
    workflow = await asyncio.to_thread(oncely, "eval", "report", "-w", "nope", env=env)
    assert workflow.returncode == 2 and "no workflow" in workflow.stderr
    since = await asyncio.to_thread(
        oncely, "eval", "report", "-w", "triage", "--since", "yesterday", env=env
    )
    assert since.returncode == 2 and "--since" in since.stderr
    bad_shadow = await asyncio.to_thread(
        oncely, "eval", "report", "-w", "triage", env={**env, "ONCELY_SHADOW": "triage=v2"}
    )
    assert bad_shadow.returncode == 2 and "ONCELY_SHADOW" in bad_shadow.stderr
    stranger = await asyncio.to_thread(
        oncely, "eval", "report", "-w", "triage", env={**env, "ONCELY_SHADOW": "refunds=v2:1"}
    )
    assert stranger.returncode == 2 and "no workflow ['refunds']" in stranger.stderr
    down = {
        **env,
        "ONCELY_DATABASE_URL": f"postgresql://127.0.0.1:{free_port()}/x",
        "ONCELY_CONNECT_TIMEOUT_S": "1",
    }
    unavailable = await asyncio.to_thread(oncely, *args, "0.9", env=down)
    assert unavailable.returncode == 69, unavailable.stderr
    fresh = await asyncio.to_thread(oncely, "eval", "report", "-w", "triage", "--json", env=env)
    assert fresh.returncode == 0 and json.loads(fresh.stdout)["variants"] == []
