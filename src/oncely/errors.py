"""The small exception hierarchy: transient vs permanent, and idempotency conflicts.

Mapped to HTTP only at the API edge (``oncely.api.problems``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError

# Enough of a validation error to act on; the value itself is never quoted.
_ERRORS_SHOWN = 3
_ERROR_CHARS = 300


def short_errors(exc: ValidationError) -> str:
    """Where and why a value failed validation (a model's answer, a step's
    result, a stored request), in a line, without quoting the value."""
    details = exc.errors(include_url=False, include_context=False, include_input=False)
    parts = [
        f"{'.'.join(str(part) for part in error['loc']) or '(root)'}: {error['msg']}"
        for error in details[:_ERRORS_SHOWN]
    ]
    if len(details) > _ERRORS_SHOWN:
        parts.append(f"and {len(details) - _ERRORS_SHOWN} more")
    text = "; ".join(parts)
    return text if len(text) <= _ERROR_CHARS else text[: _ERROR_CHARS - 1] + "…"


class OncelyError(Exception):
    """Base of every error oncely raises on purpose."""


class TransientError(OncelyError):
    """Can succeed later: retried in process, then by redelivery.

    ``status`` is the provider's HTTP status when there was one (a 429 pauses
    the fleet); ``retry_after_s`` the wait it asked for."""

    def __init__(
        self, message: str, *, retry_after_s: float | None = None, status: int | None = None
    ) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.status = status


class NotSent(TransientError):
    """The call surely never left (its server refused the connection, or
    none could be made): sending it again cannot do anything twice. An
    at-most-once call that raises it is tried again on a later delivery,
    nobody asked (docs/at-most-once.md)."""


class ResumeLater(TransientError):
    """Nothing failed, but the work cannot go on for now: every model of the
    route is cooling down (docs/model-routing.md). The worker defers the job
    by ``resume_in_s`` at most (plus jitter, never longer than its
    redelivery backoff would) without counting a failure, and lets it out
    sooner, when one of ``models`` no longer cools for ``scope`` (the
    tenant's, as the cooldown names it) or may take a probe."""

    def __init__(
        self,
        message: str,
        *,
        resume_in_s: float,
        models: tuple[str, ...] = (),
        scope: str = "",
    ) -> None:
        super().__init__(message, retry_after_s=resume_in_s)
        self.resume_in_s = resume_in_s
        self.models = models
        self.scope = scope


class PermanentError(OncelyError):
    """Never succeeds as is: dead-lettered at once."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class Refused(PermanentError):
    """The model declined to answer (Anthropic's ``stop_reason: "refusal"``,
    a chat completion's ``refusal``): asking again gets the same. The job is
    dead with the reason ``refused``; the ledger records the call as
    ``refused``, with the tokens it was billed (``prompt_tokens``,
    ``completion_tokens``)."""

    dead_reason = "refused"

    def __init__(
        self, message: str = "the model refused to answer", *, tokens: tuple[int, int] = (0, 0)
    ) -> None:
        super().__init__(message)
        self.prompt_tokens, self.completion_tokens = tokens


class ProviderQuota(PermanentError):
    """The provider's account cannot pay for the call: its credit is spent,
    or a spend limit is reached (a 400, 402, 403 or 429 that says so). No
    retry and no fallback will change that, and it says nothing of the
    model's health: the call is never retried, never counts towards the
    model's cooldown, and its job is dead with the reason
    ``provider-quota`` (docs/providers.md)."""

    dead_reason = "provider-quota"


class CallFailed(PermanentError):
    """A call that answers (``ctx.call``, a call tool) ended without a usable
    answer. ``reason``: ``refused`` (the receiver answered 4xx: ``status``),
    ``invalid_answer`` (its 2xx was not JSON valid for ``returns``, too
    large to read, or not storable by PostgreSQL),
    ``attempts`` (the relay's attempts ran out), ``timeout`` (no answer in
    the call's time) or ``undeliverable`` (the row could not be sent at all).
    A step that catches it gets a failed checkpoint: a replay raises it again."""

    def __init__(
        self, message: str, *, status: int | None = None, reason: str | None = None
    ) -> None:
        super().__init__(message, status=status)
        self.reason = reason or "failed"


class NotInApp(OncelyError):
    """A job of a workflow the running app does not have (an operator's
    command run with another ``--app``): nothing was changed."""

    def __init__(self, workflow: str) -> None:
        super().__init__(
            f"the job is of workflow {workflow!r}, which this app does not have: run the"
            " command with the job's app (--app or ONCELY_APP); nothing was changed"
        )
        self.workflow = workflow


class DeadlineExceeded(OncelyError):
    """A delivery's budget ran out. Deliberately not a TimeoutError: the
    in-process retry loop must not retry it; the delivery is redelivered."""


class IdempotencyError(OncelyError):
    """Base of the idempotency conflicts the API maps to 4xx."""


class KeyMalformed(IdempotencyError):
    pass


class KeyMissing(IdempotencyError):
    pass


class KeyReused(IdempotencyError):
    """Same key, different request body."""


class RequestInProgress(IdempotencyError):
    """Same key, same body, the first request has not finished."""


class Nondeterministic(PermanentError):
    """A run of a multi-step job reached a stored checkpoint's ordinal asking
    for another key: the step function no longer runs the way it ran when
    the checkpoints were stored. The job is dead with the reason
    ``nondeterministic``; the message names both keys for operators."""

    dead_reason = "nondeterministic"

    def __init__(self, ordinal: int, *, stored: str, asked: str) -> None:
        super().__init__(
            f"at checkpoint {ordinal} this run asked for {asked!r} "
            f"where the stored run has {stored!r}"
        )
        self.ordinal = ordinal
        self.stored = stored
        self.asked = asked


class Diverged(Nondeterministic):
    """A replay reached a stored call asking to send another payload than
    the one sent: the stored answer is for another question, so the job is
    dead (``nondeterministic``) rather than handed it. The message names the
    checkpoint and both payloads (cut short) for operators."""

    def __init__(self, key: str, *, stored: str, asked: str) -> None:
        PermanentError.__init__(
            self,
            f"replay of {key!r} asks to send {_cut(asked)} where the stored run sent"
            f" {_cut(stored)}",
        )
        self.ordinal = 0
        self.stored = stored
        self.asked = asked
        self.key = key


def _cut(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


class FleetLimited(TransientError):
    """The fleet's limits held a call back longer than its attempt may wait:
    it was never sent (no ledger row, no failure of the model's)."""
