"""Intake: the idempotent HTTP API."""
