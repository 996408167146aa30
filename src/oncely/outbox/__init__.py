"""The outbox: rows written with a job's result, relayed to a provider once."""

from oncely.outbox.relay import Relay, RelayConfig
from oncely.outbox.store import OutboxCounts, OutboxRow, OutboxStore

__all__ = ["OutboxCounts", "OutboxRow", "OutboxStore", "Relay", "RelayConfig"]
