"""Benchmarks of kernels: each module runs as `python -m benchmarks.kernels.<name>` from the checkout root."""
