"""prorl benchmarks: `python -m benchmarks <name> [--quick]` (run from the repository root).

`harness.py` times providers x modes x shapes in fresh worker processes and appends long-format rows to
`benchmarks/results/<name>.csv`; each benchmark script defines its providers; `plot.py` draws the CSV.
"""
