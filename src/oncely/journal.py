"""Durable steps: one run of a job's step, replayed over its checkpoints.

A step function may do several things it wants kept: side calls
(``ctx.step``), model calls (each one a checkpoint of its own), waits for
an event and sleeps. Each is a **checkpoint**: the first run stores its
value; every later run of the job (after a crash, a timeout, a transient
failure, a resume) runs the step function again from the top, and each
checkpoint it reaches that is already stored returns its stored value at
once, without running it again. Replay is written once, here: look the key
up, return the stored value, else run and store.

Keys and scopes (docs/durable-steps.md). A checkpoint's key is its name for
the first occurrence in its scope, ``name#k`` for the k-th, behind the
scope's path. The step function's own code is the root scope (path ``""``).
A checkpoint reached while another's work runs (a model call inside a
``ctx.step`` function) is in that checkpoint's scope (``enrich/model``). A
task the step function starts (``asyncio.gather``, a ``TaskGroup``) is a
branch: a scope of its own, numbered in the order the branches reach their
first checkpoint, which for tasks started together is the order they were
started (``[1]/model``, ``[2]/model``). So however the branches interleave,
each asks for its own keys, in its own order. Within a scope, the n-th
checkpoint a replay reaches must be the n-th one stored there: another key
is not the same run, ``Nondeterministic``, before any work is paid for.

A checkpoint's work that fails (after its retries) is kept as a failed
checkpoint when the run goes on past it (the step caught the error): a
replay raises the same error again instead of running the work. A failure
that ends the run is not kept, so the next delivery tries the work again.

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
running (``RunStopped``), nor once the run is over (``close``: a task the
step started and left running cannot pay or write for it). The store is
the seam: PostgreSQL for jobs (``oncely.jobs.checkpoints``), nothing at all
for shadow runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from operator import attrgetter
from typing import Any, Generic, Literal, Protocol, TypeVar

import structlog

from oncely import metrics
from oncely.errors import (
    CallFailed,
    DeadlineExceeded,
    Diverged,
    Nondeterministic,
    OncelyError,
    PermanentError,
    TransientError,
)
from oncely.usage.totals import summed

log = structlog.get_logger("oncely.journal")

T = TypeVar("T")

Kind = Literal[
    "step", "model", "wait", "sleep", "tool", "call", "approval", "patch", "map",
    "intent", "uncertain", "reconcile",
]  # fmt: skip
# The kinds of checkpoint a run waits at, holding nothing.
WaitKind = Literal["wait", "sleep", "call", "approval", "map", "uncertain"]

_NAME = re.compile(r"^[a-z][a-z0-9_.-]{0,62}$")


def asked(value: Any) -> str:
    """What a checkpoint is asked with, as kept to compare replays with:
    ``value`` as canonical JSON text (a call's payload)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def asked_digest(value: Any) -> str:
    """``asked`` as a digest, for requests too large to keep (a model turn's
    whole conversation)."""
    text = asked(value).encode("utf-8", "surrogatepass")
    return "sha256:" + hashlib.sha256(text).hexdigest()


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


Status = Literal["done", "waiting", "failed"]


@dataclass(frozen=True)
class Checkpoint:
    """A stored checkpoint. ``value`` is JSON (None while ``waiting``); a
    failed one holds ``{"error", "message", "transient"}``."""

    key: str
    ordinal: int
    kind: Kind
    status: Status
    value: Any = None
    # Model checkpoints: {"prompt_tokens", "completion_tokens", "model_calls",
    # "model_ms", "cost_usd", "model"} (oncely.llm.model.Usage).
    usage: Mapping[str, Any] | None = None
    # Waits and sleeps: when the wait times out or the sleep ends.
    until: datetime | None = None
    finished_at: datetime | None = None
    # Kept with the job's result (its last checkpoints): no value kept.
    with_result: bool = False
    # What it was asked with (``NewCheckpoint.request``); None: not kept.
    request: str | None = None


@dataclass(frozen=True)
class NewCheckpoint:
    """A checkpoint this run reached and has not written yet, with the
    effects emitted before it. ``failure``: the error its work raised (a
    failed checkpoint), kept to tell whether that error ended the run."""

    key: str
    ordinal: int
    kind: Kind
    value: Any
    usage: Mapping[str, Any] | None
    emitted: tuple[Emitted, ...] = ()
    failure: BaseException | None = field(default=None, compare=False)
    # What it was asked with, for replays to compare (``asked``): a call's
    # payload as JSON text, a model turn's request as a digest.
    request: str | None = None

    @property
    def status(self) -> Status:
        return "done" if self.failure is None else "failed"

    def stored(self) -> Checkpoint:
        return Checkpoint(
            self.key, self.ordinal, self.kind, self.status, self.value, self.usage,
            request=self.request,
        )  # fmt: skip


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
class MapStart:
    """A map to start with its parent's wait (``ctx.map``): the children's
    workflow, their requests in item order, how many may be queued or
    running at once."""

    workflow: str
    items: tuple[Mapping[str, Any], ...]
    concurrency: int
    # The children's workflow itself, for runs in memory (oncely.testing).
    declaration: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class ForEvent:
    """Until the job receives the event ``name`` (a person's decision is one)."""

    name: str


@dataclass(frozen=True)
class ForCall:
    """Until the relay stores the answer to ``row``, the call's outbox row
    (written with the wait)."""

    row: Emitted


@dataclass(frozen=True)
class ForChildren:
    """Until every child of the map ``start`` (started with the wait) has ended."""

    start: MapStart


@dataclass(frozen=True)
class ForTime:
    """Until the wait's time is up (a sleep)."""


# What a wait waits for: one of these, never a record of optionals.
Awaited = ForEvent | ForCall | ForChildren | ForTime


@dataclass(frozen=True)
class Wait:
    """A wait of at most ``seconds`` for what ``on`` says. ``detail`` is
    what GET shows the job waits on; ``request`` what it was asked with (a
    call's payload: ``NewCheckpoint.request``)."""

    key: str
    ordinal: int
    kind: WaitKind
    seconds: float
    on: Awaited
    detail: Mapping[str, Any] | None = None
    request: str | None = None

    @property
    def event(self) -> str | None:
        """The job event whose arrival ends the wait (a map's children's
        ends are counted as one); None for a call or a sleep."""
        match self.on:
            case ForEvent(name):
                return name
            case ForChildren():
                return f"map:{self.key}"
        return None

    @property
    def wakes_on(self) -> str | None:
        """The name the job's wake-up is matched on (None: only its time)."""
        if isinstance(self.on, ForCall):
            return f"call:{self.key}"
        return self.event

    @property
    def call(self) -> Emitted | None:
        """The call's outbox row, for a call."""
        return self.on.row if isinstance(self.on, ForCall) else None

    @property
    def children(self) -> MapStart | None:
        """The map to start, for a map."""
        return self.on.start if isinstance(self.on, ForChildren) else None


@dataclass(frozen=True)
class Reached:
    """A checkpoint a run has reached (its key and ordinal) and not yet
    recorded: its stored form, when a run before stored it."""

    key: str
    ordinal: int
    kind: Kind
    stored: Checkpoint | None


@dataclass(frozen=True)
class Recorded(Generic[T]):
    """What running a checkpoint's work gave: the JSON to store, the value to
    hand back now (what a replay decodes from the JSON), its model usage."""

    value: Any
    native: T
    usage: Mapping[str, Any] | None = None


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


class Scope:
    """Where checkpoints are reached: the step function's own code, a
    checkpoint's work, or a task the step started (module docstring). Its
    path prefixes its keys; its names are counted, and its checkpoints
    numbered, on their own."""

    def __init__(self, path: str, owner: asyncio.Task[Any] | None, *, shared: bool = False) -> None:
        self.path = path
        # The task whose code this scope is; another task reaching a
        # checkpoint here is a branch. None: branches are not told apart.
        self.owner = owner
        # Any task's checkpoints are this scope's own, in the order reached
        # (a framework's run: its turns come from tasks the framework starts).
        self.shared = shared
        self.counts: dict[str, int] = {}
        self.reached = 0
        self.branches = 0

    def key(self, name: str) -> str:
        count = self.counts[name] = self.counts.get(name, 0) + 1
        return self.path + (name if count == 1 else f"{name}#{count}")

    def branch(self, task: asyncio.Task[Any]) -> Scope:
        self.branches += 1
        return Scope(f"{self.path}[{self.branches}]/", task)


# The scope the running code reaches checkpoints in, per journal.
_SCOPE: ContextVar[tuple[Journal, Scope] | None] = ContextVar("oncely_scope", default=None)


def current_checkpoint() -> str | None:
    """The key of the checkpoint whose work is running now (a model call's
    key, for its ledger rows); None outside any."""
    current = _SCOPE.get()
    path = current[1].path if current is not None else ""
    return path[:-1] if path.endswith("/") else None


def scope_of(key: str) -> str:
    """``enrich/[1]/`` for ``enrich/[1]/model#2``; ``""`` for ``model``."""
    return key[: key.rfind("/") + 1]


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
        # Stored checkpoints by scope, in the order they were reached.
        self._stored: dict[str, list[Checkpoint]] = {}
        for checkpoint in sorted(stored, key=attrgetter("ordinal")):
            self._stored.setdefault(scope_of(checkpoint.key), []).append(checkpoint)
        self._store = store or Ephemeral()
        self.workflow = workflow
        # False (shadow runs): sleeps end at once.
        self.sleeps = sleeps
        self._root = Scope("", None)
        # New checkpoints are numbered after every stored one.
        self._ordinal = max((c.ordinal for c in stored), default=0)
        self._pending: list[NewCheckpoint] = []
        # Emitted since the last checkpoint this run reached.
        self._since: list[Emitted] = []
        self._emitted: list[Emitted] = []
        self._writing = asyncio.Lock()
        self._closed = False
        # Checkpoints whose work runs now (in any task), and set when none does.
        self._working = 0
        self._idle = asyncio.Event()
        self._idle.set()
        # Checkpoints this run found stored, and the keys it reached, in order.
        self.replayed = 0
        self.reached: list[str] = []
        # Model turns a replay asked with another request than the stored one's.
        self.diverged: list[str] = []

    async def run(self, step: Awaitable[T]) -> T:
        """Await the step function: its task is the root scope, the tasks it
        starts are branches, and once it is over nothing more is paid for or
        written (``close``)."""
        self._root = Scope("", asyncio.current_task())
        token = _SCOPE.set((self, self._root))
        try:
            return await step
        finally:
            _SCOPE.reset(token)
            self.close()

    def close(self) -> None:
        """The run is over: a checkpoint reached from now on (by a task the
        step left running) raises ``RunStopped`` before any work or write."""
        self._closed = True

    # -- reaching checkpoints --------------------------------------------------

    def reach(self, name: str, kind: Kind) -> Reached:
        """Reach the checkpoint ``name`` now, in the running code's scope,
        to record it later (``record(..., reached=)``): checkpoints reached
        one after another in one task keep their order however their work
        then interleaves (an agent's tool calls of one turn)."""
        key, ordinal, stored = self._reach(name, kind)
        return Reached(key, ordinal, kind, stored)

    def open_scope(self, name: str, *, shared: bool = False) -> Scope:
        """A scope keyed ``name/`` (``name#2/`` the second time) inside the
        running code's scope, to enter with ``within``: an agent's run keeps
        its turns under its name, and each tool call its own checkpoints.
        Scopes opened one after another in one task are named in that order,
        however the code run in them then interleaves, and each scope's
        checkpoints are checked against the stored run on their own. A
        ``shared`` scope makes no branches: whichever task reaches a
        checkpoint in it, the checkpoint is the scope's, keyed in the order
        reached (for code that reaches them one at a time, from tasks it
        does not choose: a framework's turns)."""
        parent = self._scope()
        return Scope(parent.key(check_name(name)) + "/", None, shared=shared)

    @contextlib.contextmanager
    def within(self, scope: Scope) -> Iterator[str]:
        """Checkpoints reached in the block (by this task; tasks it starts
        are branches of it) are ``scope``'s. Yields its path."""
        if not scope.shared:
            scope.owner = asyncio.current_task()
        token = _SCOPE.set((self, scope))
        try:
            yield scope.path
        finally:
            _SCOPE.reset(token)

    @contextlib.contextmanager
    def scope(self, name: str) -> Iterator[str]:
        """``within(open_scope(name))``."""
        with self.within(self.open_scope(name)) as path:
            yield path

    async def record(
        self,
        name: str,
        kind: Kind,
        work: Callable[[], Awaitable[Recorded[T]]],
        decode: Callable[[Any], T],
        *,
        reached: Reached | None = None,
        request: str | None = None,
    ) -> T:
        """The checkpoint ``name``'s value: stored, or ``work``'s (then kept).
        ``request``: what it is asked with, kept to compare replays with."""
        if reached is None:
            reached = self.reach(name, kind)
        key, ordinal, stored = reached.key, reached.ordinal, reached.stored
        if stored is not None:
            self._compare(stored, request)
            return self._replayed(stored, decode)
        # What came before is durable before this one is paid for.
        await self.flush()
        token = _SCOPE.set((self, Scope(key + "/", asyncio.current_task())))
        self._working += 1
        self._idle.clear()
        try:
            recorded = await work()
        except (PermanentError, TransientError) as exc:
            if not isinstance(exc, DeadlineExceeded):
                self._pending.append(self._failed(key, ordinal, kind, exc))
            raise
        finally:
            _SCOPE.reset(token)
            self._working -= 1
            if not self._working:
                self._idle.set()
        emitted, self._since = tuple(self._since), []
        self._pending.append(
            NewCheckpoint(
                key, ordinal, kind, recorded.value, recorded.usage, emitted, request=request
            )
        )
        return recorded.native

    def _failed(self, key: str, ordinal: int, kind: Kind, exc: BaseException) -> NewCheckpoint:
        value = failure_value(exc)
        emitted, self._since = tuple(self._since), []
        return NewCheckpoint(key, ordinal, kind, value, None, emitted, failure=exc)

    async def wait(
        self,
        name: str,
        kind: WaitKind,
        on: Awaited | Callable[[str], Awaited],
        seconds: float,
        decode: Callable[[Any], T],
        *,
        detail: Mapping[str, Any] | None = None,
        reached: Reached | None = None,
        request: str | None = None,
    ) -> T:
        """Wait up to ``seconds`` for what ``on`` says (or a function of the
        checkpoint's key giving it: a call's outbox row names its key): the
        stored outcome, the event if it already arrived, or ``Suspended``. A
        call's row is written with the wait, in one transaction."""
        if reached is None:
            reached = self.reach(name, kind)
        key, ordinal, stored = reached.key, reached.ordinal, reached.stored
        if stored is not None:
            self._compare(stored, request)
            return self._replayed(stored, decode)
        awaited = on(key) if callable(on) else on
        if isinstance(awaited, ForTime) and (seconds <= 0 or not self.sleeps):
            emitted, self._since = tuple(self._since), []
            self._pending.append(NewCheckpoint(key, ordinal, kind, None, None, emitted))
            return decode(None)
        wait = Wait(key, ordinal, kind, seconds, awaited, detail, request)
        async with self._writing:
            self._check_open()
            batch = list(self._pending)
            writes = Writes(tuple(batch), tuple(self._since))
            outcome = await self._store.wait(writes, wait)
            self._written(batch)
            # Only what was written: another branch may have emitted meanwhile.
            self._since = [e for e in self._since if all(e is not w for w in writes.emitted)]
        if outcome is None:
            raise Suspended(key)
        self._stored.setdefault(scope_of(key), []).append(outcome)
        if outcome.status == "failed":
            raise _replayed_failure(outcome)
        return decode(outcome.value)

    async def intend(
        self,
        name: str,
        request: str | None = None,
        *,
        value: Any = True,
        reached: Reached | None = None,
    ) -> Checkpoint | None:
        """Reach the intent ``name`` of an at-most-once call
        (docs/at-most-once.md): the stored intent when a run before this one
        stored it (that run may have made the call: its outcome is unknown),
        else None once the intent is durable, written with what the run
        reached before it in one statement, so the call may run now.
        ``value``: what the intent keeps (a background model call's response
        id, docs/providers.md); ``reached``: the intent, reached before
        (``reach(name, "intent")``)."""
        if reached is None:
            reached = self.reach(check_name(name), "intent")
        key, ordinal, stored = reached.key, reached.ordinal, reached.stored
        if stored is not None:
            self._compare(stored, request)
            return stored
        emitted, self._since = tuple(self._since), []
        self._pending.append(
            NewCheckpoint(key, ordinal, "intent", value, None, emitted, request=request)
        )
        await self.flush()
        return None

    def patched(self, name: str) -> bool:
        """Whether this run takes the code path patched in as ``name``
        (docs/durable-steps.md, "Deploying changed steps"): True for a run
        that reaches this point for the first time (a ``patch`` marker is
        kept, written with the next checkpoint), and for its replays; False
        for a replay of a run that passed this point before the patch
        existed (its stored run has another checkpoint here): it goes on
        down the old path, and nothing is kept."""
        self._check_open()
        stored = self.upcoming()
        if stored is not None and stored.kind != "patch":
            return False
        key, ordinal, found = self._reach(check_name(name), "patch")
        if found is None:
            emitted, self._since = tuple(self._since), []
            self._pending.append(NewCheckpoint(key, ordinal, "patch", True, None, emitted))
        return True

    def upcoming(self) -> Checkpoint | None:
        """The stored checkpoint the running scope reaches next, if a run
        before this one stored one there: a look, not a reach (a replay
        takes the path its stored run took)."""
        scope = self._scope()
        expected = self._stored.get(scope.path, ())
        return expected[scope.reached] if scope.reached < len(expected) else None

    def _reach(self, name: str, kind: Kind) -> tuple[str, int, Checkpoint | None]:
        self._check_open()
        scope = self._scope()
        key = scope.key(name)
        position, scope.reached = scope.reached, scope.reached + 1
        self.reached.append(key)
        expected = self._stored.get(scope.path, ())
        stored = expected[position] if position < len(expected) else None
        if stored is not None and (stored.key != key or stored.kind != kind):
            metrics.NONDETERMINISTIC.labels(workflow=self.workflow).inc()
            raise Nondeterministic(stored.ordinal, stored=stored.key, asked=key)
        if stored is not None:
            return key, stored.ordinal, stored
        self._ordinal += 1
        return key, self._ordinal, None

    def _scope(self) -> Scope:
        """The scope of the code running now; a task the scope's owner started
        gets a branch of its own, from its first checkpoint on."""
        current = _SCOPE.get()
        if current is None or current[0] is not self:
            return self._root
        scope = current[1]
        task = asyncio.current_task()
        if scope.shared or scope.owner is None or task is scope.owner or task is None:
            return scope
        branch = scope.branch(task)
        _SCOPE.set((self, branch))  # in this task's context only
        return branch

    def _compare(self, stored: Checkpoint, request: str | None) -> None:
        """A replay asks a stored checkpoint again: a call asked to send
        another payload, or an at-most-once call's intent asked with other
        arguments, stops the run (``Diverged``: its answer is for another
        question); a model turn asked with another request is
        counted and flagged (the stored answer stands, docs/durable-steps.md)."""
        if request is None or stored.request is None or stored.request == request:
            return
        metrics.REPLAY_DIVERGENCE.labels(workflow=self.workflow, kind=stored.kind).inc()
        if stored.kind in ("call", "intent"):
            raise Diverged(stored.key, stored=stored.request, asked=request)
        self.diverged.append(stored.key)

    def _check_open(self) -> None:
        if self._closed:
            raise RunStopped("the run is over")

    def _replayed(self, stored: Checkpoint, decode: Callable[[Any], T]) -> T:
        if stored.status == "waiting":
            # The job still waits there (a stale message): nothing to do.
            raise Suspended(stored.key)
        # Emits before it were written with it. They stay in ``_since``:
        # written again with the next checkpoint they change nothing (their
        # dedupe keys), while clearing could drop another branch's new emit.
        self.replayed += 1
        metrics.CHECKPOINT_REPLAYS.labels(workflow=self.workflow, kind=stored.kind).inc()
        if stored.status == "failed":
            raise _replayed_failure(stored)
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
        self._check_open()
        await self._flush()

    async def _flush(self) -> None:
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
            self._stored.setdefault(scope_of(checkpoint.key), []).append(checkpoint.stored())
        if batch:
            metrics.CHECKPOINTS_WRITTEN.labels(workflow=self.workflow).inc(len(batch))

    def unwritten(self) -> Writes:
        """What the result's statement writes with it: the checkpoints not
        written yet and the effects emitted since the last checkpoint."""
        return Writes(tuple(self._pending), tuple(self._since))

    async def settle(self, within_s: float) -> None:
        """Wait, at most ``within_s``, for the work of checkpoints still
        running in tasks the step left behind (a branch of a ``gather`` whose
        sibling failed): what they paid for is then kept with the rest."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), max(within_s, 0.0))

    async def keep_after_failure(self, error: BaseException | None = None) -> None:
        """The run failed with ``error``: keep what it paid for (the
        checkpoints reached), so the next delivery does not pay again. A
        failed checkpoint whose error is the one that ended the run is not
        kept: the next delivery tries its work again. The effects emitted
        since the last checkpoint are dropped with the run. Never raises;
        runs to its end even if the caller is cancelled meanwhile."""
        ending = _causes(error)
        self._pending = [
            c for c in self._pending if c.failure is None or id(c.failure) not in ending
        ]
        if not self._pending:
            return
        task = asyncio.ensure_future(self._flush())
        try:
            await asyncio.shield(task)
        except (Exception, Replay, RunStopped, asyncio.CancelledError) as exc:
            if not isinstance(exc, asyncio.CancelledError):
                log.info("journal.not_kept", workflow=self.workflow, error=type(exc).__name__)

    # -- what the run spent ----------------------------------------------------

    def checkpoints(self) -> list[Checkpoint]:
        """Every checkpoint of the job, stored or reached, in ordinal order."""
        stored = [c for scope in self._stored.values() for c in scope]
        return sorted([*stored, *(c.stored() for c in self._pending)], key=attrgetter("ordinal"))

    def usage(self) -> dict[str, Any]:
        """Every model checkpoint of the job, stored or reached, summed."""
        return summed(c.usage for c in self.checkpoints())


def _causes(error: BaseException | None) -> set[int]:
    """The ids of ``error``, every error it was raised from or during, and
    every error of a group among them."""
    seen: set[int] = set()
    todo = [error]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        todo += [current.__cause__, current.__context__]
        if isinstance(current, BaseExceptionGroup):
            todo += current.exceptions
    return seen


def failure_value(exc: BaseException) -> dict[str, Any]:
    """What a failed checkpoint stores of the error its work raised."""
    value = {
        "error": type(exc).__name__,
        "message": str(exc)[:2000],
        "transient": isinstance(exc, TransientError),
    }
    if isinstance(exc, CallFailed):
        value |= {"error": "CallFailed", "status": exc.status, "reason": exc.reason}
    return value


def _replayed_failure(stored: Checkpoint) -> OncelyError:
    """A failed checkpoint's error, raised again on replay as oncely's own
    (the step caught it the first time, and takes the same path again)."""
    value = stored.value if isinstance(stored.value, Mapping) else {}
    if value.get("error") == "CallFailed":
        return CallFailed(
            str(value.get("message", "")), status=value.get("status"), reason=value.get("reason")
        )
    message = f"{value.get('error', 'Error')}: {value.get('message', '')}"
    if value.get("transient"):
        return TransientError(message)
    return PermanentError(message)


@dataclass
class Ephemeral:
    """A store that keeps nothing: shadow runs, and runs with no job behind
    them. A wait ends at once with the event in ``events`` (what the primary
    received), or with None."""

    events: Mapping[str, Any] = field(default_factory=dict)

    async def write(self, writes: Writes) -> None:
        return None

    async def wait(self, writes: Writes, wait: Wait) -> Checkpoint | None:
        if wait.call is not None:
            # Nothing is sent from here: the call fails, as a call can.
            failed = CallFailed(f"{wait.call.topic}: no calls from this run", reason="unsent")
            return Checkpoint(wait.key, wait.ordinal, wait.kind, "failed", failure_value(failed))
        value = self.events.get(wait.event) if wait.event is not None else None
        return Checkpoint(wait.key, wait.ordinal, wait.kind, "done", value)
