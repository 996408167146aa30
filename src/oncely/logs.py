"""Logging, configured once per process: structlog's events and every
standard-library record (uvicorn, asyncio, psycopg, …) through one renderer,
console in dev and JSON otherwise, with the current trace's ids when
OpenTelemetry is installed and a span is active."""

from __future__ import annotations

import logging
import os
import re
import sys
import traceback
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import structlog

from oncely import tracing


def add_trace_ids(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """``trace_id``/``span_id`` of the active span, so logs and traces join."""
    ids = tracing.current_ids()
    if ids is not None:
        event.setdefault("trace_id", ids[0])
        event.setdefault("span_id", ids[1])
    return event


def frames(exc: BaseException, limit: int = 6) -> list[str]:
    """Where ``exc`` was raised: its innermost frames as ``file:line in
    function`` (paths relative to the working directory when inside it).
    For logging a failure in a workflow's own code without its message,
    which may hold the request's data."""
    here = Path.cwd()
    found = []
    for frame in traceback.extract_tb(exc.__traceback__)[-limit:]:
        path = Path(frame.filename)
        shown = path.relative_to(here) if path.is_relative_to(here) else path
        found.append(f"{shown}:{frame.lineno} in {frame.name}")
    return found


def colours(stream: Any) -> bool:
    """Whether to colour what goes to ``stream``: only a terminal, and not
    when ``NO_COLOR`` is set (no escape codes in a file or a pipe)."""
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) and not os.environ.get("NO_COLOR")


def configure_logging(fmt: str = "json", level: str = "INFO") -> None:
    renderer: structlog.types.Processor = (
        structlog.dev.ConsoleRenderer(colors=colours(sys.stderr))
        if fmt == "console"
        else structlog.processors.JSONRenderer()
    )
    threshold = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    shared: list[structlog.types.Processor] = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        add_trace_ids,
    ]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            *shared,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(threshold),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                renderer,
            ],
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
        )
    )
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(threshold)
    # psycopg-pool logs every failed connection attempt; oncely.sql.connect
    # counts and says each refusal itself, readably and at most every few
    # seconds.
    logging.getLogger("psycopg.pool").setLevel(logging.CRITICAL)
    hide_url_secrets()


# A secret a URL may carry: a stream token (``…/stream?token=``).
_URL_SECRET = re.compile(r"([?&]token=)[^&\s\"]*")


class HideUrlSecrets(logging.Filter):
    """A server's access log writes each request's path with its query: the
    value of a ``token`` parameter (a stream token, which opens a job's
    stream) becomes ``[redacted]`` in every record's arguments."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(_hidden(a) for a in record.args)
        record.msg = _hidden(record.msg)
        return True


def _hidden(value: Any) -> Any:
    return _URL_SECRET.sub(r"\1[redacted]", value) if isinstance(value, str) else value


def hide_url_secrets() -> None:
    """Keep stream tokens out of uvicorn's access log, whoever configured
    the logging (``uvicorn --factory`` configures its own, access log on)."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, HideUrlSecrets) for f in access.filters):
        access.addFilter(HideUrlSecrets())
