"""When a scheduled workflow runs: its cron expression read in its time zone
(``Workflow(schedule="0 2 * * *", schedule_tz="Europe/Paris")``,
docs/fanout.md, Schedules).

The expression is read by ``croniter`` (five fields, or six with seconds
last); ticks are moments in time, compared and stored in UTC.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, tzinfo
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterError, croniter


@dataclass(frozen=True)
class Timetable:
    expression: str
    tz: str = "UTC"

    def __post_init__(self) -> None:
        zone = self.zone()  # raises for an unknown zone
        try:
            croniter(self.expression, datetime.now(zone))
        except (CroniterError, ValueError, KeyError) as exc:
            raise ValueError(
                f"schedule {self.expression!r}: not a cron expression ({exc})"
            ) from None

    def zone(self) -> tzinfo:
        if self.tz.upper() == "UTC":
            return UTC
        try:
            return ZoneInfo(self.tz)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"schedule_tz {self.tz!r}: no such time zone") from None

    def latest(self, now: datetime) -> datetime:
        """The last tick at or before ``now`` (UTC)."""
        local = now.astimezone(self.zone())
        # croniter's previous tick is strictly before its start: start just after now.
        found: datetime = croniter(self.expression, local.replace(microsecond=0)).get_prev(datetime)
        following = self.following(found)
        return following if following <= now else found.astimezone(UTC)

    def following(self, tick: datetime) -> datetime:
        """The first tick after ``tick`` (UTC)."""
        start = tick.astimezone(self.zone())
        found: datetime = croniter(self.expression, start).get_next(datetime)
        return found.astimezone(UTC)
