"""When a scheduled workflow runs: its cron expression read in its time zone
(``Workflow(schedule="0 2 * * *", schedule_tz="Europe/Paris")``,
docs/fanout.md, Schedules).

The expression is read by ``croniter`` (five fields, or six with seconds
last); ticks are moments in time, compared and stored in UTC.

Daylight saving time, as cron has it. The night the clocks go forward, the
times they skip run once, when they jump (``0 2 * * *`` in Europe/Paris at
03:00 CEST; ticks that land on one moment are one tick). The night they go
back, a fixed time that occurs twice runs once, at its first occurrence;
an expression with ``*`` in its minute or hour field (``0 * * * *``,
``*/15 2 * * *``) runs by elapsed time, in both passes of the repeated
hour, as cron's wildcard jobs do.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, tzinfo
from functools import cached_property
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
        found = self._before(local.replace(microsecond=0))
        following = self.following(found)
        return following if following <= now else found.astimezone(UTC)

    def following(self, tick: datetime) -> datetime:
        """The first tick after ``tick`` (UTC)."""
        found: datetime = croniter(self.expression, tick.astimezone(self.zone())).get_next(datetime)
        while self._repeated(found):
            found = croniter(self.expression, found).get_next(datetime)
        return found.astimezone(UTC)

    def _before(self, local: datetime) -> datetime:
        found: datetime = croniter(self.expression, local).get_prev(datetime)
        while self._repeated(found):
            found = croniter(self.expression, found).get_prev(datetime)
        return found

    def _repeated(self, local: datetime) -> bool:
        """``local`` is a wall time's second occurrence (the night clocks go
        back) and the expression names a fixed time: cron runs such a job
        once, at the first occurrence. An expression with ``*`` in its
        minute or hour runs by elapsed time, in both passes, as cron's do."""
        if self._by_elapsed_time:
            return False
        # Read again from UTC: croniter's own ``fold`` is not to be trusted.
        instant = local.astimezone(UTC)
        first = instant.astimezone(self.zone()).replace(fold=0).astimezone(UTC)
        return first < instant

    @cached_property
    def _by_elapsed_time(self) -> bool:
        minute, hour = croniter(self.expression).expressions[:2]
        return str(minute).startswith("*") or str(hour).startswith("*")
