"""Dispatch: the Redis stream, its worker and its dead letters."""
