"""Benchmarks for dedupworker; run them from the repository root (see README.md)."""
