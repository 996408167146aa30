"""Multi-step workflows the tests run, in process and as real processes
(``oncely --app tests.steps_app:app``).

Each side step appends a line to the file named by ``ONCELY_TEST_SIDE_CALLS``
(when set), so a test counts how often a side call really ran, whichever
process ran it. Prompts carry directives for the fake model only where the
request puts them (``hold``: the last model call of ``chain`` only).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

import oncely
from oncely import Context, Workflow, webhook

SIDE_CALLS = "ONCELY_TEST_SIDE_CALLS"


def record_side_call(name: str, text: str) -> None:
    path = os.environ.get(SIDE_CALLS)
    if path:
        with Path(path).open("a") as f:
            f.write(json.dumps({"step": name, "text": text, "pid": os.getpid()}) + "\n")


def side_calls(path: Path, step: str | None = None) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    calls = [json.loads(line) for line in path.read_text().splitlines() if line]
    return [c for c in calls if step is None or c["step"] == step]


class Order(BaseModel):
    text: str = Field(min_length=1, max_length=2000)
    # Appended to the last model call's prompt only (a fake-model directive).
    hold: str = ""


class Fulfilled(BaseModel):
    kind: str
    sku: str
    draft: str
    final: str


async def lookup(text: str) -> dict[str, str]:
    """A side call: runs once per job, however often the step replays."""
    record_side_call("lookup", text)
    await asyncio.sleep(0)
    return {"sku": text.split()[0][:12]}


async def fulfil(order: Order, ctx: Context) -> Fulfilled:
    """Four checkpoints: a model call, a side step, two more model calls."""
    kind = await ctx.model.complete(f"classify: {order.text}")
    found = await ctx.step("lookup", lookup, order.text)
    draft = await ctx.model.complete(f"draft: {order.text}")
    final = await ctx.model.complete(f"final: {order.text} {order.hold}".strip())
    ctx.emit("order.fulfilled", {"job_id": ctx.job_id, "sku": found["sku"]})
    return Fulfilled(kind=kind, sku=found["sku"], draft=draft, final=final)


class Approval(BaseModel):
    approved: bool
    by: str = Field(min_length=1, max_length=100)


class Request(BaseModel):
    text: str = Field(min_length=1, max_length=2000)
    wait_s: float = Field(3600.0, ge=0)


class Decision(BaseModel):
    review: str
    approved: bool | None
    by: str | None


async def ask_for_approval(request: Request, ctx: Context) -> Decision:
    """Review with the model, ask a person, wait for the answer (or not)."""
    review = await ctx.model.complete(f"review: {request.text}")
    ctx.emit("order.approval_requested", {"job_id": ctx.job_id, "review": review})
    approval = await ctx.wait_for_event("approval", Approval, timeout=request.wait_s)
    ctx.emit(
        "order.decided",
        {"job_id": ctx.job_id, "approved": None if approval is None else approval.approved},
    )
    if approval is None:
        return Decision(review=review, approved=None, by=None)
    return Decision(review=review, approved=approval.approved, by=approval.by)


class Nap(BaseModel):
    text: str = Field(min_length=1, max_length=2000)
    sleep_s: float = Field(1.0, ge=0)


class Rested(BaseModel):
    before: str
    after: str


async def nap(request: Nap, ctx: Context) -> Rested:
    """A side step, a durable sleep, a model call."""
    before = await ctx.step("note", lookup, request.text)
    await ctx.sleep(request.sleep_s)
    after = await ctx.model.complete(f"after the nap: {request.text}")
    ctx.emit("order.rested", {"job_id": ctx.job_id})
    return Rested(before=before["sku"], after=after)


class Transfer(BaseModel):
    order: str = Field(min_length=1, max_length=100)
    cents: int = Field(500, ge=1)
    # Ask reconcile (it reads the side-calls file) before a person.
    reconcile: bool = False
    # The first transfer of an order hangs this long once it happened (a
    # test kills its worker meanwhile); a resend returns at once.
    hold_s: float = Field(0.0, ge=0)
    # The first transfer of an order happens, then its connection breaks.
    fail: bool = False


class Transferred(BaseModel):
    outcome: str
    result: Any = None


def send_money(order: str, cents: int, hold_s: float, fail: bool = False) -> dict[str, Any]:
    """A payment API that does not dedupe: each call is a transfer."""
    record_side_call("transfer", order)
    path = os.environ.get(SIDE_CALLS)
    sent = len([c for c in side_calls(Path(path), "transfer") if c["text"] == order]) if path else 1
    if sent == 1 and hold_s:
        time.sleep(hold_s)
    if sent == 1 and fail:
        raise ConnectionResetError("the bank hung up before it answered")
    return {"transfer": sent, "cents": cents}


def found_transfer(arguments: dict[str, Any], key: str) -> Any:
    """Ask the bank whether the transfer happened."""
    path = os.environ.get(SIDE_CALLS)
    sent = [c for c in side_calls(Path(path), "transfer") if c["text"] == arguments["order"]]
    if not sent:
        return oncely.NOT_DONE
    return {"transfer": len(sent), "cents": arguments["cents"], "found": True}


async def transfer(request: Transfer, ctx: Context) -> Transferred:
    """One effect no receiver dedupes, at most once (docs/at-most-once.md)."""
    try:
        paid = await ctx.step(
            "pay",
            send_money,
            request.order,
            request.cents,
            request.hold_s,
            request.fail,
            at_most_once=True,
            reconcile=found_transfer if request.reconcile else None,
        )
    except oncely.PermanentError as exc:
        return Transferred(outcome="failed", result=str(exc))
    return Transferred(outcome="paid", result=paid)


chain = Workflow(
    name="chain",
    route="/v1/chain",
    request=Order,
    result=Fulfilled,
    step=fulfil,
    effects=[webhook("order.fulfilled")],
)
approvals = Workflow(
    name="approvals",
    route="/v1/approvals",
    request=Request,
    result=Decision,
    step=ask_for_approval,
    effects=[webhook("order.approval_requested"), webhook("order.decided")],
    events={"approval": Approval},
)
naps = Workflow(
    name="naps",
    route="/v1/naps",
    request=Nap,
    result=Rested,
    step=nap,
    effects=[webhook("order.rested")],
)

transfers = Workflow(
    name="transfers",
    route="/v1/transfers",
    request=Transfer,
    result=Transferred,
    step=transfer,
    effects=[webhook("uncertain.raised")],
)

app = oncely.App([chain, approvals, naps, transfers])
