"""What the soak will do: its options, and every request planned from the seed."""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.chaos.common import (
    AGENT_ORDER,
    AGENT_TOOLS,
    AGENT_WORKFLOWS,
    DEFAULT_APP,
    DEFAULT_MAIL_FAULTS,
    DEFAULT_MODEL_FAULTS,
    DOOMED_SHARE,
    EVENT_PLANS,
    EVENT_WAIT_S,
    EVENT_WEIGHTS,
    KNOWN_WORKFLOWS,
    PATTERN_WEIGHTS,
    PATTERNS,
    REUSE_SHARE,
    ROUTES,
    SCENARIOS,
    SENTENCES,
    SLEEP_SHARE,
    SUBJECTS,
    TENANTS,
)
from oncely.app import App, load_app


@dataclass(frozen=True)
class Options:
    requests: int
    rate: float
    kill_every: float
    kill_api: bool
    scenarios: tuple[str, ...]
    seed: int
    app: str
    workers: int
    relays: int
    llm_client: str
    model_faults: str
    mail_faults: str
    slow_s: float
    hold_s: float
    freeze_s: float
    drain_timeout: float
    accept_timeout: float
    out: Path | None
    run_dir: Path | None
    keep: bool


def parse_options(argv: list[str] | None = None) -> Options:
    p = argparse.ArgumentParser(
        description="Chaos soak: kill -9, provider faults and server failures, then "
        "every invariant checked; one JSON report on stdout.",
    )
    p.add_argument("--requests", type=int, default=2000, help="logical requests (default 2000)")
    p.add_argument("--rate", type=float, default=15.0, help="new requests per second")
    p.add_argument("--kill-every", type=float, default=2.0, help="seconds between kills; 0: none")
    p.add_argument("--kill-api", action="store_true", help="the API may be killed too")
    p.add_argument(
        "--scenarios",
        default="all",
        help=f"comma-separated, 'all' or 'none' (of {', '.join(SCENARIOS)})",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--app",
        default=DEFAULT_APP,
        help=f"ONCELY_APP of every process, importable from the repository root "
        f"(default {DEFAULT_APP}); its {', '.join(KNOWN_WORKFLOWS)} get requests",
    )
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--relays", type=int, default=2)
    p.add_argument(
        "--llm-client",
        choices=("openai", "lean"),
        default="openai",
        help="the workers' model client (ONCELY_LLM_CLIENT)",
    )
    p.add_argument("--model-faults", default=DEFAULT_MODEL_FAULTS, help="oncely fake-llm --faults")
    p.add_argument("--mail-faults", default=DEFAULT_MAIL_FAULTS, help="oncely fake-mail --faults")
    p.add_argument("--slow-s", type=float, default=1.5, help="a slow model call takes this long")
    p.add_argument("--hold-s", type=float, default=4.0, help="a provider timeout holds this long")
    p.add_argument("--freeze-s", type=float, default=10.0, help="how long Redis stays frozen")
    p.add_argument("--drain-timeout", type=float, default=300.0, help="seconds to converge")
    p.add_argument("--accept-timeout", type=float, default=180.0, help="per request, retries")
    p.add_argument("--out", type=Path, help="also write the report here")
    p.add_argument("--dir", type=Path, dest="run_dir", help="servers' data and logs (kept)")
    p.add_argument("--keep", action="store_true", help="keep the temporary run directory")
    a = p.parse_args(argv)
    _check_app(p, a.app)
    return Options(
        requests=a.requests,
        rate=a.rate,
        kill_every=a.kill_every,
        kill_api=a.kill_api,
        scenarios=_scenarios(p, a.scenarios),
        seed=a.seed,
        app=a.app,
        workers=a.workers,
        relays=a.relays,
        llm_client=a.llm_client,
        model_faults=a.model_faults,
        mail_faults=a.mail_faults,
        slow_s=a.slow_s,
        hold_s=a.hold_s,
        freeze_s=a.freeze_s,
        drain_timeout=a.drain_timeout,
        accept_timeout=a.accept_timeout,
        out=a.out,
        run_dir=a.run_dir,
        keep=a.keep,
    )


def _check_app(p: argparse.ArgumentParser, spec: str) -> None:
    try:
        app = load_app(spec)
    except ValueError as exc:
        p.error(f"--app: {exc}")
    if not served(app):
        p.error(f"--app {spec} serves none of {', '.join(KNOWN_WORKFLOWS)}")


def served(app: App) -> tuple[str, ...]:
    """The workflows of ``app`` the soak sends requests to, in a fixed order."""
    return tuple(name for name in KNOWN_WORKFLOWS if name in app.names)


def _scenarios(p: argparse.ArgumentParser, text: str) -> tuple[str, ...]:
    if text == "all":
        return SCENARIOS
    names = tuple(n.strip() for n in text.split(",") if n.strip() and n.strip() != "none")
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario {unknown[0]!r} (known: {', '.join(SCENARIOS)}, all, none)")
    return names


class Clock:
    """Offsets from the run's start, and the wall clock PostgreSQL stamps rows with."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    def offset(self) -> float:
        return round(time.monotonic() - self.started, 3)


# -- the requests -----------------------------------------------------------------


@dataclass(frozen=True)
class Planned:
    """One logical request: what the seed decided about it."""

    index: int
    tenant: str
    workflow: str
    key: str
    body: dict[str, Any]
    reused_body: dict[str, Any] | None  # the same key with this body: must be 422
    doomed: bool  # scripted to fail permanently: must end dead
    pattern: str
    sends: int
    delay_s: float
    # A review's approval event: one of EVENT_PLANS (None: not a review).
    event: str | None = None

    @property
    def route(self) -> str:
        return ROUTES[self.workflow]

    @property
    def sleeps(self) -> bool:
        return float(self.body.get("sleep_s", 0)) > 0


def approval_of(p: Planned) -> dict[str, Any]:
    """The approval event a review's client sends."""
    return {"approved": p.index % 4 != 0, "by": f"reviewer{p.index}"}


def conflicting_approval_of(p: Planned) -> dict[str, Any]:
    """Another approval for the same review: must be refused (409)."""
    return {"approved": p.index % 4 == 0, "by": f"imposter{p.index}"}


def plan(requests: int, seed: int, workflows: tuple[str, ...] = KNOWN_WORKFLOWS) -> list[Planned]:
    rng = random.Random(seed)
    return [_planned(i, seed, rng, workflows) for i in range(requests)]


def _planned(i: int, seed: int, rng: random.Random, workflows: tuple[str, ...]) -> Planned:
    workflow = rng.choice(workflows)
    doomed = rng.random() < DOOMED_SHARE
    reuse = rng.random() < REUSE_SHARE
    marker = f"req-{i:06d} seed-{seed}"
    body, other, event = _bodies(workflow, marker, doomed, i, rng)
    return Planned(
        index=i,
        tenant=TENANTS[i % len(TENANTS)],
        workflow=workflow,
        key=f"chaos-{seed}-{workflow}-{i:06d}",
        body=body,
        reused_body=other if reuse else None,
        doomed=doomed,
        pattern=rng.choices(PATTERNS, PATTERN_WEIGHTS)[0],
        sends=rng.randint(1, 3),
        delay_s=rng.uniform(2.0, 8.0),
        event=event,
    )


def _bodies(
    workflow: str, marker: str, doomed: bool, i: int, rng: random.Random
) -> tuple[dict[str, Any], dict[str, Any], str | None]:
    """The request's body, the other body its key is reused with, its event plan."""
    fate = " [[fake:400]]" if doomed else ""
    if workflow == "summaries":
        text = " ".join(rng.sample(SENTENCES, 3))
        body: dict[str, Any] = {"text": f"{marker}. {text}{fate}", "notify": f"user{i}@example.com"}
        return body, {**body, "text": body["text"] + " Edited."}, None
    if workflow in AGENT_WORKFLOWS:
        message = f"{marker}. My teapot {AGENT_ORDER} arrived broken. {AGENT_TOOLS}{fate}"
        body = {"customer": f"user{i}@example.com", "message": message}
        return body, {**body, "message": body["message"] + " Edited."}, None
    if workflow == "triage":
        subject, detail = rng.choice(SUBJECTS)
        body = {"subject": f"{marker}: {subject}", "body": f"{detail}{fate}"}
        return body, {**body, "body": body["body"] + " Edited."}, None
    event = rng.choices(EVENT_PLANS, EVENT_WEIGHTS)[0]
    times_out = event in ("after", "never")
    body = {
        "text": f"{marker}. {' '.join(rng.sample(SENTENCES, 2))}",
        "wait_s": round(rng.uniform(1.0, 3.0), 2) if times_out else EVENT_WAIT_S,
        "sleep_s": round(rng.uniform(1.0, 3.0), 2) if rng.random() < SLEEP_SHARE else 0.0,
        # Only the final model call fails: after a checkpoint, an effect and the wait.
        "fate": fate.strip(),
    }
    return body, {**body, "text": body["text"] + " Edited."}, event
