"""Benchmarks of training: each module runs as `python -m benchmarks.training.<name>` from the checkout root."""
