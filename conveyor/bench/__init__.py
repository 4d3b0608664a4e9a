"""Benchmarks: workloads, timing, results as JSON, tables."""
