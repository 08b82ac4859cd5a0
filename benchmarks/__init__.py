"""prorl benchmarks: `python -m benchmarks <name> [--quick]` (run from the repository root).

`harness.py` runs each provider in a fresh worker and appends rows to `results/<name>.csv`;
`plot.py` draws them, `report/readme.py` writes the README's tables; `gpu/`: the GPU machine's run.
"""
