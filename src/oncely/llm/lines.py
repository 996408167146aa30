"""A batch line in its dialect (docs/lanes.md): its custom id, the request
body it carries, and its answer read back, each as the dialect's adapter
would send and read the call. Driver-free, so the model seam can build
lines without the batch store (``oncely.llm.batches``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from oncely.llm import wire
from oncely.llm.base import Completion, Message, ResponseSchema, ToolChoice, ToolSpec

# What a line's custom id starts with; the rest is hex, so every provider
# takes it (Anthropic's ``[a-zA-Z0-9_-]{1,64}`` is the strictest).
_LINE_PREFIX = "oncely-"


def line_id(job_id: str, key: str, dialect: str) -> str:
    """A line's ``custom_id``, derived from its job and its call's
    checkpoint key alone: the same call always has the same id (a
    redelivery's intent is the same line), so no table maps it back; the
    line's row keeps both. OpenAI's batches take ``<job_id>:<key>`` as it
    reads; Anthropic's take only ``[a-zA-Z0-9_-]{1,64}``, so an
    ``anthropic`` line's id is ``oncely-`` and 40 hex digits of the same."""
    plain = f"{job_id}:{key}"
    if dialect != "anthropic":
        return plain
    return _LINE_PREFIX + hashlib.sha256(plain.encode()).hexdigest()[:40]


def line_body(
    dialect: str,
    model: str,
    messages: Sequence[Message],
    schema: ResponseSchema | None,
    tools: Sequence[ToolSpec],
    tool_choice: ToolChoice | None,
    *,
    max_tokens: int | None = None,
) -> dict[str, Any]:
    """A batch line's request body (docs/lanes.md), as its dialect's
    adapter sends the call (``max_tokens``: the ``anthropic`` adapter's)."""
    if dialect == "responses":
        from oncely.llm import openai_responses

        body = openai_responses.request_body(model, messages, schema, tools, tool_choice)
        return {**body, "store": False}
    if dialect == "anthropic":
        from oncely.llm import anthropic_messages as claude

        limit = max_tokens or claude.DEFAULT_MAX_TOKENS
        return claude.request_body(model, limit, messages, schema, tools, tool_choice)
    return wire.request_body(model, messages, schema, tools, tool_choice)


def line_answer(dialect: str, data: object) -> Completion:
    """A batch line's answer (the provider's response body, or message) as
    its dialect reads it."""
    if dialect == "responses":
        from oncely.llm import openai_responses

        return openai_responses.read_response(data)
    if dialect == "anthropic":
        from oncely.llm import anthropic_messages

        return anthropic_messages.read_message(data)
    return wire.read_answer(data)
