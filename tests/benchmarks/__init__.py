"""Runnable benchmarks (``python -m tests.benchmarks.<name>``); not collected by pytest."""
