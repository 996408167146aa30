"""Anthropic's Message Batches for the batch lane (docs/lanes.md): the
``BatchAPI`` of the ``anthropic`` dialect, through the official SDK (its
retries off: the batcher's next tick is the retry), on the endpoint the
dialect's adapter asks (``oncely.llm.anthropic_messages``).

- A batch is created with ``{"requests": [{"custom_id", "params"}]}``, each
  ``params`` a line's body as the dialect's adapter builds its request
  (``oncely.llm.lines.line_body``), its ``custom_id`` oncely's line id
  (``[a-zA-Z0-9_-]``, as the API asks).
- It runs ``in_progress`` (``canceling`` while cancelled), then ``ended``;
  its results are read from the API's results path for its id (never from
  the ``results_url`` it sent: a provider's URL gets no key), one JSON line
  each, ``{"custom_id", "result": {"type", ...}}``: ``succeeded`` answers
  the line with its ``message`` (read by the dialect's own parsing when the
  job looks); ``errored`` fails it with the status its error's ``type``
  stands for and that type as its code (never the message), or as
  ``billing_error`` when it says the account cannot pay (the call then
  fails as ``ProviderQuota``, as a call of the dialect would); ``expired``
  and ``canceled`` leave it unanswered, and the batch counts as
  ``expired`` (its unanswered lines go in a batch once more) or
  ``cancelled`` (they fail transiently and go back in line), as OpenAI's
  batches that ended so.

Recovery without metadata. An Anthropic batch carries no metadata, so a
batch created by a process that died before recording its id cannot be
found by oncely's batch id. ``find`` lists the workspace's batches, newest
first, back to the lines' gathering time, and takes as candidates those
created no earlier than the lines were gathered (less ``CLOCK_SLACK_S``,
for the provider's clock against PostgreSQL's) that hold as many requests
as the batch has lines, the one created closest to the gathering first;
the batcher adopts the first that no other oncely batch recorded, and
creates the batch when none is left. No upper bound on the time: a
recovering batcher that created the batch and died in turn created it long
after the gathering, and its batch must be found too. A wrong adoption
(another client's batch of the same size, created since) costs time,
never a wrong answer:
a result only ever changes a line of the batch that carried it, by its
custom id, and the lines left unanswered once the adopted batch ended go
back in line.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any, cast

import anthropic

from oncely.llm import wire
from oncely.llm.anthropic_messages import dry_account, error_status, sdk_base_url
from oncely.llm.batches import Outcome, Unrecorded, failure, jsonl

# How far the provider's clock may be from PostgreSQL's.
CLOCK_SLACK_S = 120.0
# How many batches a recovery lists at most (pages of 100), newest first.
_LISTED_MAX = 1000
# A batch's result that leaves its line unanswered, as the status of the
# batch it makes (its lines then go back in line as for OpenAI's).
_UNANSWERED = {"expired": "expired", "canceled": "cancelled"}


class AnthropicBatches:
    """Anthropic's Message Batches API (module doc)."""

    def __init__(self, client: anthropic.AsyncAnthropic) -> None:
        self._client = client

    @classmethod
    def connect(cls, base_url: str, api_key: str) -> AnthropicBatches:
        """The client of the endpoint the ``anthropic`` dialect asks (its
        base URL written as OpenAI's, ending in ``/v1``)."""
        client = anthropic.AsyncAnthropic(
            base_url=sdk_base_url(base_url),
            api_key=api_key,
            max_retries=0,
            http_client=anthropic.DefaultAioHttpClient(),
        )
        return cls(client)

    async def aclose(self) -> None:
        await self._client.close()

    async def create(self, batch_id: str, lines: Sequence[tuple[str, Any]]) -> str:
        requests = [{"custom_id": custom_id, "params": body} for custom_id, body in lines]
        created = await self._client.messages.batches.create(requests=cast("Any", requests))
        return wire.provider_id(created.id)

    async def find(self, lost: Unrecorded) -> list[str]:
        earliest = lost.gathered_at - timedelta(seconds=CLOCK_SLACK_S)
        found: list[tuple[timedelta, str]] = []
        listed = 0
        async for batch in self._client.messages.batches.list(limit=100):
            listed += 1
            created = batch.created_at
            if created < earliest or listed > _LISTED_MAX:
                break
            if _size(batch) == len(lost.lines):
                found.append((abs(created - lost.gathered_at), wire.provider_id(batch.id)))
        return [provider_id for _, provider_id in sorted(found)]

    async def poll(self, provider_id: str) -> tuple[str, list[Outcome]]:
        checked = wire.provider_id(provider_id)
        batch = await self._client.messages.batches.retrieve(checked)
        if batch.processing_status != "ended":
            return str(batch.processing_status), []
        data = await self._client.get(f"/v1/messages/batches/{checked}/results", cast_to=bytes)
        return outcomes(jsonl(data))


def _size(batch: Any) -> int:
    """How many requests a batch holds, every status counted."""
    counts = batch.request_counts
    return int(
        counts.processing + counts.succeeded + counts.errored + counts.canceled + counts.expired
    )


def outcomes(results: Sequence[dict[str, Any]]) -> tuple[str, list[Outcome]]:
    """An ended batch's results as its status and its lines' outcomes
    (module doc)."""
    status = "completed"
    found: list[Outcome] = []
    for item in results:
        custom_id, result = item.get("custom_id"), item.get("result")
        if not isinstance(custom_id, str) or not isinstance(result, dict):
            continue
        kind = result.get("type")
        if kind == "succeeded" and isinstance(result.get("message"), dict):
            found.append(Outcome(custom_id, "answered", answer=result["message"]))
        elif kind in _UNANSWERED:
            # An expired line outranks a cancelled one: each goes once more.
            if status != "expired":
                status = _UNANSWERED[kind]
        else:
            found.append(Outcome(custom_id, "failed", error=_failure(result.get("error"))))
    return status, found


def _failure(response: object) -> dict[str, Any]:
    """An errored result (``{"type": "error", "error": {"type",
    "message"}}``) as a line's error: the status its type stands for and
    the type, or ``billing_error`` when it says the account cannot pay
    (as a call's error would be ``ProviderQuota``); never its message."""
    error = response.get("error") if isinstance(response, dict) else None
    kind = error.get("type") if isinstance(error, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    code = kind if isinstance(kind, str) else None
    status = error_status(code)
    if dry_account(status, code, None, message):
        status, code = 402, "billing_error"
    return failure(status, code)
