"""The Idempotency-Key header, parsed. Pure functions, no I/O: the store
(``store.py``) and the FastAPI dependency (``idempotency.py``) build on
them and on the request's identity (``oncely.identity``).
"""

from __future__ import annotations

from oncely.errors import KeyMalformed, KeyMissing

MIN_KEY_LEN = 16
MAX_KEY_LEN = 255


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
