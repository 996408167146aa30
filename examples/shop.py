"""The shop every support example serves: its orders, its policy, what a
customer sends and gets back, what a refund takes and answers. One home,
so the oncely agent and the three framework agents
(``examples/support_agent.py``, ``pydantic_ai_support.py``,
``openai_agents_support.py``, ``langgraph_support.py``) differ only in how
the agent is written."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, EmailStr, Field

import oncely

INSTRUCTIONS = (
    "You are the support desk of an online shop. Look the customer's order up "
    "before you answer. Refund a damaged, missing or wrong item in full; refund "
    "nothing for an order older than 30 days. Then answer the customer in two "
    "or three friendly sentences."
)
# Refunds above this wait for a person's approval.
APPROVAL_ABOVE_CENTS = 5_000

# The shop's orders, as a read-only lookup would find them.
ORDERS: dict[str, dict[str, Any]] = {
    "A-1001": {"item": "teapot", "total_cents": 4_200, "days_ago": 3, "status": "delivered"},
    "A-1002": {"item": "armchair", "total_cents": 38_900, "days_ago": 5, "status": "delivered"},
    "A-0999": {"item": "kettle", "total_cents": 2_900, "days_ago": 45, "status": "delivered"},
}


class SupportRequest(BaseModel):
    customer: EmailStr = Field(examples=["ada@example.com"])
    message: str = Field(min_length=1, max_length=5_000, examples=["My teapot A-1001 broke."])


class SupportReply(BaseModel):
    reply: str
    refunded_cents: int
    tool_calls: list[str]


class RefundArgs(BaseModel):
    """What the model fills in to refund."""

    order_id: str = Field(min_length=1, max_length=64)
    cents: int = Field(gt=0, le=10_000_000)
    reason: str = Field(min_length=1, max_length=500)


class Refunded(BaseModel):
    """What the refund service answers (the fake provider's shape: its
    ``data`` is what it was sent)."""

    ok: bool
    id: str


def find_order(order_id: str) -> dict[str, Any] | None:
    """The order ``order_id`` names (ids are upper case), or None."""
    order = ORDERS.get(order_id.strip().upper())
    return None if order is None else {"order_id": order_id, **order}


def render_reply(payload: Any) -> oncely.Email:
    return oncely.Email(to=payload["customer"], subject="About your order", text=payload["reply"])
