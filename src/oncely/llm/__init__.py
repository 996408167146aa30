"""The model-provider seam: the ``LLM`` protocol and its OpenAI-compatible adapter."""

from __future__ import annotations

from oncely.llm.base import LLM, build_summary_prompt
from oncely.llm.openai_compat import OpenAICompatible

__all__ = ["LLM", "OpenAICompatible", "build_summary_prompt"]
