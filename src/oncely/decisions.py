"""A person's decisions on a job's tool calls, and the ids they are made under.

Two kinds: an approval (may this call run?) and an uncertain call's
outcome (an at-most-once effect whose worker died mid-call: did it happen?).

A decision is keyed by what oncely made, never by an id a provider or a
model chose (providers repeat ``call_0`` across turns, or send no id at
all): the id of a pending tool call is derived from its checkpoint's key
(unique within the job) and from the tool and arguments the person is shown.
So a decision decides the one call it was made for; a call the model asks
again with other arguments (a rewound run) is a new call, with a new id.

Ids are 20 lowercase hex digits: safe as a URL path segment, a shell word
and a log field as they are. Anything else given as an id names no call.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# The shape of every id this module makes.
_CALL_ID = re.compile(r"^[0-9a-f]{20}$")


class ApprovalDecision(BaseModel):
    """A person's decision on a tool call (``POST
    <route>/{job_id}/approvals/{call_id}``): approved or not, with edited
    ``arguments`` (they replace the model's) and a ``reason``."""

    approved: bool
    arguments: dict[str, Any] | None = None
    reason: str | None = None


class _NotDone:
    """``oncely.NOT_DONE``: what a reconcile function returns when the
    effect did not happen, so it may run (again)."""

    _instance: _NotDone | None = None

    def __new__(cls) -> _NotDone:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "oncely.NOT_DONE"

    def __reduce__(self) -> str:
        return "NOT_DONE"


NOT_DONE = _NotDone()


def _exactly_one(schema: dict[str, Any]) -> None:
    """``UncertainDecision``'s JSON schema says what it accepts: exactly one
    of its fields, none of them null but ``result``."""
    schema["properties"] = {
        "resend": {"const": True, "type": "boolean", "description": "It did not happen."},
        "result": {"description": "It happened, with this result (any JSON)."},
        "failed": {"type": "string", "minLength": 1, "maxLength": 2000},
    }
    schema["oneOf"] = [{"required": [name]} for name in ("resend", "result", "failed")]
    schema["additionalProperties"] = False


class UncertainDecision(BaseModel):
    """A person's word on an at-most-once call whose outcome is unknown
    (``POST <route>/{job_id}/uncertain/{call_id}``): exactly one of
    ``resend`` (it did not happen: run it again), ``result`` (it happened,
    with this result) or ``failed`` (it failed, for this reason)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_exactly_one)

    resend: Literal[True] | None = None
    result: Any = None
    failed: str | None = Field(None, min_length=1, max_length=2000)

    @model_validator(mode="after")
    def _one_choice(self) -> UncertainDecision:
        chosen = [
            name
            for name, given in (
                ("resend", self.resend is not None),
                ("result", "result" in self.model_fields_set),
                ("failed", self.failed is not None),
            )
            if given
        ]
        if len(chosen) != 1:
            raise ValueError("give exactly one of resend (true), result or failed")
        return self


def call_id(key: str, tool: str, arguments: Mapping[str, Any] | None) -> str:
    """The id a pending decision on a tool call is made under: the call's
    checkpoint ``key`` (``support/refund#2/approval``), its ``tool`` and the
    ``arguments`` shown, hashed."""
    text = json.dumps(
        [key, tool, arguments], sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:20]


def is_call_id(value: str) -> bool:
    """Whether ``value`` has the shape of an id ``call_id`` makes."""
    return bool(_CALL_ID.match(value))


def approval_event(call_id: str) -> str:
    """The job event a decision on ``call_id`` is stored as (and waited for)."""
    return f"approval:{call_id}"


def uncertain_event(call_id: str) -> str:
    """The job event a decision on an uncertain call is stored as."""
    return f"uncertain:{call_id}"
