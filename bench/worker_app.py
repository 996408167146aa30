"""The workflow ``bench.worker`` runs in ``oncely worker``: the built-in
summaries, unstreamed.

The floors make one plain model call per job and publish nothing while it
answers. The built-in workflow types its summary out on the job's live
stream (``Workflow(stream=True)``: a streamed call, its pieces parsed and
sent to Redis), work the floors do not do, so the benchmark runs the same
workflow without it; ``--streamed`` runs the built-in one as it is
(docs/performance.md says what streaming costs).
"""

from __future__ import annotations

import dataclasses

from oncely import App
from oncely.builtin.summaries import summaries

app = App([dataclasses.replace(summaries, stream=False)])
