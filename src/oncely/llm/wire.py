"""The chat-completions wire format both model clients share, and what its
answers mean to oncely: the request's ``response_format``, a status turned
into ``TransientError`` or ``PermanentError``, and a 200's answer turned into
a ``Completion``. Imports no SDK, so the lean client (``oncely.llm.lean``)
loads none.

Messages are short and never carry the prompt: a provider's error code is
cut to a few dozen characters, its message is never read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from oncely.errors import OncelyError, PermanentError, TransientError
from oncely.llm.base import Completion, ResponseSchema
from oncely.retry import retry_after_from_headers, retryable_status

# Enough of a provider's error code to tell errors apart, never a whole message.
_CODE_CHARS = 60


def response_format(schema: ResponseSchema) -> dict[str, Any]:
    """Structured output: ``{"type": "json_schema", ...}``."""
    return {
        "type": "json_schema",
        "json_schema": {"name": schema.name, "schema": dict(schema.schema)},
    }


def status_error(status: int, code: object, headers: Mapping[str, str]) -> OncelyError:
    """408, 409, 429 and 5xx: a ``TransientError`` with the status and the
    wait from ``retry-after-ms`` / ``Retry-After``; any other status a
    ``PermanentError``. ``code``: the body's ``error.code``, when a string."""
    message = f"model answered {status}"
    if isinstance(code, str) and code:
        message += f" ({code[:_CODE_CHARS]})"
    if retryable_status(status):
        return TransientError(
            message, status=status, retry_after_s=retry_after_from_headers(headers)
        )
    return PermanentError(message, status=status)


def no_content(why: str) -> PermanentError:
    """A 200 without an answer: a retry will not change it."""
    return PermanentError(f"model returned no content ({why})")


def read_answer(data: object) -> Completion:
    """A 200's JSON document: the first choice's content and the usage.
    Anything else than an answer is ``no_content`` (with the finish reason,
    "refused", or what was missing)."""
    if not isinstance(data, dict):
        raise no_content("not a completion")
    choices = data.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else None
    if not isinstance(choice, dict):
        raise no_content("no choices")
    message = choice.get("message")
    message = message if isinstance(message, dict) else {}
    content = message.get("content")
    if not isinstance(content, str) or not content:
        raise no_content("refused" if message.get("refusal") else str(choice.get("finish_reason")))
    usage = data.get("usage")
    usage = usage if isinstance(usage, dict) else {}
    return Completion(
        content,
        prompt_tokens=_count(usage.get("prompt_tokens")),
        completion_tokens=_count(usage.get("completion_tokens")),
    )


def error_code(data: object) -> object:
    """``error.code`` of an error answer's JSON document, if it has one."""
    error = data.get("error") if isinstance(data, dict) else None
    return error.get("code") if isinstance(error, dict) else None


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
