"""Benchmarks of gpu: each module runs as `python -m benchmarks.gpu.<name>` from the checkout root."""
