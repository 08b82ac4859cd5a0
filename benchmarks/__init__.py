"""prorl benchmarks: `python -m benchmarks <name> [--quick]` (run from the repository root).

`harness.py` runs each provider of a benchmark in a fresh worker process and appends long-format
rows to `benchmarks/results/<name>.csv`; each benchmark module defines its providers; `plot.py`
draws the CSVs, `report/readme.py` writes the README's tables from them; `gpu/` holds the scripts
for a GPU machine.
"""
