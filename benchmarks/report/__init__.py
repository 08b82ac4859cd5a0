"""The results tables' generator: `python -m benchmarks readme` (report/readme.py)."""
