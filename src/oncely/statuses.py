"""A job's statuses, spelled once (docs/architecture.md, "Jobs").

A job row says ``queued``, ``held`` (a map's child its map's concurrency
holds back, docs/fanout.md), ``waiting``, or one of the finished three,
after which nothing about the job changes. What a reader is told (GET, the
live stream, the clients) says ``running`` while a worker holds a queued
job, and ``queued`` for a held one. A leaf: typing only, no driver.
"""

from __future__ import annotations

from typing import Literal, get_args

RowStatus = Literal["queued", "held", "waiting", "done", "dead", "cancelled"]
JobStatus = Literal["queued", "running", "waiting", "done", "dead", "cancelled"]
FinishedStatus = Literal["done", "dead", "cancelled"]

ROW_STATUSES: tuple[RowStatus, ...] = get_args(RowStatus)
FINISHED: frozenset[str] = frozenset(get_args(FinishedStatus))
# Statuses a cancel still applies to.
CANCELLABLE: frozenset[str] = frozenset(ROW_STATUSES) - FINISHED
