"""A nightly digest: every night at 02:00 (UTC), summarise the day's support
tickets, each as a child job of its own, then send one email with every
summary. A ticket whose summary failed is listed as such; the digest goes
out all the same.

Run it with every oncely command: ``oncely --app examples.digest:app dev``;
``oncely --app examples.digest:app schedules list`` shows its next run.
The tickets come from ``load_tickets``: put your own query there (it runs
once per night, as a checkpoint: a replay does not read them again).
"""

from datetime import datetime, timedelta

from pydantic import BaseModel, Field

import oncely

DIGEST_TO = "support-leads@example.com"


class Ticket(BaseModel):
    id: str = Field(min_length=1, max_length=64)
    text: str = Field(min_length=1, max_length=20_000)


class TicketSummary(BaseModel):
    id: str
    summary: str


async def summarise_ticket(ticket: Ticket, ctx: oncely.Context) -> TicketSummary:
    summary = await ctx.model.complete(
        ticket.text, system="Summarise this support ticket in one sentence."
    )
    return TicketSummary(id=ticket.id, summary=summary)


ticket_summaries = oncely.Workflow(
    name="ticket_summaries",
    route="/v1/ticket-summaries",
    request=Ticket,
    result=TicketSummary,
    step=summarise_ticket,
    summary="Summarise one support ticket",
)


class Night(BaseModel):
    day: str = Field(pattern=r"^\d{4}-\d{2}-\d{2}$", examples=["2026-12-03"])


class Digest(BaseModel):
    day: str
    summarised: int
    failed: list[str]


def the_day_before(tick: datetime) -> Night:
    """The night's job is about the day that just ended."""
    return Night(day=(tick - timedelta(days=1)).date().isoformat())


def load_tickets(day: str) -> list[dict[str, str]]:
    """The day's tickets. Replace with your own query."""
    return [
        {"id": f"{day}-1", "text": "The invoice shows the wrong VAT number. Please fix it."},
        {"id": f"{day}-2", "text": "I cannot log in since the update. The reset mail never came."},
        {"id": f"{day}-3", "text": "Can I move my plan to yearly billing? It would help us."},
    ]


async def nightly(night: Night, ctx: oncely.Context) -> Digest:
    tickets = await ctx.step("tickets", load_tickets, night.day)
    results = await ctx.map(ticket_summaries, tickets, concurrency=20)
    lines = [f"- {r.result.id}: {r.result.summary}" for r in results if r.ok and r.result]
    failed = [t["id"] for t, r in zip(tickets, results, strict=True) if not r.ok]
    lines += [f"- {ticket}: no summary" for ticket in failed]
    ctx.emit("digest.ready", {"day": night.day, "lines": lines})
    return Digest(day=night.day, summarised=len(results) - len(failed), failed=failed)


def render_digest(payload: dict) -> oncely.Email:
    return oncely.Email(
        to=DIGEST_TO,
        subject=f"Support tickets of {payload['day']}",
        text="\n".join(payload["lines"]) + "\n",
    )


nightly_digest = oncely.Workflow(
    name="nightly_digest",
    route="/v1/nightly-digests",
    request=Night,
    result=Digest,
    step=nightly,
    effects=[oncely.email("digest.ready", render_digest)],
    summary="Every night: summarise the day's tickets, then email the digest",
    schedule="0 2 * * *",
    schedule_request=the_day_before,
)

app = oncely.App([nightly_digest, ticket_summaries])
