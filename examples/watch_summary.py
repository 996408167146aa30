"""Watch a summary type itself out (docs/streaming.md).

With ``make dev`` running in another terminal (the key is read from
``.oncely/dev-api-key``, or ``ONCELY_API_KEY``; the API from ``ONCELY_URL``)::

    python examples/watch_summary.py "Oncely streams tokens. A retry says reset. The end is GET."

It submits the text to the built-in ``/v1/summaries`` workflow, follows the
job's live stream and prints each piece of the answer as the model writes
it. A ``reset`` (the model call was cut off and is starting over, or a
worker died mid-answer) clears what was printed for that step: the text
left on screen is always the stored summary. Add ``[[fake:cut*1]]`` to the
text to watch the fake model cut the first answer off.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import TextIO

from oncely.client import AsyncClient, StreamEvent

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


if __name__ == "__main__":
    asyncio.run(
        main(
            " ".join(sys.argv[1:]) or "Oncely streams tokens. A retry says reset. The end is GET.",
            os.environ.get("ONCELY_URL", "http://127.0.0.1:8000"),
            os.environ.get("ONCELY_API_KEY") or Path(".oncely/dev-api-key").read_text().strip(),
        )
    )
