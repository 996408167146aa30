"""The workflows of ``bench.streams``: the same one-call summary, its model
call streamed to the job's live stream (``streamed``) or not (``plain``)."""

from __future__ import annotations

from pydantic import BaseModel

from oncely import App, Context, Workflow


class Text(BaseModel):
    text: str


class Summary(BaseModel):
    summary: str


async def summarise(request: Text, ctx: Context) -> Summary:
    return Summary(summary=await ctx.model.complete(request.text))


streamed = Workflow(
    name="streamed",
    route="/v1/streamed",
    request=Text,
    result=Summary,
    step=summarise,
    stream=True,
)
plain = Workflow(name="plain", route="/v1/plain", request=Text, result=Summary, step=summarise)
app = App([streamed, plain])
