"""The workflows ``bench.steps`` runs in real worker processes
(``oncely --app bench.steps_app:app worker --workflow …``).

The same order goes through both: classify it, look its SKU up, draft a
reply, finalise it.

- ``four_checkpoints``: each piece a checkpoint of its own, as a workflow
  author would split it to keep what each paid for: three model calls and
  a side call through ``ctx.step``.
- ``one_call``: the same work in one step: the side call inline (a plain
  ``await``) and one model call answering for all three model pieces. Its
  one checkpoint (the model call) rides in the result's statement.

Both emit one effect and return the same result model. The side call
appends a line to the file named by ``ONCELY_BENCH_SIDE_CALLS`` (one
``write`` on an ``O_APPEND`` descriptor; the process is SIGKILLed at the
end, so nothing may sit in a buffer), so the benchmark counts how often it
really ran.
"""

from __future__ import annotations

import os

from pydantic import BaseModel, Field

import oncely
from oncely import Context, Workflow, webhook

SIDE_CALLS = "ONCELY_BENCH_SIDE_CALLS"
FOUR_DONE = "four_checkpoints.done"
ONE_DONE = "one_call.done"

_side_fd: int | None = None


class Order(BaseModel):
    text: str = Field(min_length=1, max_length=2000)


class Fulfilled(BaseModel):
    kind: str
    sku: str
    draft: str
    final: str


def _record(text: str) -> None:
    global _side_fd
    path = os.environ.get(SIDE_CALLS)
    if not path:
        return
    if _side_fd is None:
        _side_fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(_side_fd, text.encode() + b"\n")


async def lookup(text: str) -> dict[str, str]:
    """The side call: the order's SKU (its first word), recorded once per run of it."""
    _record(text)
    return {"sku": text.split()[0][:12]}


async def fulfil_in_four(order: Order, ctx: Context) -> Fulfilled:
    """Four checkpoints: a model call, a side call, two more model calls."""
    kind = await ctx.model.complete(f"classify: {order.text}")
    found = await ctx.step("lookup", lookup, order.text)
    draft = await ctx.model.complete(f"draft: {order.text}")
    final = await ctx.model.complete(f"final: {order.text}")
    ctx.emit(FOUR_DONE, {"job_id": ctx.job_id, "sku": found["sku"]})
    return Fulfilled(kind=kind, sku=found["sku"], draft=draft, final=final)


async def fulfil_in_one(order: Order, ctx: Context) -> Fulfilled:
    """The same work in one step: the side call inline, one model call."""
    found = await lookup(order.text)
    answer = await ctx.model.complete(f"classify, draft and finalise: {order.text}")
    ctx.emit(ONE_DONE, {"job_id": ctx.job_id, "sku": found["sku"]})
    return Fulfilled(kind=answer, sku=found["sku"], draft=answer, final=answer)


four_checkpoints = Workflow(
    name="four_checkpoints",
    route="/v1/bench/four-checkpoints",
    request=Order,
    result=Fulfilled,
    step=fulfil_in_four,
    effects=[webhook(FOUR_DONE)],
)
one_call = Workflow(
    name="one_call",
    route="/v1/bench/one-call",
    request=Order,
    result=Fulfilled,
    step=fulfil_in_one,
    effects=[webhook(ONE_DONE)],
)

app = oncely.App([four_checkpoints, one_call])
