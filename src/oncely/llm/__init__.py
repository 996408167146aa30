"""The model-provider seam: the ``LLM`` protocol, its OpenAI-compatible adapter,
and ``Model``, what a workflow step calls the model through."""

from __future__ import annotations

from oncely.llm.base import LLM, Completion, Message, ResponseSchema
from oncely.llm.model import InvalidOutput, Model, Usage
from oncely.llm.openai_compat import OpenAICompatible

__all__ = [
    "LLM",
    "Completion",
    "InvalidOutput",
    "Message",
    "Model",
    "OpenAICompatible",
    "ResponseSchema",
    "Usage",
]
