"""SQL lives here: numbered migrations and named queries, read by name."""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

_NAME = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.MULTILINE)


@cache
def _queries() -> dict[str, str]:
    text = resources.files(__package__).joinpath("queries.sql").read_text()
    parts = _NAME.split(text)
    # parts = [preamble, name1, body1, name2, body2, ...]
    return {name: body.strip() for name, body in zip(parts[1::2], parts[2::2], strict=True)}


def query(name: str) -> str:
    """The named statement from ``queries.sql`` (KeyError if there is none)."""
    return _queries()[name]
