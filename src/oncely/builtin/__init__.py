"""The built-in workflows, written only against oncely's public API, and the
default app that serves them (``oncely --app oncely.builtin:app``)."""

from oncely.app import App
from oncely.builtin.summaries import summaries
from oncely.builtin.triage import triage

app = App([summaries, triage])

__all__ = ["app", "summaries", "triage"]
