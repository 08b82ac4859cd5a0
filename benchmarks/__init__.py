"""prorl benchmarks: `python -m benchmarks <name> [--quick]` (run from the repository root).

`harness.py` runs each provider in a fresh worker and appends rows to `results/<name>.csv`;
`plot.py` draws them, `report/readme.py` tabulates them in docs/results.md; `gpu/`: the GPU run.
"""
