"""``ctx.patched``: a deploy that changes a step's checkpoints keeps jobs in
flight on their old path and sends new jobs down the new one, instead of
killing the first as nondeterministic (docs/durable-steps.md, "Deploying
changed steps"). Through ``oncely.testing`` and through a real worker over
PostgreSQL, old code's job resumed by new code."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from oncely import App, Context, Workflow
from oncely.errors import Nondeterministic
from oncely.testing import run_step
from tests.durable import Harness, drain

VERIFIED: list[str] = []


class Ask(BaseModel):
    text: str


class Done(BaseModel):
    path: str


class Go(BaseModel):
    ok: bool


def verify(text: str) -> str:
    VERIFIED.append(text)
    return "verified"


async def before(request: Ask, ctx: Context) -> Done:
    await ctx.model.complete(request.text)
    await ctx.wait_for_event("go")
    await ctx.step("send", lambda: "sent")
    return Done(path="old")


async def after(request: Ask, ctx: Context) -> Done:
    await ctx.model.complete(request.text)
    if ctx.patched("verify-first"):
        await ctx.step("verify", verify, request.text)
        path = "new"
    else:
        path = "old"
    await ctx.wait_for_event("go")
    await ctx.step("send", lambda: "sent")
    return Done(path=path)


async def unpatched(request: Ask, ctx: Context) -> Done:
    await ctx.model.complete(request.text)
    await ctx.step("verify", verify, request.text)
    await ctx.wait_for_event("go")
    await ctx.step("send", lambda: "sent")
    return Done(path="new")


def deployed(step) -> Workflow:
    return Workflow(
        name="deploys",
        route="/v1/deploys",
        request=Ask,
        result=Done,
        step=step,
        events={"go": Go},
    )


@pytest.fixture(autouse=True)
def _forget() -> None:
    VERIFIED.clear()


async def test_a_run_stored_before_the_patch_keeps_its_path_and_a_new_one_takes_the_new() -> None:
    old = await run_step(
        deployed(before), {"text": "Hi."}, answers=["ok"], events={"go": {"ok": True}}
    )
    resumed = await run_step(
        deployed(after),
        {"text": "Hi."},
        answers=[],
        events={"go": {"ok": True}},
        resume_from=old.until("go"),
    )
    assert resumed.result.path == "old" and VERIFIED == []
    assert "verify-first" not in resumed.steps

    fresh = await run_step(
        deployed(after), {"text": "Hi."}, answers=["ok"], events={"go": {"ok": True}}
    )
    assert fresh.result.path == "new" and VERIFIED == ["Hi."]
    assert fresh.steps == ("model", "verify-first", "verify", "go", "send")


async def test_a_new_run_replays_its_own_marker_after_a_crash() -> None:
    run = await run_step(
        deployed(after),
        {"text": "Hi."},
        answers=["ok"],
        events={"go": {"ok": True}},
        crash_after="verify",
    )
    assert run.result.path == "new"
    assert VERIFIED == ["Hi."], "the verify step ran once"


async def test_without_the_patch_the_same_deploy_is_nondeterministic() -> None:
    old = await run_step(
        deployed(before), {"text": "Hi."}, answers=["ok"], events={"go": {"ok": True}}
    )
    with pytest.raises(Nondeterministic):
        await run_step(
            deployed(unpatched),
            {"text": "Hi."},
            answers=[],
            events={"go": {"ok": True}},
            resume_from=old.until("go"),
        )


async def test_a_job_waiting_across_a_deploy_resumes_on_its_old_path(custom, pool) -> None:
    old_code: Harness = await custom(App([deployed(before)]))
    job_id = await old_code.submit("/v1/deploys", {"text": "In flight."})
    await drain(old_code.worker("deploys"))
    assert await old_code.status(job_id) == "waiting"

    # The deploy: the new code, and a job started after it.
    new_code: Harness = await custom(App([deployed(after)]))
    fresh = await new_code.submit("/v1/deploys", {"text": "After the deploy."})
    event = await new_code.send_event("/v1/deploys", job_id, "go", {"ok": True})
    assert event.status_code == 202
    await drain(new_code.worker("deploys"))
    for waiting in (fresh,):
        r = await new_code.send_event("/v1/deploys", waiting, "go", {"ok": True})
        assert r.status_code == 202
    await drain(new_code.worker("deploys"))

    old_view = await new_code.get("/v1/deploys", job_id)
    new_view = await new_code.get("/v1/deploys", fresh)
    assert (old_view["status"], old_view["result"]["path"]) == ("done", "old")
    assert (new_view["status"], new_view["result"]["path"]) == ("done", "new")
    assert [s["key"] for s in old_view["steps"]] == ["model", "go", "send"]
    assert [s["key"] for s in new_view["steps"]] == [
        "model",
        "verify-first",
        "verify",
        "go",
        "send",
    ]
    assert VERIFIED == ["After the deploy."]


OLD_APP = App([deployed(before)])
UNPATCHED_APP = App([deployed(unpatched)])


async def test_jobs_a_deploy_broke_are_listed_and_rerun_from_their_last_match(custom) -> None:
    from oncely.cli.ops import list_jobs, rewind_nondeterministic

    old_code: Harness = await custom(OLD_APP)
    job_id = await old_code.submit("/v1/deploys", {"text": "In flight."})
    await drain(old_code.worker("deploys"))
    assert (await old_code.send_event("/v1/deploys", job_id, "go", {"ok": True})).status_code == 202

    # A deploy without ctx.patched: the job in flight is dead.
    broken: Harness = await custom(UNPATCHED_APP)
    await drain(broken.worker("deploys"))
    assert (await broken.get("/v1/deploys", job_id))["error"] == "nondeterministic"

    settings = broken.settings.model_copy(update={"app": "tests.test_patched:UNPATCHED_APP"})
    listed = await list_jobs(
        settings, workflow=None, status="dead", reason="nondeterministic", limit=10
    )
    assert [str(j.job_id) for j in listed] == [job_id]
    dry = await rewind_nondeterministic(settings, limit=10, dry_run=True)
    assert [(j, key) for j, key, _ in dry] == [(job_id, "go")]
    assert await broken.status(job_id) == "dead"
    done = await rewind_nondeterministic(settings, limit=10, dry_run=False)
    assert done[0][2] is not None and done[0][2].deleted == ("go",)

    await drain(broken.worker("deploys"))
    view = await broken.get("/v1/deploys", job_id)
    assert (view["status"], view["result"]["path"]) == ("done", "new")
    assert [s["key"] for s in view["steps"]] == ["model", "verify", "go", "send"]
    assert broken.calls("In flight.") == 1, "the model checkpoint kept: not paid again"
