"""Fan-out (docs/fanout.md): ``ctx.map`` starts one child job per item, at
most ``concurrency`` of them queued or running at once, and the parent waits
holding nothing until every child has ended, then gets each outcome in item
order. Real workers, Redis and PostgreSQL in process; the model is the fake
server. Counted: children started, model calls paid, outbox rows, statuses."""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any

import pytest
from pydantic import BaseModel

from oncely import App, ChildResult, Context, Workflow, webhook
from oncely.cli.ops import cancel_job
from oncely.jobs.reconcile import Reconciler
from oncely.jobs.timers import Timers
from tests.durable import Harness, drain, until_async
from tests.maps_app import Batch, Item, Said


class Digest(BaseModel):
    lines: list[str]
    statuses: list[str]


async def say(item: Item, ctx: Context) -> Said:
    said = await ctx.model.complete(f"item: {item.text}")
    ctx.emit("item.said", {"job_id": ctx.job_id, "said": said})
    return Said(said=said)


ITEM = Workflow(
    name="map_item",
    route="/v1/map-items",
    request=Item,
    result=Said,
    step=say,
    effects=[webhook("item.said")],
)
SEEN: list[list[ChildResult[Any]]] = []


async def digest(batch: Batch, ctx: Context) -> Digest:
    results = await ctx.map(ITEM, [{"text": t} for t in batch.texts], concurrency=batch.concurrency)
    SEEN.append(results)
    lines = [r.result.said if r.ok and r.result else f"{r.status}: {r.error}" for r in results]
    ctx.emit("digest.done", {"job_id": ctx.job_id, "lines": len(lines)})
    return Digest(lines=lines, statuses=[r.status for r in results])


DIGEST = Workflow(
    name="map_digest",
    route="/v1/map-digests",
    request=Batch,
    result=Digest,
    step=digest,
    effects=[webhook("digest.done")],
)
APP = App([DIGEST, ITEM])


@pytest.fixture
async def maps(custom: Any) -> Harness:
    SEEN.clear()
    h: Harness = await custom(APP)
    # Each child is paid for once only if no call times out: the harness's
    # 2 s timeout fired on a CI machine that stalled for 3 s, so these maps
    # get the settings' default timeout and a budget to match.
    h.settings = h.settings.model_copy(update={"llm_timeout_s": 20.0, "job_budget_s": 60.0})
    return h


async def children_of(h: Harness, parent: str) -> list[tuple[str, str, int]]:
    rows = await h.rows(
        "SELECT job_id::text, status, position FROM jobs WHERE parent_id = %s ORDER BY position",
        parent,
    )
    return [(str(a), str(b), int(c)) for a, b, c in rows]


async def run_map(h: Harness, parent: str, *, limit: int | None = None) -> int:
    """Run both workflows' workers until the parent has ended; the most
    children seen queued or running at once."""
    parents, items = h.worker("map_digest"), h.worker("map_item")
    most = 0
    for _ in range(400):
        await drain(parents)
        active = await h.rows(
            "SELECT count(*) FROM jobs WHERE parent_id = %s AND status IN ('queued', 'waiting')",
            parent,
        )
        most = max(most, int(active[0][0]))
        if limit is not None:
            assert most <= limit, f"{most} children queued or running at once"
        await drain(items)
        if await h.status(parent) in ("done", "dead", "cancelled"):
            return most
    raise AssertionError("the map never ended")


async def test_thirty_items_at_concurrency_five_each_once_in_order(maps: Harness) -> None:
    h = maps
    texts = [f"Item number {n} is here. It has a tail. Dropped." for n in range(30)]
    parent = await h.submit("/v1/map-digests", {"texts": texts, "concurrency": 5})
    await drain(h.worker("map_digest"))

    view = await h.get("/v1/map-digests", parent)
    assert view["status"] == "waiting"
    assert view["waiting"]["children"] == {
        "workflow": "map_item", "total": 30, "done": 0, "dead": 0, "cancelled": 0,
        "running": 5, "queued": 25,
    }  # fmt: skip
    children = await children_of(h, parent)
    assert [p for _, _, p in children] == list(range(30))
    assert [s for _, s, _ in children].count("queued") == 5
    child = await h.get("/v1/map-items", children[7][0])
    assert child["status"] == "queued" and child["parent"] == parent

    most = await run_map(h, parent, limit=5)
    assert most == 5
    view = await h.get("/v1/map-digests", parent)
    assert view["status"] == "done"
    assert view["result"]["lines"] == [
        f"item: Item number {n} is here. It has a tail." for n in range(30)
    ]
    # Every child paid for once, its effect once; the parent's once.
    assert all(h.calls(f"item: Item number {n} is") == 1 for n in range(30))
    item_rows = await h.rows("SELECT count(*) FROM outbox WHERE topic = 'item.said'")
    assert item_rows[0][0] == 30
    assert await h.outbox(parent) == ["digest.done"]
    assert view["usage"]["children"]["model_calls"] == 30
    assert [s["kind"] for s in view["steps"]] == ["map"]
    assert [r.job_id for r in SEEN[-1]] == [c for c, _, _ in children]
    # The parent's step ran twice (the wait, then the resume), its map once.
    assert (await h.rows("SELECT count(*) FROM job_maps WHERE parent_id = %s", parent))[0][0] == 1


async def test_a_dead_child_settles_and_the_parent_is_done(maps: Harness) -> None:
    h = maps
    texts = ["Fine one. Yes.", "Refused. [[fake:400]]", "Fine two. Yes."]
    parent = await h.submit("/v1/map-digests", {"texts": texts, "concurrency": 2})
    await run_map(h, parent)
    view = await h.get("/v1/map-digests", parent)
    assert view["status"] == "done"
    assert view["result"]["statuses"] == ["done", "dead", "done"]
    assert view["result"]["lines"][1] == "dead: permanent"
    assert h.calls("item: Refused.") == 1


async def test_cancelling_the_parent_cancels_its_unfinished_children(maps: Harness) -> None:
    h = maps
    texts = [f"Cancel me {n}. Now." for n in range(6)]
    parent = await h.submit("/v1/map-digests", {"texts": texts, "concurrency": 2})
    await drain(h.worker("map_digest"))
    r = await h.api.post(f"/v1/map-digests/{parent}/cancel", headers=h.auth)
    assert r.status_code == 202, r.text
    assert {s for _, s, _ in await children_of(h, parent)} == {"cancelled"}
    await drain(h.worker("map_item"))
    assert sum(h.calls(f"item: Cancel me {n}.") for n in range(6)) == 0
    assert await h.status(parent) == "cancelled"


async def test_a_released_child_and_a_resumed_parent_are_told_queued(maps: Harness) -> None:
    """A held child let go by another's end, and the parent its map's end
    resumes, each reach the jobs' transitions as ``queued`` (so a page
    following either job's stream hears it), once."""
    h = maps
    told: list[tuple[str, str, str]] = []
    h.jobs.transitions.subscribe(lambda w, job, status, _extra: told.append((w, job, status)))
    parent = await h.submit("/v1/map-digests", {"texts": ["One. A.", "Two. B."], "concurrency": 1})
    await drain(h.worker("map_digest"))
    first, second = [c for c, _, _ in await children_of(h, parent)]
    await drain(h.worker("map_item"))  # the first child; the second released
    assert ("map_item", second, "queued") in told
    await drain(h.worker("map_item"))  # the second child; the map ends
    assert told.count(("map_digest", parent, "queued")) == 1
    assert ("map_item", first, "queued") not in told  # queued from the start: no change
    await drain(h.worker("map_digest"))
    assert await h.status(parent) == "done"


@pytest.mark.parametrize("door", ["api", "cli"])
async def test_a_child_a_person_cancels_counts_in_its_map_at_once(maps: Harness, door: str) -> None:
    """A child cancelled through the API or ``oncely jobs cancel`` ends in its
    map's counts at once (its end told to ``Jobs.transitions``, whose map
    listener each door wires), not at the repair pass: a held child takes
    its place."""
    h = maps
    texts = [f"Hold me {n}. Now." for n in range(3)]
    parent = await h.submit("/v1/map-digests", {"texts": texts, "concurrency": 1})
    await drain(h.worker("map_digest"))
    first = (await children_of(h, parent))[0][0]
    if door == "api":
        r = await h.api.post(f"/v1/map-items/{first}/cancel", headers=h.auth)
        assert r.status_code == 202, r.text
    else:
        settings = h.settings.model_copy(update={"app": "tests.test_maps:APP"})
        assert await cancel_job(settings, uuid.UUID(first), workflow="map_item") is not None
    assert [s for _, s, _ in await children_of(h, parent)] == ["cancelled", "queued", "held"]
    view = await h.get("/v1/map-digests", parent)
    assert view["waiting"]["children"] == {
        "workflow": "map_item", "total": 3, "done": 0, "dead": 0, "cancelled": 1,
        "running": 1, "queued": 1,
    }  # fmt: skip
    await run_map(h, parent)
    assert (await h.get("/v1/map-digests", parent))["result"]["statuses"] == [
        "cancelled",
        "done",
        "done",
    ]


async def test_a_map_completes_after_redis_lost_everything(maps: Harness) -> None:
    h = maps
    texts = [f"Flushed {n}. Still done." for n in range(4)]
    parent = await h.submit("/v1/map-digests", {"texts": texts, "concurrency": 2})
    await drain(h.worker("map_digest"))
    await h.redis.flushdb()
    for stream in h.jobs.streams.values():
        await stream.ensure_group()
    # PostgreSQL is the record: the reconciler restores the queued children.
    restored = await Reconciler(h.jobs, "map_item", after_s=0).run_once()
    assert restored == 2
    await run_map(h, parent)
    assert (await h.get("/v1/map-digests", parent))["result"]["statuses"] == ["done"] * 4
    assert all(h.calls(f"item: Flushed {n}.") == 1 for n in range(4))


async def test_an_uncounted_child_end_is_repaired(maps: Harness) -> None:
    """A worker that died between a child's result and its count: the
    timers' repair pass counts it, and the map goes on."""
    h = maps
    parent = await h.submit("/v1/map-digests", {"texts": ["Lost count. Yes."], "concurrency": 1})
    await drain(h.worker("map_digest"))
    [(child, _, _)] = await children_of(h, parent)
    # The child's result stored as a worker would, its count never made.
    await h.jobs.finish("map_item", child, {"said": "Lost count."}, None)
    assert await h.status(parent) == "waiting"
    await h.checkpoints.children.repair(age_s=0)
    await until_async(lambda: _status_is(h, parent, "queued"))
    await run_map(h, parent)
    assert (await h.get("/v1/map-digests", parent))["result"]["lines"] == ["Lost count."]


async def _status_is(h: Harness, job_id: str, status: str) -> bool:
    return await h.status(job_id) == status


async def test_a_rewound_parent_reuses_its_childrens_results(maps: Harness) -> None:
    h = maps
    parent = await h.submit("/v1/map-digests", {"texts": ["Once only. Yes."], "concurrency": 1})
    await run_map(h, parent)
    await h.rows("UPDATE jobs SET status = 'dead' WHERE job_id = %s RETURNING 1", parent)
    await h.checkpoints.rewind(uuid.UUID(parent), "map")
    await run_map(h, parent)
    assert h.calls("item: Once only.") == 1
    assert (await h.get("/v1/map-digests", parent))["result"]["lines"] == ["item: Once only. Yes."]


async def test_too_many_items_or_a_bad_concurrency_kill_the_parent_and_start_nothing(
    maps: Harness,
) -> None:
    h = replace(maps, settings=maps.settings.model_copy(update={"map_max_items": 3}))
    too_many = await h.submit("/v1/map-digests", {"texts": ["a", "b", "c", "d"]})
    no_room = await h.submit("/v1/map-digests", {"texts": ["a"], "concurrency": 0})
    await drain(h.worker("map_digest"))
    for parent in (too_many, no_room):
        assert await h.status(parent) == "dead"
        assert await children_of(h, parent) == []
    dead = await h.rows("SELECT error FROM jobs WHERE job_id = %s", too_many)
    assert "ONCELY_MAP_MAX_ITEMS" in dead[0][0]


async def test_the_timers_count_a_childs_end_nobody_counted(maps: Harness) -> None:
    h = maps
    parent = await h.submit("/v1/map-digests", {"texts": ["Timer count. Yes."], "concurrency": 1})
    await drain(h.worker("map_digest"))
    [(child, _, _)] = await children_of(h, parent)
    await h.jobs.finish("map_item", child, {"said": "counted by the timers"}, None)
    await h.rows(
        "UPDATE jobs SET updated_at = now() - interval '1 minute' WHERE job_id = %s RETURNING 1",
        child,
    )
    await Timers(h.checkpoints).run_once()
    assert await h.status(parent) == "queued"
    await run_map(h, parent)
    assert (await h.get("/v1/map-digests", parent))["result"]["lines"] == ["counted by the timers"]


async def test_run_step_runs_a_maps_children_in_memory() -> None:
    from oncely.testing import ProviderError, run_step

    run = await run_step(
        DIGEST,
        {"texts": ["one", "two", "three"]},
        answers=["first", ProviderError(400), "third"],
    )
    assert run.result.lines == ["first", "dead: permanent", "third"]
    assert run.result.statuses == ["done", "dead", "done"]
    assert [c.result.said for c in run.children] == ["first", "third"]
    assert [e.topic for c in run.children for e in c.emitted] == ["item.said", "item.said"]
    assert [e.topic for e in run.emitted] == ["digest.done"]
    assert run.steps == ("map",)
    # A crash right after the map replays over its stored outcome: no child again.
    again = await run_step(DIGEST, {"texts": ["one"]}, answers=["only once"], crash_after="map")
    assert again.result.lines == ["only once"] and again.model_calls == 1


async def test_operators_see_a_parents_children_in_the_cli_and_the_console(maps: Harness) -> None:
    import httpx
    from pydantic import SecretStr

    from oncely.jobs.inspection import inspect_job
    from oncely.outbox.store import OutboxStore
    from tests.helpers import asgi_app

    h = maps
    texts = ["Seen one. Yes. No.", "Seen two. Yes. No.", "Refused. [[fake:400]]"]
    parent = await h.submit("/v1/map-digests", {"texts": texts, "concurrency": 2})
    await run_map(h, parent)
    view = await inspect_job(h.jobs, OutboxStore(h.pool), None, uuid.UUID(parent))
    assert view is not None
    [counted] = view.maps
    assert (counted.total, counted.done, counted.dead, counted.finished) == (3, 2, 1, True)
    assert view.to_json()["maps"][0]["done"] == 2
    listed = await h.jobs.recent(None, None, 10, parent=uuid.UUID(parent))
    assert sorted(str(j.job_id) for j in listed) == sorted(
        c for c, _, _ in await children_of(h, parent)
    )

    key = "operator-key-for-map-tests-0001"
    app = asgi_app(
        h.settings.model_copy(update={"console_key": SecretStr(key)}), h.redis, h.pool, APP
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://oncely.test") as console:
        assert (await console.post("/console/login", data={"key": key})).status_code == 303
        page = (await console.get(f"/console/workflows/map_digest/jobs/{parent}")).text
        assert 'id="maps"' in page
        assert f'href="/console/workflows/map_item/jobs?parent={parent}"' in page
        children = (await console.get(f"/console/workflows/map_item/jobs?parent={parent}")).text
        assert all(str(j.job_id) in children for j in listed)
        child = (await console.get(f"/console/workflows/map_item/jobs/{listed[0].job_id}")).text
        assert f'href="/console/workflows/map_digest/jobs/{parent}"' in child


async def test_erasing_the_tenant_erases_its_maps_and_children(maps: Harness) -> None:
    h = maps
    parent = await h.submit("/v1/map-digests", {"texts": ["Erase me. Yes.", "Me too. Yes."]})
    await run_map(h, parent)
    assert len(await children_of(h, parent)) == 2
    await h.jobs.erase_tenant("acme")
    left = await h.rows(
        "SELECT (SELECT count(*) FROM jobs WHERE tenant = 'acme'), (SELECT count(*) FROM job_maps)"
    )
    assert left == [(0, 0)]


async def test_a_map_of_a_million_items_fails_after_taking_one_past_the_bound() -> None:
    """``ctx.map`` takes at most ONCELY_MAP_MAX_ITEMS + 1 items before it
    fails: a generator of a million is not read, nor validated, to the end."""
    from oncely import PermanentError
    from oncely.context import MAP_MAX_ITEMS
    from oncely.testing import run_step

    taken = {"n": 0}

    def million() -> Any:
        for n in range(1_000_000):
            taken["n"] += 1
            yield {"text": f"item {n}"}

    async def huge(batch: Batch, ctx: Context) -> Digest:
        await ctx.map(ITEM, million())
        return Digest(lines=[], statuses=[])

    workflow = Workflow(name="huge", route="/v1/huge", request=Batch, result=Digest, step=huge)
    with pytest.raises(PermanentError, match="ONCELY_MAP_MAX_ITEMS"):
        await run_step(workflow, {"texts": []})
    assert taken["n"] == MAP_MAX_ITEMS + 1
