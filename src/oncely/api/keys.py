"""Idempotency keys: header parsing, request scope and body fingerprint.

Pure functions, no I/O: the store (``store.py``) and the FastAPI dependency
(``idempotency.py``) build on them.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from oncely.errors import KeyMalformed, KeyMissing

MIN_KEY_LEN = 16
MAX_KEY_LEN = 255

# Fixed namespace for deterministic job ids: uuid5(JOB_NAMESPACE, scope).
JOB_NAMESPACE = uuid.UUID("5b0c8e3e-7d0a-4f4e-9a53-0c7e1f7d2a61")


def parse_key(values: list[str]) -> str:
    """The idempotency key from the header's raw values.

    Accepts the structured-field string form (``"abc"``, with ``\\"`` and
    ``\\\\`` escapes) and the bare form. A bare value with a comma is refused:
    it is what a proxy makes of two repeated headers.
    """
    if not values:
        raise KeyMissing("the Idempotency-Key header is required")
    if len(values) > 1:
        raise KeyMalformed("send the Idempotency-Key header once")
    raw = values[0].strip()
    key = _unquote(raw) if raw.startswith('"') else _bare(raw)
    if not MIN_KEY_LEN <= len(key) <= MAX_KEY_LEN:
        raise KeyMalformed(f"Idempotency-Key must be {MIN_KEY_LEN} to {MAX_KEY_LEN} characters")
    if not all(" " <= ch <= "~" for ch in key):
        raise KeyMalformed("Idempotency-Key must be printable ASCII")
    return key


def _bare(raw: str) -> str:
    if "," in raw:
        raise KeyMalformed("send the Idempotency-Key header once")
    return raw


def _unquote(raw: str) -> str:
    if len(raw) < 2 or not raw.endswith('"'):
        raise KeyMalformed("unterminated quoted Idempotency-Key")
    out: list[str] = []
    chars = iter(raw[1:-1])
    for ch in chars:
        if ch == "\\":
            escaped = next(chars, "")
            if escaped not in ('"', "\\"):
                raise KeyMalformed("bad escape in quoted Idempotency-Key")
            out.append(escaped)
        elif ch == '"':
            raise KeyMalformed("stray quote in Idempotency-Key")
        else:
            out.append(ch)
    return "".join(out)


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
