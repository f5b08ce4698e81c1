"""Benchmarks: each script measures one or two ratios side by side and prints one JSON line each.

Run them all with ``make bench`` (``python -m bench.run_all``); results and
how to read them are in docs/benchmarks.md.
"""
