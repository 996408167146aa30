"""A batch line in its dialect (docs/lanes.md): the request body a line
carries, and its answer read back, each as the dialect's adapter would
send and read the call. Driver-free, so the model seam can build lines
without the batch store (``oncely.llm.batches``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from oncely.llm import wire
from oncely.llm.base import Completion, Message, ResponseSchema, ToolChoice, ToolSpec


def line_body(
    dialect: str,
    model: str,
    messages: Sequence[Message],
    schema: ResponseSchema | None,
    tools: Sequence[ToolSpec],
    tool_choice: ToolChoice | None,
) -> dict[str, Any]:
    """A batch line's request body (docs/lanes.md), as its dialect's
    adapter sends the call."""
    if dialect == "responses":
        from oncely.llm import openai_responses

        body = openai_responses.request_body(model, messages, schema, tools, tool_choice)
        return {**body, "store": False}
    return wire.request_body(model, messages, schema, tools, tool_choice)


def line_answer(dialect: str, data: object) -> Completion:
    """A batch line's answer (the provider's response body) as its dialect
    reads it."""
    if dialect == "responses":
        from oncely.llm import openai_responses

        return openai_responses.read_response(data)
    return wire.read_answer(data)
