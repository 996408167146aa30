"""Text PostgreSQL cannot keep in JSON: NUL, and halves of surrogate pairs.

``jsonb`` refuses both, so such text from a client (a request, an event, a
decision) or a model (a tool call's arguments) is refused where it enters,
with where it was found, instead of failing as a 500 or killing the job on
every retry.
"""

from __future__ import annotations

import re
from typing import Any

_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")

# What a refusal says, wherever it is made.
UNSTORABLE_TEXT = "text must not contain NUL (U+0000) or lone surrogates (U+D800–U+DFFF)"


def unstorable(value: Any, loc: tuple[str | int, ...] = ()) -> tuple[str | int, ...] | None:
    """The location of the first unstorable string (or key) in ``value``,
    below ``loc``; None when every string can be stored."""
    if isinstance(value, str):
        return loc if _UNSTORABLE.search(value) else None
    if isinstance(value, dict):
        items: list[tuple[Any, Any]] = list(value.items())
    elif isinstance(value, list | tuple):
        items = list(enumerate(value))
    else:
        return None
    for key, item in items:
        if isinstance(key, str) and _UNSTORABLE.search(key):
            return (*loc, key)
        if (found := unstorable(item, (*loc, key))) is not None:
            return found
    return None
