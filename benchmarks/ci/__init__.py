"""Benchmarks of ci: each module runs as `python -m benchmarks.ci.<name>` from the checkout root."""
