"""After the checks' evidence is in: one support agent whose refund call is
held at the receiver, the relay sending it SIGKILLed mid-send, and how long
its job waited (docs/chaos.md). The relay's lease is the fleet's default
(``ONCELY_RELAY_LEASE_S``), so this is what a deployment gets."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import psycopg

from bench.chaos.common import AGENT_TOOLS, AGENT_WORKFLOWS, ROUTES, TENANTS, say
from bench.chaos.fleet import Child, Deployment

# The goal: resumed within 5 s of the kill.
GOAL_S = 5.0
# Longer than the probe needs: the receiver holds the first send this long
# (the sender gives up after ONCELY_SENDER_TIMEOUT_S, so the kill must come
# before that).
HOLD_S = 30.0
_WITHIN_S = 60.0


async def relay_kill_mid_call(d: Deployment, workflows: tuple[str, ...]) -> dict[str, Any]:
    """The probe's outcome: ``resumed_s`` (from the kill to the call's
    answer stored and its job woken, by PostgreSQL's clock) or why not."""
    agents = [w for w in AGENT_WORKFLOWS if w in workflows]
    if not agents:
        return {"skipped": "no support agent in this app"}
    try:
        return await _probe(d, ROUTES[agents[0]])
    except (aiohttp.ClientError, psycopg.Error, OSError, RuntimeError) as exc:
        return {"skipped": f"{type(exc).__name__}: {exc}"[:300]}
    finally:
        await _script(d, {})


async def _probe(d: Deployment, route: str) -> dict[str, Any]:
    tenant = TENANTS[0]
    headers = {
        "Authorization": f"Bearer {d.api_keys[tenant]}",
        "Idempotency-Key": f"chaos-relay-kill-probe-{time.time_ns()}",
    }
    body = {
        "customer": "probe@example.com",
        "message": f"relay-kill probe. My teapot arrived broken. {AGENT_TOOLS}",
    }
    await _script(d, {"delay_s": HOLD_S})
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{d.api_url}{route}", json=body, headers=headers) as response:
            if response.status != 202:
                raise RuntimeError(f"the probe was answered {response.status}")
            job_id = (await response.json())["job_id"]
        async with await psycopg.AsyncConnection.connect(
            d.servers.database_url, autocommit=True
        ) as conn:
            key, owner = await _in_flight(d, http, conn, job_id)
            victim = _relay_of(d, owner)
            await d.fleet.kill(victim)
            killed_at = await _one(conn, "SELECT now()")
            await _script(d, {})  # the resend is answered at once
            say(f"probe: {victim.name} SIGKILLed with the refund in flight")
            resumed_s = await _resumed(conn, job_id, killed_at)
        async with http.get(f"{d.mail_url}/_deliveries") as response:
            sends = (await response.json())["by_key"].get(key, 0)
    return {"resumed_s": round(resumed_s, 3), "goal_s": GOAL_S, "sends": sends}


async def _script(d: Deployment, faults: dict[str, Any]) -> None:
    url = f"{d.mail_url}/_faults"
    async with aiohttp.ClientSession() as http, http.post(url, data=json.dumps(faults)) as answer:
        answer.raise_for_status()


async def _in_flight(
    d: Deployment,
    http: aiohttp.ClientSession,
    conn: psycopg.AsyncConnection[Any],
    job_id: str,
) -> tuple[str, str]:
    """The call's dedupe key and its relay's owner, once the receiver holds its send."""
    deadline = time.monotonic() + _WITHIN_S
    while time.monotonic() < deadline:
        cur = await conn.execute(
            "SELECT dedupe_key, locked_by::text FROM outbox"
            " WHERE job_id = %s AND call_key IS NOT NULL AND sent_at IS NULL",
            (job_id,),
        )
        row = await cur.fetchone()
        if row is not None and row[1] is not None:
            async with http.get(f"{d.mail_url}/_deliveries") as response:
                if (await response.json())["by_key"].get(row[0], 0) >= 1:
                    return str(row[0]), str(row[1])
        await asyncio.sleep(0.02)
    raise RuntimeError("the probe's call never reached the receiver")


def _relay_of(d: Deployment, owner: str) -> Child:
    """The relay whose log names ``owner`` (``relay.started``)."""
    for child in d.fleet.of("relay"):
        for line in child.log.read_text(errors="replace").splitlines():
            if owner in line and "relay.started" in line:
                return child
    raise RuntimeError("no relay's log names the call's owner")


async def _resumed(conn: psycopg.AsyncConnection[Any], job_id: str, killed_at: Any) -> float:
    deadline = time.monotonic() + _WITHIN_S
    while time.monotonic() < deadline:
        waited = await _one(
            conn,
            "SELECT extract(epoch FROM c.finished_at - %s)::float8 FROM checkpoints c"
            " JOIN outbox o ON o.job_id = c.job_id AND o.call_key = c.key"
            " WHERE o.job_id = %s AND c.status <> 'waiting'",
            killed_at,
            job_id,
        )
        if waited is not None:
            return float(waited)
        await asyncio.sleep(0.05)
    raise RuntimeError(f"the probe's job did not resume within {_WITHIN_S:.0f} s of the kill")


async def _one(conn: psycopg.AsyncConnection[Any], sql: str, *params: Any) -> Any:
    row = await (await conn.execute(sql, params or None)).fetchone()
    return row[0] if row else None
