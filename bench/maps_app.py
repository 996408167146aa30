"""The workflows of ``bench.maps``: one model call per item, posted one job
at a time (``items``) or mapped as the children of one parent
(``batches``)."""

from __future__ import annotations

from pydantic import BaseModel

from oncely import App, Context, Workflow


class Item(BaseModel):
    text: str


class Said(BaseModel):
    said: str


class Batch(BaseModel):
    texts: list[str]
    concurrency: int


class Done(BaseModel):
    done: int


async def say(item: Item, ctx: Context) -> Said:
    return Said(said=await ctx.model.complete(item.text))


async def fan_out(batch: Batch, ctx: Context) -> Done:
    results = await ctx.map(
        items, [{"text": t} for t in batch.texts], concurrency=batch.concurrency
    )
    return Done(done=sum(r.ok for r in results))


items = Workflow(name="items", route="/v1/items", request=Item, result=Said, step=say)
batches = Workflow(name="batches", route="/v1/batches", request=Batch, result=Done, step=fan_out)
app = App([batches, items])
