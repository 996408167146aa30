"""Durable steps: one run of a job's step, replayed over its checkpoints.

A step function may do several things it wants kept: side calls
(``ctx.step``), model calls (each one a checkpoint of its own), waits for
an event and sleeps. Each is a **checkpoint**: the first run stores its
value; every later run of the job (after a crash, a timeout, a transient
failure, a resume) runs the step function again from the top, and each
checkpoint it reaches that is already stored returns its stored value at
once, without running it again. Replay is written once, here: look the key
up, return the stored value, else run and store.

Keys and ordinals (docs/durable-steps.md). A checkpoint's key is its name
for the first occurrence in a run, ``name#k`` for the k-th; its ordinal is
the order in which the run reached it (parallel steps numbered in the order
they were started). A run that reaches ordinal n asking for another key
than the one stored at n is not the same run: ``Nondeterministic``.

When things are written. A checkpoint's value is kept in memory until the
run next needs it durable: before it starts paying for the next one, when
it waits, when it fails, and with the result (the last of them then rides
in the result's own statement, so a step with one model call writes no
statement more than the result). What ``ctx.emit`` queued before a
checkpoint is written with it, in the same statement: an effect exists if
and only if the checkpoint after it does. Emits before a checkpoint that a
replay finds stored were written with it, and are not written again.

The first writer of a key wins (unique per job): a run whose write finds
the key taken raises ``Replay`` and the delivery replays from the top over
the winner's values. Nothing is written for a job that is no longer
running (``RunStopped``). The store is the seam: PostgreSQL for jobs
(``oncely.jobs.checkpoints``), nothing at all for shadow runs.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Generic, Literal, Protocol, TypeVar

import structlog

from oncely import metrics
from oncely.errors import Nondeterministic, PermanentError

log = structlog.get_logger("oncely.journal")

T = TypeVar("T")

Kind = Literal["step", "model", "wait", "sleep"]

_NAME = re.compile(r"^[a-z][a-z0-9_.-]{0,62}$")


def check_name(name: str) -> str:
    """A checkpoint name, or ``ValueError`` saying what a name may be."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"checkpoint name {name!r}: 1-63 of a-z, 0-9 and _.-, starting with a letter"
        )
    return name


@dataclass(frozen=True)
class Emitted:
    """An outbox row a step asked for; written with the next checkpoint (or
    the result), or not at all."""

    topic: str
    payload: Mapping[str, Any]
    dedupe_key: str


@dataclass(frozen=True)
class Checkpoint:
    """A stored checkpoint. ``value`` is JSON (None while ``waiting``)."""

    key: str
    ordinal: int
    kind: Kind
    status: Literal["done", "waiting"]
    value: Any = None
    # Model checkpoints: {"prompt_tokens", "completion_tokens", "model_calls", "model_ms"}.
    usage: Mapping[str, int] | None = None
    # Waits and sleeps: when the wait times out or the sleep ends.
    until: datetime | None = None
    finished_at: datetime | None = None


@dataclass(frozen=True)
class NewCheckpoint:
    """A checkpoint this run reached and has not written yet, with the
    effects emitted before it."""

    key: str
    ordinal: int
    kind: Kind
    value: Any
    usage: Mapping[str, int] | None
    emitted: tuple[Emitted, ...] = ()

    def stored(self) -> Checkpoint:
        return Checkpoint(self.key, self.ordinal, self.kind, "done", self.value, self.usage)


@dataclass(frozen=True)
class Writes:
    """What one statement writes: checkpoints, and effects emitted before
    the next one (``emitted``, also written)."""

    checkpoints: tuple[NewCheckpoint, ...] = ()
    emitted: tuple[Emitted, ...] = ()

    @property
    def effects(self) -> tuple[Emitted, ...]:
        return tuple(e for c in self.checkpoints for e in c.emitted) + self.emitted

    def __bool__(self) -> bool:
        return bool(self.checkpoints or self.emitted)


@dataclass(frozen=True)
class Wait:
    """A wait for ``event`` (None: a sleep) of at most ``seconds``."""

    key: str
    ordinal: int
    kind: Literal["wait", "sleep"]
    event: str | None
    seconds: float


@dataclass(frozen=True)
class Recorded(Generic[T]):
    """What running a checkpoint's work gave: the JSON to store, the value to
    hand back now (what a replay decodes from the JSON), its model usage."""

    value: Any
    native: T
    usage: Mapping[str, int] | None = None


class Suspended(BaseException):
    """The run waits (an event, a time): this delivery ends here and the job
    holds nothing until it resumes. A ``BaseException``, so that a step's own
    ``except Exception`` cannot swallow it."""


class RunStopped(BaseException):
    """The job is no longer running in this generation (cancelled, finished
    by another delivery, dead, or rerun by an operator): nothing of this run
    is written."""


class Replay(BaseException):
    """Another delivery stored one of this run's checkpoints first: the run
    starts again from the top over the stored values."""


class JournalStore(Protocol):
    """Where a run's checkpoints go."""

    async def write(self, writes: Writes) -> None:
        """Store ``writes`` in one transaction. Raises ``Replay`` when a key
        or ordinal is taken, ``RunStopped`` when the job no longer runs."""
        ...

    async def wait(self, writes: Writes, wait: Wait) -> Checkpoint | None:
        """Store ``writes`` and start ``wait``, in one transaction: the wait's
        checkpoint, done, if its event had already arrived (the run goes
        on), else None (the job now waits)."""
        ...


class Journal:
    """One run's checkpoints: those stored before it, and those it reaches."""

    def __init__(
        self,
        stored: Sequence[Checkpoint] = (),
        store: JournalStore | None = None,
        *,
        workflow: str = "",
        sleeps: bool = True,
    ) -> None:
        self._stored: dict[int, Checkpoint] = {c.ordinal: c for c in stored}
        self._store = store or Ephemeral()
        self.workflow = workflow
        # False (shadow runs): sleeps end at once.
        self.sleeps = sleeps
        self._ordinal = 0
        self._seen: dict[str, int] = {}
        self._pending: list[NewCheckpoint] = []
        # Emitted since the last checkpoint this run reached.
        self._since: list[Emitted] = []
        self._emitted: list[Emitted] = []
        self._writing = asyncio.Lock()
        # Checkpoints this run found stored, and the keys it reached, in order.
        self.replayed = 0
        self.reached: list[str] = []

    # -- reaching checkpoints --------------------------------------------------

    async def record(
        self,
        name: str,
        kind: Kind,
        work: Callable[[], Awaitable[Recorded[T]]],
        decode: Callable[[Any], T],
    ) -> T:
        """The checkpoint ``name``'s value: stored, or ``work``'s (then kept)."""
        key, ordinal, stored = self._reach(name, kind)
        if stored is not None:
            return self._replayed(stored, decode)
        # What came before is durable before this one is paid for.
        await self.flush()
        recorded = await work()
        emitted, self._since = tuple(self._since), []
        self._pending.append(
            NewCheckpoint(key, ordinal, kind, recorded.value, recorded.usage, emitted)
        )
        return recorded.native

    async def wait(
        self,
        name: str,
        kind: Literal["wait", "sleep"],
        event: str | None,
        seconds: float,
        decode: Callable[[Any], T],
    ) -> T:
        """Wait for ``event`` (or, without one, sleep) up to ``seconds``:
        the stored outcome, the event if it already arrived, or ``Suspended``."""
        key, ordinal, stored = self._reach(name, kind)
        if stored is not None:
            return self._replayed(stored, decode)
        if kind == "sleep" and (seconds <= 0 or not self.sleeps):
            emitted, self._since = tuple(self._since), []
            self._pending.append(NewCheckpoint(key, ordinal, kind, None, None, emitted))
            return decode(None)
        async with self._writing:
            batch = list(self._pending)
            writes = Writes(tuple(batch), tuple(self._since))
            outcome = await self._store.wait(writes, Wait(key, ordinal, kind, event, seconds))
            self._written(batch)
            self._since = []
        if outcome is None:
            raise Suspended(key)
        self._stored[ordinal] = outcome
        return decode(outcome.value)

    def _reach(self, name: str, kind: Kind) -> tuple[str, int, Checkpoint | None]:
        count = self._seen[name] = self._seen.get(name, 0) + 1
        key = name if count == 1 else f"{name}#{count}"
        self._ordinal += 1
        ordinal = self._ordinal
        self.reached.append(key)
        stored = self._stored.get(ordinal)
        if stored is not None and (stored.key != key or stored.kind != kind):
            metrics.NONDETERMINISTIC.labels(workflow=self.workflow).inc()
            raise Nondeterministic(ordinal, stored=stored.key, asked=key)
        return key, ordinal, stored

    def _replayed(self, stored: Checkpoint, decode: Callable[[Any], T]) -> T:
        if stored.status == "waiting":
            # The job still waits there (a stale message): nothing to do.
            raise Suspended(stored.key)
        # Emits before it were written with it.
        self._since = []
        self.replayed += 1
        metrics.CHECKPOINT_REPLAYS.labels(workflow=self.workflow, kind=stored.kind).inc()
        try:
            return decode(stored.value)
        except ValueError as exc:  # pydantic's ValidationError included
            raise PermanentError(
                f"stored checkpoint {stored.key!r} no longer decodes: {type(exc).__name__}"
            ) from exc

    # -- effects ---------------------------------------------------------------

    def emit(self, effect: Emitted) -> None:
        if any(e.dedupe_key == effect.dedupe_key for e in self._emitted):
            raise PermanentError(f"dedupe key {effect.dedupe_key!r} emitted twice by one run")
        self._emitted.append(effect)
        self._since.append(effect)

    @property
    def emitted(self) -> tuple[Emitted, ...]:
        """Everything this run emitted, replayed checkpoints' emits included."""
        return tuple(self._emitted)

    # -- writing ---------------------------------------------------------------

    async def flush(self) -> None:
        """Write the checkpoints reached and not yet written (with the
        effects emitted before them)."""
        if not self._pending:
            return
        async with self._writing:
            batch = list(self._pending)
            if batch:
                await self._store.write(Writes(tuple(batch)))
                self._written(batch)

    def _written(self, batch: list[NewCheckpoint]) -> None:
        for checkpoint in batch:
            self._pending.remove(checkpoint)
            self._stored[checkpoint.ordinal] = checkpoint.stored()
        if batch:
            metrics.CHECKPOINTS_WRITTEN.labels(workflow=self.workflow).inc(len(batch))

    def unwritten(self) -> Writes:
        """What the result's statement writes with it: the checkpoints not
        written yet and the effects emitted since the last checkpoint."""
        return Writes(tuple(self._pending), tuple(self._since))

    async def keep_after_failure(self) -> None:
        """The run failed: keep what it paid for (the checkpoints reached),
        so the next delivery does not pay again. The effects emitted since
        the last checkpoint are dropped with the run. Never raises; runs to
        its end even if the caller is cancelled meanwhile."""
        if not self._pending:
            return
        task = asyncio.ensure_future(self.flush())
        try:
            await asyncio.shield(task)
        except (Exception, Replay, RunStopped, asyncio.CancelledError) as exc:
            if not isinstance(exc, asyncio.CancelledError):
                log.info("journal.not_kept", workflow=self.workflow, error=type(exc).__name__)

    # -- what the run spent ----------------------------------------------------

    def usage(self) -> dict[str, int]:
        """Every model checkpoint of the job, stored or reached, summed."""
        total = {"prompt_tokens": 0, "completion_tokens": 0, "model_calls": 0, "model_ms": 0}
        checkpoints = [*self._stored.values(), *(c.stored() for c in self._pending)]
        for checkpoint in checkpoints:
            for name, n in (checkpoint.usage or {}).items():
                if name in total:
                    total[name] += int(n)
        return total


@dataclass
class Ephemeral:
    """A store that keeps nothing: shadow runs, and runs with no job behind
    them. A wait ends at once with the event in ``events`` (what the primary
    received), or with None."""

    events: Mapping[str, Any] = field(default_factory=dict)

    async def write(self, writes: Writes) -> None:
        return None

    async def wait(self, writes: Writes, wait: Wait) -> Checkpoint | None:
        value = self.events.get(wait.event) if wait.event is not None else None
        return Checkpoint(wait.key, wait.ordinal, wait.kind, "done", value)
