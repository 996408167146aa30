"""SQL lives here: numbered migrations, and named queries in one file per
table (``jobs.sql``, ``outbox.sql``, ``api_keys.sql``, ``migrations.sql``)."""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

_NAME = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.MULTILINE)


@cache
def _queries() -> dict[str, str]:
    found: dict[str, str] = {}
    for entry in resources.files(__package__).iterdir():
        if not entry.name.endswith(".sql"):
            continue
        parts = _NAME.split(entry.read_text())
        # parts = [preamble, name1, body1, name2, body2, ...]
        for name, body in zip(parts[1::2], parts[2::2], strict=True):
            if name in found:
                raise RuntimeError(f"query {name!r} is named twice")
            found[name] = body.strip()
    return found


def query(name: str) -> str:
    """The named statement (KeyError if there is none)."""
    return _queries()[name]
