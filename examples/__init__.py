"""Workflows written only against oncely's public API (README: "Write your own workflow")."""
