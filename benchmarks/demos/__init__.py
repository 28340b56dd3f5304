"""Benchmarks of demos: each module runs as `python -m benchmarks.demos.<name>` from the checkout root."""
