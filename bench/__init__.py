"""oncely's benchmarks: a small harness (``bench.harness``) and one module per
benchmark. ``python -m bench`` runs them all and writes BENCHMARKS.md; see
bench/README.md."""
