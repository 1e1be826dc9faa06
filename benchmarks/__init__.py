"""Benchmark programs and the report (`python -m benchmarks.report`)."""
