"""Names a package exports but imports only when first used (PEP 562), so
that importing the package loads none of its modules' libraries."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def exports(namespace: dict[str, Any], homes: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for the package whose globals are
    ``namespace``: each name in ``homes`` is imported from the module named
    there on first use, then kept in the package."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        namespace[name] = value
        return value

    return __getattr__
