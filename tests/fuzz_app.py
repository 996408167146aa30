"""The app the fuzz test serves: the built-in workflows and the example's
multi-step one, so every kind of route (an event route included) is fuzzed."""

from __future__ import annotations

from examples.refunds import refunds

from oncely import App
from oncely.builtin import app as builtin

app = App([*builtin, refunds])
