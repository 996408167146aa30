"""A workflow that runs every second on its own, for the schedule tests."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel

from oncely import App, Context, Workflow


class Tick(BaseModel):
    at: str
    note: str = "nightly"


class Ticked(BaseModel):
    at: str


async def tick(request: Tick, ctx: Context) -> Ticked:
    return Ticked(at=request.at)


def request_for(at: datetime) -> Tick:
    return Tick(at=at.isoformat())


every_second = Workflow(
    name="every_second",
    route="/v1/every-second",
    request=Tick,
    result=Ticked,
    step=tick,
    schedule="* * * * * *",
    schedule_request=request_for,
)
app = App([every_second])
