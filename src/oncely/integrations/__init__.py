"""Your agent framework, with oncely's guarantees (docs/frameworks.md).

``oncely.integrations.pydantic_ai``, ``oncely.integrations.openai_agents``
and ``oncely.integrations.langgraph`` run a framework's own agent inside a
step and take the two things that cost money or touch the world through
oncely's checkpoints: each model request is a model checkpoint (never paid
for again once answered) and each tool call a tool checkpoint (never run
again once it answered; ``oncely.tool_key()`` inside it is the key an API
dedupes on). Each is a thin adapter over the public checkpoint kit
(``oncely.integrations.runs``, ``Context.open_scope``, ``Context.tool``,
``Context.approval``, ``ctx.model.respond``): it owns no table and keeps
no state across runs.

Importing this package imports no framework; each module imports its own
(extras ``oncely[pydantic-ai]``, ``oncely[openai-agents]``,
``oncely[langgraph]``).
"""
