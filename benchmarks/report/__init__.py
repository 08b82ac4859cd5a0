"""The README generator: `python -m benchmarks readme` (report/readme.py)."""
