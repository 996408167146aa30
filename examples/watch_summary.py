"""Watch a summary type itself out (docs/streaming.md).

With ``make dev`` (or ``oncely dev``) running in another terminal::

    python examples/watch_summary.py "Oncely streams tokens. A retry says reset. The end is GET."

The API and its key are the dev stack's, found as every ``oncely`` command
finds it (its ``dev.json`` and ``dev-api-key`` in ``.oncely``, or in
``ONCELY_DATA_DIR``); ``ONCELY_URL`` and ``ONCELY_API_KEY`` name another.

It submits the text to the built-in ``/v1/summaries`` workflow, follows the
job's live stream and prints each piece of the answer as the model writes
it. A ``reset`` (the model call was cut off and is starting over, or a
worker died mid-answer) clears what was printed for that step: the text
left on screen is always the stored summary. Add ``[[fake:cut*1]]`` to the
text to watch the fake model cut the first answer off.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import TextIO

from oncely.cli import dev_address
from oncely.client import AsyncClient, OncelyClientError, StreamEvent

ROUTE = "/v1/summaries"


class Typist:
    """The answer as a reader sees it: tokens appended, a reset erasing
    them (on a terminal, by rewriting the line)."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.text = ""

    def show(self, event: StreamEvent) -> None:
        if event.type == "token":
            self.text += event.data["text"]
            self.out.write(event.data["text"])
        elif event.type == "reset":
            self.text = ""
            self.out.write("\n[the model starts over]\n")
        elif event.type in ("snapshot", "status"):
            self.out.write(f"[{event.data['status']}]\n")
        self.out.flush()


async def watch(client: AsyncClient, job_id: str, out: TextIO = sys.stdout) -> str:
    """Print the job's summary as it types; answer the text the stream left
    on screen (which is the stored summary)."""
    typist = Typist(out)
    async for event in client.stream(ROUTE, job_id):
        typist.show(event)
    out.write("\n")
    return typist.text


async def main(text: str, base: str, key: str) -> None:
    async with AsyncClient(base, key) as client:
        accepted = await client.submit(ROUTE, {"text": text, "notify": "you@example.com"})
        await watch(client, str(accepted.job_id))


def where() -> tuple[str, str]:
    """The API and its key: ``ONCELY_URL`` / ``ONCELY_API_KEY``, else the
    dev stack running from ``ONCELY_DATA_DIR`` (default ``.oncely``)."""
    data_dir = Path(os.environ.get("ONCELY_DATA_DIR", ".oncely"))
    stack = dev_address.running(data_dir)
    base = os.environ.get("ONCELY_URL") or (stack.api_url if stack else None)
    key_file = data_dir / "dev-api-key"
    key = os.environ.get("ONCELY_API_KEY") or (
        key_file.read_text().strip() if key_file.exists() else None
    )
    if base is None or key is None:
        sys.exit(
            f"no oncely dev running from {data_dir}/: start one (make dev), set"
            " ONCELY_DATA_DIR to its data dir, or set ONCELY_URL and ONCELY_API_KEY"
        )
    return base, key


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Watch a summary type itself out.")
    parser.add_argument("text", nargs="*", help="what to summarise")
    words = parser.parse_args().text
    base, key = where()
    try:
        asyncio.run(
            main(" ".join(words) or "Oncely streams tokens. A retry says reset.", base, key)
        )
    except OncelyClientError as exc:
        sys.exit(f"{base}: {exc}")
