"""Benchmarks reachable as `longctx bench <name>`; the scripts in benchmarks/ call the same code."""
