"""Helpers shared by the tests and benchmarks: tiny checkpoints, loading, (later) multi-process harness."""
