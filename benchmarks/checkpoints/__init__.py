"""Benchmarks of checkpoints: each module runs as `python -m benchmarks.checkpoints.<name>` from the checkout root."""
