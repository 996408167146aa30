"""The customers' cases every support example's tests replay with
``oncely.testing``: what the customer sends, the model's scripted turns, the
refund service's answer. One home, so the four agents (oncely's and three
frameworks') are held to the same conversations."""

from __future__ import annotations

from typing import Any

from oncely.testing import ToolCalls

TEAPOT = {"customer": "ada@example.com", "message": "My teapot, order A-1001, arrived broken."}
CHAIR = {"customer": "bo@example.com", "message": "The armchair A-1002 is the wrong colour."}
# What the refund service answers (the fake provider's shape).
REFUNDED = {"ok": True, "id": "evt_1", "data": {}}

# A refund small enough to make at once: look up, refund, reply.
TEAPOT_TURNS: list[Any] = [
    ToolCalls(("lookup_order", {"order_id": "A-1001"})),
    ToolCalls(("refund", {"order_id": "A-1001", "cents": 4200, "reason": "broken"})),
    "Sorry about the teapot: we refunded 42.00.",
]
# One large enough to wait for a person first.
CHAIR_TURNS: list[Any] = [
    ToolCalls(("lookup_order", {"order_id": "A-1002"})),
    ToolCalls(("refund", {"order_id": "A-1002", "cents": 38900, "reason": "wrong item"})),
    "A colleague will look at your refund.",
]
