"""At most once: effects no receiver dedupes (docs/at-most-once.md).

Exactly once needs a receiver that dedupes on the call's stable key. For
one that does not (a legacy API, a shell command, an MCP server), sending
again after a crash is the bug. So an at-most-once call keeps, in its
checkpoint's scope, one ``intent`` per attempt, stored before the attempt
runs. A run that reaches an intent already stored, with no result after it,
does not know whether the call happened (the worker died mid-call, or the
call raised something other than ``PermanentError``): it never runs the
call again on its own. It asks:

- ``reconcile(arguments, key)`` when one is given (a ``reconcile``
  checkpoint, retried like a step): its value is the call's result, and
  ``oncely.NOT_DONE`` means the call did not happen, so it runs again, as a
  new attempt with an intent of its own;
- an attempt that raised ``oncely.errors.NotSent`` (it surely never left:
  its server refused the connection) is known not done: kept as a
  ``reconcile`` checkpoint saying so, and the job is retried later, nobody
  asked;
- else, or when reconcile fails, a person: the job waits (an ``uncertain``
  checkpoint, holding no worker slot) for ``resend``, ``result`` or
  ``failed`` (``oncely.UncertainDecision``), posted to ``<route>/{job_id}/
  uncertain/{call_id}``, given with ``oncely jobs resolve`` or the console.

Attempt n's checkpoints are ``intent#n``, then ``reconcile#n`` or
``uncertain#n``: a replay walks them in order, so every attempt is decided
once, and a resend is a new attempt (a crash during it is asked about
again, under a new call id). The stable key stays the one of the call's
checkpoint across attempts: a receiver that does dedupe on it still sees
one effect.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, Protocol

import structlog
from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from oncely import metrics
from oncely.decisions import NOT_DONE, UncertainDecision, call_id, uncertain_event
from oncely.errors import NotSent, PermanentError, TransientError
from oncely.journal import ForEvent, Journal, Recorded, asked
from oncely.retry import Deadline

log = structlog.get_logger("oncely.at_most_once")

# A reconcile's value as stored: did the call happen, and its result.
_RECONCILED = "done"


class _Deadlined(Protocol):
    @property
    def deadline(self) -> Deadline: ...


class Context(Protocol):
    """What an at-most-once call needs of the run's ``oncely.Context``."""

    job_id: str
    workflow: str
    _journal: Journal
    _wait_max_s: float

    @property
    def model(self) -> _Deadlined: ...

    def declares(self, topic: str) -> bool: ...

    def emit(
        self, topic: str, payload: Mapping[str, Any], *, dedupe_key: str | None = None
    ) -> None: ...

    async def _retried(
        self, name: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any: ...


async def run_at_most_once(
    ctx: Context,
    *,
    label: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    arguments: Any,
    shown: Mapping[str, Any],
    reconcile: Callable[[Any, str], Any] | None,
    key: str,
) -> Any:
    """``fn(*args, **kwargs)`` at most once per decision, in the scope of its
    checkpoint (module docstring). ``label``: the tool or step, as operators
    see it; ``arguments``: what ``reconcile`` is given; ``shown``: the
    arguments as JSON, as a person sees them; ``key``: the call's stable
    key. Returns the call's result; raises ``PermanentError`` for a call
    that failed (by its own word, or a person's)."""
    journal = ctx._journal
    request = asked(shown)
    while True:
        intent = await journal.intend("intent", request)
        if intent is None:
            try:
                return await _attempt(ctx, fn, args, kwargs)
            except PermanentError:
                raise
            except NotSent:
                # Known not done: the next delivery sends it again, unasked.
                await journal.record("reconcile", "reconcile", _not_sent, _reconciled_as)
                raise
            except Exception as exc:  # any other failure: the outcome is unknown
                since = datetime.now(UTC)
                log.warning(
                    "call.outcome_unknown",
                    job_id=ctx.job_id,
                    tool=label,
                    error=type(exc).__name__,
                )
        else:
            since = intent.finished_at or datetime.now(UTC)
        decided = await _decide(ctx, label, arguments, shown, reconcile, key, since)
        if decided.resend:
            continue
        if decided.failed is not None:
            raise PermanentError(f"{label}: {decided.failed}")
        return decided.result


async def _attempt(
    ctx: Context, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """One attempt, within what is left of the delivery's budget: never retried."""
    async with asyncio.timeout(max(ctx.model.deadline.remaining(), 0.001)):
        if inspect.iscoroutinefunction(fn):
            return await fn(*args, **kwargs)
        value = await asyncio.to_thread(functools.partial(fn, *args, **kwargs))
        return await value if inspect.isawaitable(value) else value


async def _decide(
    ctx: Context,
    label: str,
    arguments: Any,
    shown: Mapping[str, Any],
    reconcile: Callable[[Any, str], Any] | None,
    key: str,
    since: datetime,
) -> UncertainDecision:
    """What became of an attempt whose outcome is unknown: reconcile's word
    when it gives one (or gave one before: a ``NotSent`` attempt's), else a
    person's."""
    upcoming = ctx._journal.upcoming()
    if reconcile is not None or (upcoming is not None and upcoming.kind == "reconcile"):
        try:
            found = await _reconciled(ctx, label, reconcile, arguments, key)
        except (PermanentError, TransientError) as exc:
            # The type only: a remote service's text stays out of the log.
            log.warning(
                "call.reconcile_failed", job_id=ctx.job_id, tool=label, error=type(exc).__name__
            )
        else:
            return found
    return await _ask_a_person(ctx, label, shown, since)


async def _reconciled(
    ctx: Context,
    label: str,
    reconcile: Callable[[Any, str], Any] | None,
    arguments: Any,
    key: str,
) -> UncertainDecision:
    journal = ctx._journal

    async def work() -> Recorded[UncertainDecision]:
        if reconcile is None:  # only a replay reaches here without one
            raise PermanentError(f"{label}: a stored reconcile checkpoint without a reconcile")
        value = await ctx._retried(f"{label} reconcile", reconcile, (arguments, key), {})
        # Counted when decided, never again on a replay of the decision.
        metrics.UNCERTAIN_RESOLVED.labels(workflow=ctx.workflow, how="reconcile").inc()
        if value is NOT_DONE:
            return Recorded({_RECONCILED: False}, UncertainDecision(resend=True))
        result = to_jsonable_python(value)
        return Recorded({_RECONCILED: True, "result": result}, UncertainDecision(result=result))

    return await journal.record("reconcile", "reconcile", work, _reconciled_as)


async def _not_sent() -> Recorded[UncertainDecision]:
    return Recorded({_RECONCILED: False, "not_sent": True}, UncertainDecision(resend=True))


def _reconciled_as(stored: Any) -> UncertainDecision:
    """A stored reconcile checkpoint's word."""
    if stored.get(_RECONCILED):
        return UncertainDecision(result=stored.get("result"))
    return UncertainDecision(resend=True)


async def _ask_a_person(
    ctx: Context, label: str, shown: Mapping[str, Any], since: datetime
) -> UncertainDecision:
    """Wait, holding nothing, for a person's word (``UncertainDecision``)."""
    journal = ctx._journal
    reached = journal.reach("uncertain", "uncertain")
    decided_as = call_id(reached.key, label, shown)
    pending = {
        "call_id": decided_as,
        "tool": label,
        "arguments": dict(shown),
        "since": since.isoformat(),
    }
    if reached.stored is None:
        age_s = max((datetime.now(UTC) - since).total_seconds(), 0.0)
        # By workflow only: an MCP server names its tools, and a metric's
        # labels must not be a server's to make up.
        metrics.UNCERTAIN_CALLS.labels(workflow=ctx.workflow).inc()
        log.warning(
            "call.uncertain",
            job_id=ctx.job_id,
            tool=label,
            call_id=decided_as,
            age_s=round(age_s, 3),
        )
        if ctx.declares("uncertain.raised"):
            ctx.emit(
                "uncertain.raised",
                {"job_id": ctx.job_id, **pending},
                dedupe_key=f"uncertain.raised:{ctx.job_id}:{decided_as}",
            )

    def decode(value: Any) -> UncertainDecision:
        if value is None:
            # No word within ONCELY_WAIT_MAX_S: failed, never sent again.
            return UncertainDecision(failed="no decision on the uncertain call in time")
        # A person's word is counted where it is taken (jobs/approvals.decide).
        return UncertainDecision.model_validate({k: v for k, v in value.items() if k != "by"})

    return await journal.wait(
        "uncertain",
        "uncertain",
        ForEvent(uncertain_event(decided_as)),
        ctx._wait_max_s,
        decode,
        detail={"uncertain": pending},
        reached=reached,
    )


def shown_arguments(arguments: Any) -> dict[str, Any]:
    """A call's arguments as JSON, as a person sees them: a tool's model
    dumped, a step's arguments by parameter name (values that are not JSON
    shown by their type)."""
    if isinstance(arguments, BaseModel):
        dumped: dict[str, Any] = arguments.model_dump(mode="json")
        return dumped
    return {
        name: to_jsonable_python(value, fallback=lambda v: f"<{type(v).__name__}>")
        for name, value in dict(arguments).items()
    }


def step_arguments(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """A step's arguments by parameter name (what its reconcile is given)."""
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return {**{f"arg{i}": a for i, a in enumerate(args)}, **kwargs}
    return dict(bound.arguments)
