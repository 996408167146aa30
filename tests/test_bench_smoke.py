"""Every benchmark's smoke run (``python -m bench.<name> --smoke``): tiny
sizes and one round on the suite's servers (``bench.steps`` on its own
embedded ones: it restarts PostgreSQL), so none can rot. Each must end
with its invariants holding and write a report whose numbers and checks say
so; their profile buckets must name functions the code still has. Select
them with ``-m bench``. The intake needs ``wrk`` (Debian's package; .ci/run
installs it) and is skipped, saying so, where it is missing."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from bench import agents, agents_alone, intake, relay, steps, worker
from bench.harness import profile, report
from bench.harness.measure import Headline, Noise
from bench.summary import render

from tests.processes import ROOT

pytestmark = [pytest.mark.bench, pytest.mark.slow]

# Each smoke takes 10-45 s on an idle 2-core machine; the bound only keeps a
# hung one from holding the suite. The slack is wide: under the suite's own
# load in CI the agents smoke (six contenders, two profiled) took over 200 s.
SMOKE_TIMEOUT_S = 600
HAS_PY_SPY = profile.py_spy() is not None


def smoke(name: str, tmp_path: Path, urls: tuple[str, str] | None, *extra: str) -> dict[str, Any]:
    """``urls`` None: the benchmark's own embedded servers."""
    out = tmp_path / f"{name}.json"
    argv = [sys.executable, "-m", f"bench.{name}", "--smoke", "--out", str(out)]
    argv += ["--log-dir", str(tmp_path)]
    if urls is not None:
        argv += ["--redis-url", urls[0], "--database-url", urls[1]]
    done = subprocess.run(
        [*argv, *extra], cwd=ROOT, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S
    )
    assert done.returncode == 0, f"bench.{name} failed:\n{done.stderr[-4000:]}"
    result: dict[str, Any] = json.loads(out.read_text())
    assert json.loads(done.stdout) == result, "the report on stdout is the one written"
    assert result["benchmark"] == name and result["smoke"] is True and result["ok"] is True
    assert result["headline"] and all(h["value"] is not None for h in result["headline"])
    summary = render([result], tmp_path / "BENCHMARKS.md", tmp_path, None)
    assert all(h["what"] in summary for h in result["headline"])
    return result


def runs(results: dict[str, Any]) -> list[dict[str, Any]]:
    return [run for contender in results.values() for run in contender["runs"]]


def profile_args() -> tuple[str, ...]:
    return ("--profile",) if HAS_PY_SPY else ()


def assert_profiled(profiles: list[dict[str, Any]] | None) -> None:
    if not HAS_PY_SPY:
        return
    assert profiles
    for p in profiles:
        assert p["main_thread_samples"] > 0 and p["checks_ok"]
        assert sum(share for share, _ in p["buckets"].values()) == pytest.approx(1, abs=0.02)


@pytest.mark.timeout(SMOKE_TIMEOUT_S + 30)
def test_intake_smoke_checks_every_accepted_job_is_in_jobs_and_the_stream_once(
    tmp_path, redis_url, database_url
):
    if shutil.which("wrk") is None:
        pytest.skip("SKIPPED: wrk is not installed (apt-get install wrk; .ci/run installs it)")
    result = smoke(
        "intake", tmp_path, (redis_url, database_url), *(() if HAS_PY_SPY else ("--no-profile",))
    )

    every = runs(result["results"])
    assert {r["contender"] for r in every} == {
        "oncely",
        "floor",
        "minimal",
        "xadd",
        "oncely_dup30",
    }
    minimal = [r for r in every if r["contender"] == "minimal"]
    assert all(r["checks"]["rows"] >= r["checks"]["fresh_202"] > 0 for r in minimal)
    assert all(r["ok"] and r["metrics"]["req_per_s"] > 0 for r in every)
    oncely = [r for r in every if r["contender"] == "oncely"]
    assert all(r["checks"]["every_202_in_jobs_once"] for r in oncely)
    assert all(r["checks"]["every_202_in_stream_once"] for r in oncely)
    assert all(r["checks"]["distinct_202_job_ids"] > 0 for r in oncely)
    if HAS_PY_SPY:
        for name in ("profile", "profile_minimal"):
            prof = result[name]
            assert prof["main_thread_samples"] > 0
            shares = [share for share, _ in prof["buckets"].values()]
            ms = [ms for _, ms in prof["buckets"].values()]
            assert sum(shares) == pytest.approx(1, abs=0.02)
            assert sum(ms) == pytest.approx(prof["main_thread_ms_per_request"], rel=0.05)


@pytest.mark.timeout(SMOKE_TIMEOUT_S + 30)
def test_worker_smoke_does_every_job_once_for_oncely_and_both_floors(
    tmp_path, redis_url, database_url
):
    result = smoke("worker", tmp_path, (redis_url, database_url), *profile_args())

    every = runs(result["scenarios"][0]["results"])
    assert {r["contender"] for r in every} == {
        "oncely@256",
        "oncely_lean@256",
        "floor_openai@256",
        "floor_aiohttp@256",
    }
    for r in every:
        c = r["checks"]
        assert r["ok"] and c["done"] == c["results"] == c["outbox"] == c["jobs"] > 0
        assert c["model_calls"] == c["jobs"] and c["pending_after_done"] == 0
    assert_profiled(result["profiles"])


@pytest.mark.timeout(SMOKE_TIMEOUT_S + 30)
def test_agents_smoke_runs_each_tool_and_call_once_through_every_contender(tmp_path):
    """oncely.Agent, the work by hand, and the same agent through each
    framework's integration: every tool and call once, the call's wait
    measured, the job path's statements per turn equal to the agent's."""
    # Its own embedded servers: it loads pg_stat_statements, which needs a restart.
    result = smoke("agents", tmp_path, None, *profile_args())

    every = {r["contender"]: r for r in runs(result["results"])}
    frameworks = {"pydantic_ai@64", "openai_agents@64", "langgraph@64"}
    assert set(every) == {"agent@64", "by_hand@64", "at_most_once@64", *frameworks}
    for r in every.values():
        c = r["checks"]
        n = c["jobs"]
        assert r["ok"] and c["done"] == c["calls_effects"] == c["calls_answered"] == n > 0
        assert c["model_calls"] == c["model_calls_expected"] == 4 * n
        assert c["side_calls"] == c["side_calls_distinct"] == 2 * n
        assert r["metrics"]["call_wait_p50_ms"] > 0
    agent = every["agent@64"]["checks"]
    ours = agent["statements"]
    # Checkpoint writes and finishes are batched across jobs: at most one
    # statement each; the wait is one a job.
    assert 0 < ours["write_checkpoints"] <= agent["checkpoint_rows"]
    assert 0 < ours["finish_job"] <= agent["jobs"]
    assert ours["start_wait"] == agent["jobs"], ours
    for name in frameworks:
        c = every[name]["checks"]
        theirs = c["statements"]
        assert all(theirs.get(s) == ours[s] for s in agents.PER_JOB), (name, theirs, ours)
        assert 0 < theirs["finish_job"] <= c["jobs"], (name, theirs)
        assert c["checkpoint_rows"] == agent["checkpoint_rows"], name
    # One tool at most once: its intent is one checkpoint more per job, and
    # at most one write more.
    once = every["at_most_once@64"]["checks"]
    assert once["checkpoint_rows"] == agent["checkpoint_rows"] + once["jobs"]
    [intent_cost] = [h for h in result["headline"] if "at-most-once" in h["what"]]
    assert intent_cost["meets_goal"]
    for kind in ("pydantic_ai", "openai_agents", "langgraph"):
        assert result["ratios"][f"{kind}_vs_agent@64"]["cpu_per_job"]["value"] > 0
    if HAS_PY_SPY:
        assert_profiled(result["profiles"])
        framework = next(p for p in result["profiles"] if p["contender"] != "agent@64")
        assert any(name.startswith("framework:") for name in framework["buckets"])
        assert any(name.startswith("adapter:") for name in framework["buckets"])


async def test_agents_alone_runs_each_contender_to_its_call_and_again_in_process():
    """bench.agents_alone: every contender's four turns, the run to the call
    and its replay (checked per contender), CPU and Python calls per job."""
    report = await agents_alone.measure(agents_alone.CONTENDERS, 1, 2)
    rows = report["results"]
    assert set(rows) == set(agents_alone.CONTENDERS)
    assert all(r["cpu_ms_per_job"] > 0 for r in rows.values())
    ours = rows["agent"]["python_calls_per_job"]
    assert ours > 0 and rows["agent"]["calls_vs_agent"] == 1.0
    for kind in ("pydantic_ai", "openai_agents", "langgraph"):
        assert rows[kind]["python_calls_per_job"] > ours, rows


@pytest.mark.timeout(SMOKE_TIMEOUT_S + 30)
def test_maps_smoke_runs_every_child_once_and_ends_the_map(tmp_path):
    # Its own embedded servers: it loads pg_stat_statements, which needs a restart.
    result = smoke("maps", tmp_path, None)

    every = {r["contender"]: r for r in runs(result["results"])}
    assert set(every) == {"map", "posted"}
    for r in every.values():
        c = r["checks"]
        assert r["ok"] and c["items_done"] == c["model_calls"] == c["jobs"] > 0
        assert c["held"] == 0
    mapped = every["map"]["checks"]
    assert mapped["parent_done"] == 1 and mapped["map_done"] == mapped["jobs"]
    assert mapped["statements"]["count_ended_children"] > 0


@pytest.mark.timeout(SMOKE_TIMEOUT_S + 30)
def test_streams_smoke_streams_every_token_and_fans_events_out(tmp_path, redis_url, database_url):
    result = smoke("streams", tmp_path, (redis_url, database_url))

    every = {r["contender"]: r for r in runs(result["results"])}
    assert set(every) == {"streamed", "plain"}
    streamed = every["streamed"]["checks"]
    assert every["streamed"]["ok"] and streamed["done"] == streamed["model_calls"] > 0
    assert streamed["tokens_equal_the_summary"] > 0 and streamed["token_events_per_call"] >= 1
    fanned = result["fan_out"]
    assert fanned["ok"] and fanned["readers_with_every_event"] == fanned["streams"] > 0
    assert fanned["delay_p99_ms"] is not None


@pytest.mark.timeout(SMOKE_TIMEOUT_S + 30)
def test_steps_smoke_stores_every_checkpoint_once_and_counts_the_statements(tmp_path):
    # Its own embedded servers: it loads pg_stat_statements, which needs a restart.
    result = smoke("steps", tmp_path, None, *profile_args())

    assert result["statements_counted_by"] == "pg_stat_statements"
    every = {r["contender"]: r for r in runs(result["results"])}
    assert set(every) == {"four_checkpoints@256", "one_call@256"}
    for r in every.values():
        c = r["checks"]
        n = c["jobs"]
        assert r["ok"] and c["done"] == c["results"] == c["outbox"] == c["deliveries_done"] == n > 0
        assert c["outbox_keys_are_the_jobs"] and c["pending_after_done"] == 0
        assert c["checkpoints"] == c["checkpoints_expected"] and c["checkpoint_keys_as_expected"]
        assert c["model_calls"] == c["model_calls_expected"] == c["prompts_billed_once"]
        assert c["side_calls"] == c["side_calls_distinct"] == n
    four, one = (every[f"{k}@256"]["checks"] for k in ("four_checkpoints", "one_call"))
    # Four checkpoints: three writes of their own, the last one rides in the
    # result's; one checkpoint: none of its own. Both batched across jobs:
    # at most one statement a write.
    assert 0 < four["statements"]["write_checkpoints"] <= 3 * four["jobs"]
    assert 0 < four["statements"]["finish_job"] <= four["jobs"]
    assert "write_checkpoints" not in one["statements"]
    assert 0 < one["statements"]["finish_job"] <= one["jobs"]
    assert_profiled(result["profiles"])


@pytest.mark.timeout(SMOKE_TIMEOUT_S + 30)
def test_relay_smoke_sends_every_row_once_for_oncely_and_both_minimal_relays(
    tmp_path, redis_url, database_url
):
    result = smoke("relay", tmp_path, (redis_url, database_url), *profile_args())

    every = runs(result["scenarios"][0]["results"])
    assert {r["contender"] for r in every} == {"oncely", "minimal", "minimal_batched"}
    for r in every:
        c = r["checks"]
        assert r["ok"] and c["sent"] == c["provider_effects"] == c["rows"] > 0
        assert c["effects_are_the_rows"] and c["failed"] == 0
    assert_profiled(result["profiles"])


@pytest.mark.timeout(SMOKE_TIMEOUT_S + 30)
def test_end_to_end_smoke_delivers_one_email_per_post(tmp_path, redis_url, database_url):
    result = smoke("end_to_end", tmp_path, (redis_url, database_url))

    c = result["checks"]
    assert c["posted"] == c["accepted_202"] == c["done"] == c["provider_effects"] > 0
    assert c["mailbox_lines"] == c["posted"]
    assert result["latency"]["latency_ms"]["p50"] > 0
    assert result["throughput"]["emails_per_s"] > 0


@pytest.mark.timeout(SMOKE_TIMEOUT_S + 30)
def test_memory_smoke_reads_the_workers_rss_with_every_slot_held(tmp_path, redis_url, database_url):
    result = smoke("memory", tmp_path, (redis_url, database_url))

    c = result["checks"]
    assert c["done"] == c["jobs"] and c["model_calls"] == c["jobs"]
    assert c["samples_at_full"] > 0
    assert result["rss_mb"]["at_full_concurrency"] > result["rss_mb"]["idle"] > 0


@pytest.mark.standalone_redis("compares single-server clients")
def test_redis_commands_compares_both_paths(redis_url):
    argv = [sys.executable, "-m", "bench.redis_commands", "--redis-url", redis_url]
    done = subprocess.run(
        [*argv, "--commands", "300", "--rounds", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=SMOKE_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)
    for path in ("pooled", "shared"):
        for command in ("set_nx_px_get", "evalsha"):
            assert result["cpu_us_per_command"][path][command]["median"] > 0


# --- the harness itself


def test_every_profile_bucket_names_a_live_function():
    specs = (*worker.BUCKETS.values(), *relay.BUCKETS.values(), intake.PROFILE_BUCKETS)
    for spec in (*specs, steps.BUCKETS, agents.BUCKETS):
        assert profile.buckets(spec)


def test_a_package_bucket_takes_any_frame_of_its_files_a_namespace_package_its_subpackages():
    regular, namespace = profile.buckets(
        [("pydantic ai", ["pydantic_ai/"]), ("langgraph", ["langgraph/"])]
    )
    assert regular.files == ("(pydantic_ai/",)
    assert "(pregel/" in namespace.files and "(checkpoint/memory/" in namespace.files
    stack = ";run (asyncio/runners.py:190);Pregel.ainvoke (pregel/main.py:4202)"
    assert namespace.holds(stack) and not regular.holds(stack)
    assert not regular.holds(";run (oncely/integrations/pydantic_ai.py:128)")
    with pytest.raises(profile.MissingFunction, match="not a package"):
        profile.buckets([("a module", ["json.decoder/"])])


def test_a_bucket_naming_a_missing_function_is_an_error():
    with pytest.raises(profile.MissingFunction, match=r"Worker\._gone"):
        profile.buckets([("gone", ["oncely.queue.worker:Worker._gone"])])
    with pytest.raises(profile.MissingFunction, match="no module"):
        profile.buckets([("gone", ["oncely.no_such_module:f"])])


def test_a_run_whose_invariants_fail_writes_its_report_and_exits_1(
    tmp_path, redis_url, database_url, monkeypatch
):
    monkeypatch.setattr(report, "sigterm_unwinds", lambda: None)  # the suite's own handlers
    monkeypatch.setattr("oncely.logs.configure_logging", lambda *a: None)  # and logging
    p = report.parser(
        "fails", "A benchmark whose checks fail.", rounds=1, noise=Noise(0.3, 0, 0, 0)
    )
    out = tmp_path / "fails.json"
    args = p.parse_args(
        ["--smoke", "--out", str(out), "--redis-url", redis_url, "--database-url", database_url]
    )

    async def body(ctx: report.Context) -> tuple[list[Headline], dict[str, Any], bool]:
        return [Headline("fast and wrong", 99.0)], {"checks": {"done": 1, "jobs": 2}}, False

    with pytest.raises(SystemExit) as exit_:
        report.main("fails", "fails", args, body)

    assert exit_.value.code == 1
    written = json.loads(out.read_text())
    assert written["ok"] is False and written["checks"] == {"done": 1, "jobs": 2}
    assert "FAILED" in render([written], tmp_path / "B.md", tmp_path, None)
