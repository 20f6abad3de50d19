"""Benchmarks: each prints its figures side by side in one run (`python tools/bench/NAME.py --help`)."""
