"""Benchmark programs: communication, overlap, memory bandwidth, engines, topology scale (`python -m
benchmarks.NAME` from the repository root). The report is relaympi.report."""
