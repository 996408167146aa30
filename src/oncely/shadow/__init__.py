"""Shadow runs and eval gates (docs/shadow.md).

A sampled job, once its primary result committed, is run again by each
shadow variant on the same input, through a stream of its own. The shadow's
result, usage, errors and score against the primary are stored in
``shadow_results``; nothing it emits is ever written to the outbox, and the
job's status never changes. ``oncely eval report`` and ``oncely eval gate``
read those rows.

- ``config``: ``ONCELY_SHADOW`` / ``ONCELY_PRIMARY`` parsed; sampling by job id.
- ``evaluate``: scoring a shadow result against the primary's.
- ``store``: the ``shadow_results`` table (its only owner).
- ``run``: enqueueing shadow work after the commit, and the shadow handler.
- ``report``: agreement, errors and cost deltas; the gate's verdict.
"""
