"""Workflows written only against oncely's public API (docs/tutorial.md)."""
