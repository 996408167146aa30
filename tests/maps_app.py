"""A parent that maps its items over child jobs, each child one model call
and one webhook, the parent one webhook at the end (the fan-out process
tests; docs/fanout.md)."""

from __future__ import annotations

from pydantic import BaseModel

from oncely import App, Context, Workflow, webhook


class Item(BaseModel):
    text: str


class Said(BaseModel):
    said: str


class Batch(BaseModel):
    texts: list[str]
    concurrency: int = 8


class Done(BaseModel):
    said: list[str]
    statuses: list[str]


async def say(item: Item, ctx: Context) -> Said:
    said = await ctx.model.complete(item.text)
    ctx.emit("item.said", {"job_id": ctx.job_id, "said": said})
    return Said(said=said)


async def fan_out(batch: Batch, ctx: Context) -> Done:
    results = await ctx.map(ITEM, [{"text": t} for t in batch.texts], concurrency=batch.concurrency)
    said = [r.result.said if r.ok and r.result else "" for r in results]
    ctx.emit("batch.done", {"job_id": ctx.job_id, "items": len(results)})
    return Done(said=said, statuses=[r.status for r in results])


ITEM = Workflow(
    name="items",
    route="/v1/items",
    request=Item,
    result=Said,
    step=say,
    effects=[webhook("item.said")],
)
BATCH = Workflow(
    name="batches",
    route="/v1/batches",
    request=Batch,
    result=Done,
    step=fan_out,
    effects=[webhook("batch.done")],
)
app = App([BATCH, ITEM])
