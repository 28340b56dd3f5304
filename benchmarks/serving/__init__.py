"""Benchmarks of serving: each module runs as `python -m benchmarks.serving.<name>` from the checkout root."""
