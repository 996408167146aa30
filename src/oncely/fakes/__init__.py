"""Fake providers: real HTTP servers behind the real adapters, for `oncely dev`,
tests and benchmarks."""
