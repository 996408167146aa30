"""The soak from start to end: deploy, load, kill, drain, check, report (``main``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp

from bench import chaos_app
from bench.chaos.common import FLEET_SETTINGS, SIDE_CALLS_FILE, TENANTS, say
from bench.chaos.evidence import count_log_events, gather_evidence, log_events
from bench.chaos.fleet import (
    Deployment,
    Fleet,
    Kill,
    ScenarioRun,
    Servers,
    drain,
    kill_loop,
    run_scenarios,
    supervise,
    wait_http,
)
from bench.chaos.plan import Clock, Options, parse_options, plan, served
from bench.chaos.probe import relay_kill_mid_call
from bench.chaos.report import report
from bench.chaos.traffic import Client, Outcome, send_all
from bench.harness.processes import free_port, oncely
from oncely.app import load_app


async def deploy(
    options: Options, servers: Servers, fleet: Fleet, run_dir: Path, clock: Clock
) -> Deployment:
    """Servers, migrations, keys, the fakes and the fleet, all up."""
    await servers.start()
    say(f"servers up at {clock.offset():.1f} s (Valkey {servers.redis_url})")
    llm_port, mail_port, api_port = free_port(), free_port(), free_port()
    llm_url, mail_url = f"http://127.0.0.1:{llm_port}", f"http://127.0.0.1:{mail_port}"
    env = {
        **FLEET_SETTINGS,
        "ONCELY_APP": options.app,
        # Not a setting: where the soak app's side steps note their runs.
        chaos_app.SIDE_CALLS: str(run_dir / SIDE_CALLS_FILE),
        "ONCELY_REDIS_URL": servers.redis_url,
        "ONCELY_DATABASE_URL": servers.database_url,
        "ONCELY_LLM_BASE_URL": f"{llm_url}/v1",
        "ONCELY_SENDER_URL": f"{mail_url}/v1/messages",
        "ONCELY_WEBHOOK_URL": f"{mail_url}/v1/events",
        "ONCELY_LLM_CLIENT": options.llm_client,
    }
    fleet.configure(env, api_port=api_port, model_port=llm_port)
    mailbox = run_dir / "mailbox.jsonl"
    _start_fakes(fleet, options, llm_port, mail_port, mailbox)
    full_env = {**os.environ, **env}
    await oncely("migrate", env=full_env)
    keys = await asyncio.gather(
        *(oncely("keys", "create", "--tenant", t, env=full_env) for t in TENANTS)
    )
    api_keys = {tenant: key.strip() for tenant, key in zip(TENANTS, keys, strict=True)}
    await wait_http(f"{llm_url}/_calls", "fake-llm")
    await wait_http(f"{mail_url}/_deliveries", "fake-mail")
    fleet.start("api", 1)
    for slot in range(1, options.workers + 1):
        fleet.start("worker", slot)
    for slot in range(1, options.relays + 1):
        fleet.start("relay", slot)
    api_url = f"http://127.0.0.1:{api_port}"
    await wait_http(f"{api_url}/readyz", "oncely api")
    say(f"fleet up at {clock.offset():.1f} s")
    return Deployment(servers, fleet, api_url, llm_url, mail_url, mailbox, api_keys)


def _start_fakes(
    fleet: Fleet, options: Options, llm_port: int, mail_port: int, mailbox: Path
) -> None:
    seed = str(options.seed)
    fleet.start(
        "fake-llm",
        1,
        ["fake-llm", "--port", str(llm_port), "--faults", options.model_faults, "--seed", seed,
         "--slow-s", str(options.slow_s)],
    )  # fmt: skip
    fleet.start(
        "fake-mail",
        1,
        ["fake-mail", "--port", str(mail_port), "--mailbox", str(mailbox), "--faults",
         options.mail_faults, "--seed", seed, "--hold-s", str(options.hold_s)],
    )  # fmt: skip


async def soak(
    options: Options, d: Deployment, clock: Clock
) -> tuple[list[Outcome], list[Kill], list[ScenarioRun], float]:
    """The load, the kills and the scenarios, together; returns when every
    request has its final answers."""
    planned = plan(options.requests, options.seed, served(load_app(options.app)))
    load_s = options.requests / options.rate
    stop = asyncio.Event()
    kills: list[Kill] = []
    connector = aiohttp.TCPConnector(limit=200)
    timeout = aiohttp.ClientTimeout(total=30)
    started = clock.offset()
    async with aiohttp.ClientSession(d.api_url, connector=connector, timeout=timeout) as session:
        client = Client(session, d.api_keys, options.accept_timeout)
        background = [asyncio.create_task(supervise(d.fleet, stop))]
        if options.kill_every > 0:
            background.append(asyncio.create_task(kill_loop(d.fleet, options, stop, kills)))
        scenarios = asyncio.create_task(
            run_scenarios(d.servers, options, d.api_url, clock, (started, load_s))
        )
        try:
            outcomes = await send_all(planned, client, options.rate, clock)
            runs = await scenarios
        finally:
            stop.set()
            scenarios.cancel()
            await asyncio.gather(*background, scenarios, return_exceptions=True)
    return outcomes, kills, runs, round(clock.offset() - started, 3)


async def run(options: Options, run_dir: Path) -> dict[str, Any]:
    clock = Clock()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    servers, fleet = Servers(run_dir), Fleet(run_dir / "logs", clock)
    try:
        d = await deploy(options, servers, fleet, run_dir, clock)
        startup_s = clock.offset()
        outcomes, kills, scenarios, load_s = await soak(options, d, clock)
        say(f"load done at {clock.offset():.1f} s: {len(kills)} kills; draining")
        drain_started = clock.offset()
        supervisor_stop = asyncio.Event()
        supervisor = asyncio.create_task(supervise(d.fleet, supervisor_stop))
        drained = await drain(d.servers, load_app(options.app), options.drain_timeout)
        supervisor_stop.set()
        await supervisor
        drain_s = round(clock.offset() - drain_started, 3)
        say(f"drained={drained[0]} in {drain_s:.1f} s; checking")
        evidence = await gather_evidence(d, run_dir)
        # After the evidence: the probe's job is no part of the checks.
        probe = await relay_kill_mid_call(d, served(load_app(options.app)))
        say(f"relay-kill probe: {probe}")
    finally:
        await fleet.stop()
        await servers.stop()
    evidence.log_times = log_events(run_dir / "logs")
    evidence.log_events = count_log_events(evidence.log_times)
    timings = {
        "startup": startup_s,
        "load": load_s,
        "drain": drain_s,
        "elapsed": clock.offset(),
    }
    result = report(options, outcomes, evidence, kills, d.fleet.exits, scenarios, timings, drained)
    result["relay_kill_mid_call"] = probe
    return result


@contextlib.contextmanager
def run_directory(options: Options) -> Iterator[tuple[Path, Callable[[bool], None]]]:
    """The run's directory; a temporary one is removed after a clean run
    unless ``--keep``. Yields it and a function to call with the outcome."""
    if options.run_dir is not None:
        options.run_dir.mkdir(parents=True, exist_ok=True)
        yield options.run_dir, lambda ok: None
        return
    path = Path(tempfile.mkdtemp(prefix="oncely-chaos-"))
    keep = [options.keep]

    def outcome(ok: bool) -> None:
        keep[0] = keep[0] or not ok

    try:
        yield path, outcome
    except BaseException:
        keep[0] = True
        raise
    finally:
        if keep[0]:
            say(f"run directory kept: {path}")
        else:
            shutil.rmtree(path, ignore_errors=True)


async def run_until_stopped(options: Options, run_dir: Path) -> dict[str, Any] | None:
    """``run``, cancelled by SIGTERM or SIGINT so that everything it started
    is stopped on the way out (then None)."""
    task = asyncio.create_task(run(options, run_dir))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        return await task
    except asyncio.CancelledError:
        say("stopped by a signal; everything it started is stopped")
        return None


def main(argv: list[str] | None = None) -> int:
    options = parse_options(argv)
    with run_directory(options) as (run_dir, outcome):
        try:
            import uvloop
        except ImportError:
            result = asyncio.run(run_until_stopped(options, run_dir))
        else:
            result = uvloop.run(run_until_stopped(options, run_dir))
        if result is None:
            outcome(False)
            return 143
        outcome(bool(result["ok"]))
    text = json.dumps(result, indent=2)
    if options.out is not None:
        options.out.parent.mkdir(parents=True, exist_ok=True)
        options.out.write_text(text + "\n")
    print(text)
    for violation in result["violations"]:
        say(f"VIOLATION {violation['kind']} ×{violation['count']}: {violation['examples'][:2]}")
    return 0 if result["ok"] else 1
