"""Benchmark scripts, grouped by what they measure; each prints JSON and writes benchmarks/results/<name>.json.

Run from the checkout root: `python -m benchmarks.<group>.<name>`; `python -m benchmarks.run_all` regenerates every CPU
results file. benchmarks/common.py holds the helpers they share (timing, the stack, where results go)."""
