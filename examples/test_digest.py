"""Unit tests of the nightly digest with oncely.testing: the children run in
memory on the scripted model; no Redis, no PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime

from examples.digest import nightly_digest
from oncely.testing import ProviderError, run_step


async def test_every_ticket_is_summarised_by_a_child_and_one_digest_is_emailed() -> None:
    run = await run_step(
        nightly_digest,
        {"day": "2026-12-03"},
        answers=["Wrong VAT number.", "Cannot log in.", "Wants yearly billing."],
    )
    assert run.result.summarised == 3 and run.result.failed == []
    assert [c.result.summary for c in run.children] == [
        "Wrong VAT number.",
        "Cannot log in.",
        "Wants yearly billing.",
    ]
    [digest] = run.emitted
    assert digest.topic == "digest.ready"
    assert digest.payload["lines"][0] == "- 2026-12-03-1: Wrong VAT number."
    assert run.steps == ("tickets", "map")


async def test_a_ticket_that_failed_is_listed_and_the_digest_still_goes() -> None:
    run = await run_step(
        nightly_digest,
        {"day": "2026-12-03"},
        answers=["Wrong VAT number.", ProviderError(400), "Wants yearly billing."],
    )
    assert run.result.failed == ["2026-12-03-2"]
    assert run.emitted[0].payload["lines"][-1] == "- 2026-12-03-2: no summary"


def test_the_night_job_is_about_the_day_before() -> None:
    tick = datetime(2026, 12, 4, 2, 0, tzinfo=UTC)
    assert nightly_digest.scheduled_request(tick) == {"day": "2026-12-03"}
    assert nightly_digest.timetable is not None
    assert nightly_digest.timetable.following(tick) == datetime(2026, 12, 5, 2, 0, tzinfo=UTC)
