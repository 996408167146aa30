"""The JSON report: the checks' violations and tallies, the kills, the scenarios."""

from __future__ import annotations

import collections
import json
from dataclasses import asdict
from typing import Any

from bench.chaos.checks import (
    StepTally,
    Tally,
    Violations,
    check_effects,
    check_intake,
    check_jobs,
    check_model_calls,
    check_reviews,
)
from bench.chaos.common import FLEET_SETTINGS
from bench.chaos.evidence import Evidence
from bench.chaos.fleet import FAKES, Exit, Kill, ScenarioRun
from bench.chaos.plan import Options
from bench.chaos.traffic import Answer, Outcome


def report(
    options: Options,
    outcomes: list[Outcome],
    e: Evidence,
    kills: list[Kill],
    exits: list[Exit],
    scenarios: list[ScenarioRun],
    timings: dict[str, float],
    drained: tuple[bool, dict[str, Any]],
) -> dict[str, Any]:
    v, t, s = Violations(), Tally(), StepTally()
    if not drained[0]:
        v.add("did_not_converge", json.dumps(drained[1]))
    for x in exits:
        if x.role in FAKES:
            v.add("fake_died", f"{x.name} exited {x.code}: {x.last_line[:300]}")
    check_intake(outcomes, v, t)
    check_jobs(outcomes, e, v, t)
    check_effects(outcomes, e, v, t)
    check_model_calls(outcomes, e, kills, scenarios, v, t)
    check_reviews(outcomes, e, kills, scenarios, v, s)
    return {
        "ok": not v.counts,
        "seed": options.seed,
        "requests": len(outcomes),
        "http_attempts": sum(a.attempts for o in outcomes for a in _sends(o)),
        "client_retries": dict(sum((a.retried for o in outcomes for a in _sends(o)), _counter())),
        "accepted": t.accepted,
        "replays": t.replays,
        "reused_key_422": t.reused_422,
        "done": t.done,
        "dead": t.dead,
        "dead_scripted": t.dead_scripted,
        "lost": t.lost,
        "duplicate_effects": t.duplicate_effects,
        "effects": e.deliveries["effects"],
        "effects_expected": t.effects_expected,
        "provider_requests": e.deliveries["requests"],
        "raw_duplicate_sends": e.deliveries["requests"] - e.deliveries["effects"],
        "provider_faults": e.deliveries.get("faults", {}),
        "model": _model_section(e, t),
        "multi_step": _multi_step_section(s),
        "agents": _agents_section(t),
        "kills": _kills_section(kills),
        "unexpected_exits": [asdict(x) for x in exits],
        "scenarios": [_scenario_json(s) for s in scenarios],
        "timings_s": timings,
        "config": _config(options),
        "violations": v.to_json(),
    }


def _sends(o: Outcome) -> list[Answer]:
    return [*o.answers, *([o.reuse] if o.reuse else [])]


def _counter() -> collections.Counter[str]:
    return collections.Counter()


def _model_section(e: Evidence, t: Tally) -> dict[str, Any]:
    done = max(t.one_call_done, 1)
    return {
        "calls": e.calls["total"],
        "calls_per_done_job": round(t.one_call_calls / done, 3),
        "billed_for_done_jobs": t.billed,
        "billed_per_done_job": round(t.billed / done, 4),
        "excess_model_calls": t.calls.total,
        "jobs_with_excess": t.calls.items,
        "excess_explained_by": dict(t.calls.explained),
        "excess_examples": t.calls.examples,
        "worker_kills_explaining_excess": len(t.explaining_kills),
        "random_faults": e.calls.get("random_faults", {}),
    }


def _agents_section(t: Tally) -> dict[str, Any]:
    a = t.agents
    return {
        "workflow": a.workflow,
        "done": a.done,
        "turns_stored": a.turns,
        "billed_for_turns": a.billed,
        "excess_model_calls": a.calls.total,
        "jobs_with_excess": a.calls.items,
        "excess_explained_by": dict(a.calls.explained),
        "excess_examples": a.calls.examples,
        "refund_calls_answered": a.refunds_answered,
        "refunds_received": a.refunds_received,
        "replies": a.replies,
    }


def _multi_step_section(s: StepTally) -> dict[str, Any]:
    late = s.sleep_late_s
    return {
        "workflow": "reviews",
        "accepted": s.accepted,
        "done": s.done,
        "dead": s.dead,
        "dead_scripted": s.dead_scripted,
        "lost": s.lost,
        "event_plans": dict(s.plans),
        "waited": s.waited,
        "timed_out": s.timed_out,
        "timed_out_unplanned": s.timed_out_unplanned,
        "events": {**s.events, "answers": dict(sorted(s.answers.items()))},
        "sleeps": s.sleeps,
        "sleep_late_s": {
            "min": round(min(late), 3) if late else None,
            "mean": round(sum(late) / len(late), 3) if late else None,
            "max": round(max(late), 3) if late else None,
        },
        "model_calls": {
            "checkpoints": s.prompts,
            "billed": s.billed,
            "prompts_by_billed_calls": {str(n): k for n, k in sorted(s.per_prompt.items())},
            "excess": s.calls.total,
            "calls_with_excess": s.calls.items,
            "excess_explained_by": dict(s.calls.explained),
            "excess_examples": s.calls.examples,
        },
        "side_steps": {
            "checkpoints": s.side_checkpoints,
            "runs": s.side_runs,
            "extra_runs": s.side.total,
            "extra_explained_by": dict(s.side.explained),
            "latest_extra_run_after_checkpoint_s": s.latest_extra_run_s,
            "extra_examples": s.side.examples,
        },
    }


def _kills_section(kills: list[Kill]) -> dict[str, Any]:
    by_role = collections.Counter(k.role for k in kills)
    return {"total": len(kills), **{role: by_role[role] for role in ("worker", "relay", "api")}}


def _scenario_json(s: ScenarioRun) -> dict[str, Any]:
    return {
        "name": s.name,
        "at_s": s.at_s,
        "took_s": s.took_s,
        "api_ready_after_s": s.api_ready_after_s,
        "detail": s.detail,
    }


def _config(options: Options) -> dict[str, Any]:
    return {
        "app": options.app,
        "requests": options.requests,
        "rate": options.rate,
        "kill_every_s": options.kill_every,
        "kill_api": options.kill_api,
        "scenarios": list(options.scenarios),
        "workers": options.workers,
        "relays": options.relays,
        "llm_client": options.llm_client,
        "model_faults": options.model_faults,
        "mail_faults": options.mail_faults,
        "settings": {k: v for k, v in FLEET_SETTINGS.items() if k != "ONCELY_WEBHOOK_SECRET"},
    }
