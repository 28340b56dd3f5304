"""Benchmarks of planner: each module runs as `python -m benchmarks.planner.<name>` from the checkout root."""
