"""An ``App`` collects workflows; every oncely process serves one.

``oncely --app module:attr …`` (or ``ONCELY_APP``) names the app a process
loads; the default is ``oncely.builtin:app`` with the built-in workflows.
"""

from __future__ import annotations

import importlib
import os
import sys
import sysconfig
import traceback
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from oncely.effects import Effect
from oncely.workflow import Workflow

DEFAULT_APP = "oncely.builtin:app"


class App:
    """The workflows one deployment runs. Names, routes and topics are unique."""

    def __init__(self, workflows: Iterable[Workflow[Any, Any]] = ()) -> None:
        self._workflows: dict[str, Workflow[Any, Any]] = {}
        for workflow in workflows:
            self.register(workflow)

    def register(self, workflow: Workflow[Any, Any]) -> Workflow[Any, Any]:
        if workflow.name in self._workflows:
            raise ValueError(f"workflow {workflow.name!r} is registered twice")
        for other in self._workflows.values():
            if other.route == workflow.route:
                raise ValueError(f"workflows {other.name!r} and {workflow.name!r} share a route")
            if clash := other.topics & workflow.topics:
                topic = sorted(clash)[0]
                raise ValueError(
                    f"workflows {other.name!r} and {workflow.name!r} both declare topic"
                    f" {topic!r}: a topic is one workflow's (its effects' rows and its calls'"
                    " answers are that workflow's). To use one tool in both, give each its own"
                    f" topic, e.g. call_tool('{workflow.name}.{topic}', name=..., ...), and"
                    " route both to the same receiver (docs/agents.md, 'One tool in two"
                    " workflows')"
                )
        self._workflows[workflow.name] = workflow
        return workflow

    def __iter__(self) -> Iterator[Workflow[Any, Any]]:
        return iter(self._workflows.values())

    def __len__(self) -> int:
        return len(self._workflows)

    def __getitem__(self, name: str) -> Workflow[Any, Any]:
        return self._workflows[name]

    @property
    def names(self) -> list[str]:
        return list(self._workflows)

    def effects(self) -> list[tuple[str, Effect]]:
        """Every declared effect with its workflow's name."""
        return [(w.name, effect) for w in self for effect in w.effects]

    def only(self, names: Sequence[str]) -> App:
        """The same app narrowed to ``names`` (KeyError for an unknown one)."""
        return App(self[name] for name in names) if names else self


def load_app(spec: str) -> App:
    """``module:attr`` → the App it names (ValueError with a readable reason)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--app wants module:attribute, got {spec!r}")
    # Like uvicorn: modules next to where the command runs are importable.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import {module_name!r}: {exc}") from exc
    except Exception as exc:
        # The app's own code failed as it was imported (a setting it reads
        # missing, say): where, and what, on one line.
        raise ValueError(
            f"importing {module_name!r} raised {type(exc).__name__}: {exc} ({_where(exc)})"
        ) from exc
    found = getattr(module, attr, None)
    if not isinstance(found, App):
        raise ValueError(f"{spec!r} is not an oncely App (got {type(found).__name__})")
    return found


def _where(exc: BaseException) -> str:
    """``file:line`` where ``exc`` was raised, in the deepest frame outside
    Python's own library (the app's code, not ``os.environ``'s)."""
    frames = traceback.extract_tb(exc.__traceback__)
    stdlib = sysconfig.get_paths()["stdlib"]
    ours = [f for f in frames if not f.filename.startswith(("<", stdlib))]
    frame = (ours or frames)[-1]
    return f"{frame.filename}:{frame.lineno}"
