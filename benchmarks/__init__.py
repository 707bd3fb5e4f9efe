"""Benchmarks: ``python -m benchmarks.<name>`` prints figures next to a plain-copy anchor."""
