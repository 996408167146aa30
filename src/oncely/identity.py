"""A job's identity, one home (docs/guarantees.md): the request's scope
(tenant, method, route, key) and the job id derived from it, a map child's
id, and the canonical JSON every fingerprint is taken of. A leaf: no I/O,
no driver, so the intake, the schedules, the step kit and
``oncely.testing`` derive the same ids.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from functools import cached_property
from typing import Any

# Fixed namespace for deterministic job ids: uuid5(JOB_NAMESPACE, scope).
JOB_NAMESPACE = uuid.UUID("5b0c8e3e-7d0a-4f4e-9a53-0c7e1f7d2a61")


@dataclass(frozen=True)
class Scope:
    """Who asked for what: tenant, method, route template and key.

    Each part is length-prefixed, so no two distinct tuples share a text.
    The derived values are computed once per request (``cached_property``
    writes the instance's ``__dict__``, which a frozen dataclass allows).
    """

    tenant: str
    method: str
    route: str
    key: str

    @cached_property
    def text(self) -> str:
        parts = (self.tenant, self.method.upper(), self.route, self.key)
        return "|".join(f"{len(p.encode())}:{p}" for p in parts)

    @cached_property
    def digest(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    @cached_property
    def job_id(self) -> uuid.UUID:
        return uuid.uuid5(JOB_NAMESPACE, self.text)


def canonical_json(value: Any) -> bytes:
    """Object keys sorted, arrays in order, no insignificant whitespace."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def fingerprint(value: Any) -> str:
    return hashlib.sha256(canonical_json(value)).hexdigest()


def child_id(parent_id: str, key: str, position: int) -> str:
    """A map child's job id: the same for the same parent, map and item, so a
    replay never starts a child twice."""
    return str(uuid.uuid5(uuid.UUID(parent_id), f"{key}/{position}"))
