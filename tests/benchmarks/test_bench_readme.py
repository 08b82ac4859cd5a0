"""`python -m benchmarks readme` on synthetic CSVs, and the harness's `command` column."""

from __future__ import annotations

import csv
import sys

from benchmarks import harness
from benchmarks.report import readme

OLD = harness.COLUMNS_BEFORE_COMMAND


def _row(
    provider,
    metric,
    p50,
    *,
    stamp,
    mode="full",
    shape="N=8",
    unit="ms",
    spread=0.1,
    command="",
    **kw,
):
    return dict(
        name=kw.get("name", "ppo_loss"),
        provider=provider,
        mode=mode,
        shape=shape,
        metric=metric,
        unit=unit,
        p50=p50,
        p20=p50 - spread if spread else p50,
        p80=p50 + spread if spread else p50,
        device="Test CPU",
        versions="torch=2 threads=2 OMP_NUM_THREADS=2",
        git_rev="abc123",
        timestamp=stamp,
        command=command,
    )


def _write(path, rows, columns=harness.COLUMNS):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def _setup(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    t1, t2 = "2026-01-01T10:00:00+00:00", "2026-01-02T11:30:00+00:00"
    cmd = "python -m benchmarks ppo_loss --reps 20"
    _write(
        results / "ppo_loss.csv",
        [
            # an older run of prorl: replaced by the newer one
            _row("prorl", "time", 9.0, stamp=t1, command="old"),
            _row("prorl", "time", 1.0, stamp=t2, command=cmd),
            _row("prorl", "peak_extra_memory", 2.5, stamp=t2, unit="MB", spread=0, command=cmd),
            _row("naive", "time", 4.0, stamp=t2, command=cmd),
            _row("naive", "peak_extra_memory", 10.0, stamp=t2, unit="MB", spread=0, command=cmd),
            # a metric the view does not show
            _row("naive", "gflops", 3.0, stamp=t2, unit="GFLOPS", command=cmd),
        ],
    )
    # a CSV from before the `command` column; rl_step: one row per (shape, provider), phases as
    # columns
    rl = dict(name="rl_step", stamp=t1, shape="tiny P=2")
    _write(
        results / "rl_step.csv",
        [
            _row("prorl", "time", 200.0, mode="step", **rl),
            _row("prorl", "time", 50.0, mode="gen", **rl),
            _row("prorl", "time", 120.0, mode="update", **rl),
            _row("prorl", "tokens_per_s", 900.0, mode="step", unit="tok/s", spread=0, **rl),
            _row("trl", "time", 300.0, mode="step", **rl),
            _row("trl", "time", 100.0, mode="gen", **rl),
        ],
        columns=OLD,
    )
    (results / "ppo_loss_time.png").write_bytes(b"png")
    (results / "ppo_loss_old.png").write_bytes(b"png")  # no known source: linked without a command
    (results / "unrelated.png").write_bytes(b"png")
    doc = tmp_path / "docs" / "results.md"  # beside the results folder's parent, as in the repo
    doc.parent.mkdir()
    doc.write_text(
        "# x\n\n## Performance\n\nhand-written\n\n"
        "<!-- perf:begin -->\nstale\n<!-- perf:end -->\n\n## Layout\n"
    )
    return results, doc


EXPECTED_PPO = """\
#### `ppo_loss` on Test CPU

Benchmark of `prorl.kernels.ppo_loss` against the same loss in eager torch, as trainers write it.

Shape: N=8; mode `full`.

| provider | time (ms) | speed-up vs naive | peak extra memory (MB) |
|---|---|---|---|
| prorl | 1.00 (0.900–1.10) | 4.00× | 2.50 |
| naive | 4.00 (3.90–4.10) | 1.00× | 10.0 |

time: p50 (p20–p80) of the timed repetitions; other columns p50. speed-up vs naive: \
naive's ÷ the row's \
time p50, both from the same run.

Run:

- `python -m benchmarks ppo_loss --reps 20` — Test CPU, threads=2, 2026-01-02 11:30, rev `abc123`

Plots: [ppo_loss_old.png](../results/ppo_loss_old.png), \
[ppo_loss_time.png](../results/ppo_loss_time.png) \
(`python -m benchmarks plot ppo_loss`).
"""

EXPECTED_RL = """\
| provider | step time (ms) | speed-up vs trl | gen (ms) | update (ms) | throughput (tok/s) |
|---|---|---|---|---|---|
| prorl | 200 (200–200) | 1.50× | 50.0 | 120 | 900 |
| trl | 300 (300–300) | 1.00× | 100 | – | – |
"""


def test_readme_block_from_synthetic_csvs(tmp_path, capsys):
    results, doc = _setup(tmp_path)
    args = ["--doc", str(doc), "--results", str(results)]
    assert readme.main(args + ["--check"]) == 1  # "stale" is not what the CSVs give
    assert "stale" in doc.read_text()  # --check writes nothing

    assert readme.main(args) == 0
    text = doc.read_text()
    assert text.startswith("# x\n\n## Performance\n\nhand-written\n\n<!-- perf:begin -->\n")
    assert text.endswith("<!-- perf:end -->\n\n## Layout\n")
    block = text[text.index(readme.BEGIN) : text.index(readme.END)]
    assert "stale" not in block
    assert EXPECTED_PPO in block
    assert EXPECTED_RL in block
    # rl_step comes first (VIEWS order); its rows predate the command column
    assert block.index("`rl_step`") < block.index("`ppo_loss`")
    assert "command not recorded" in block and "2026-01-01 10:00" in block
    assert "gflops" not in block and "unrelated.png" not in block and "9.00" not in block

    assert readme.main(args + ["--check"]) == 0
    # a newer run in a CSV makes the block stale; --check says so and leaves the document alone
    with open(results / "ppo_loss.csv", "a", newline="") as f:
        csv.DictWriter(f, fieldnames=harness.COLUMNS).writerow(
            _row(
                "prorl",
                "time",
                0.5,
                stamp="2026-01-03T00:00:00+00:00",
                command="python -m benchmarks ppo_loss",
            )
        )
    assert readme.main(args + ["--check"]) == 1
    assert doc.read_text() == text
    assert "stale" in capsys.readouterr().err

    assert readme.main(args) == 0
    assert "0.500 (0.400–0.600)" in doc.read_text()
    assert readme.main(args + ["--check"]) == 0


def test_readme_without_markers_fails(tmp_path):
    results, doc = _setup(tmp_path)
    doc.write_text("# no block\n")
    assert readme.main(["--doc", str(doc), "--results", str(results), "--check"]) == 1
    assert readme.main(["--doc", str(doc), "--results", str(results)]) == 1
    assert doc.read_text() == "# no block\n"


def test_default_target_is_the_results_doc():
    """Without --doc, `python -m benchmarks readme` writes docs/results.md's one block."""
    assert readme.DOC == harness.REPO_ROOT / "docs" / "results.md"
    text = readme.DOC.read_text()
    assert text.count(readme.BEGIN) == 1 and text.count(readme.END) == 1
    assert text.index(readme.BEGIN) < text.index(readme.END)
    assert readme.BEGIN not in (harness.REPO_ROOT / "README.md").read_text()


def test_command_line():
    root = harness.REPO_ROOT
    assert (
        harness.command_line(
            [str(root / "benchmarks" / "__main__.py"), "rl_step", "--models", "tiny random"]
        )
        == "python -m benchmarks rl_step --models 'tiny random'"
    )
    assert harness.command_line([str(root / "benchmarks" / "rl_step.py"), "--quick"]) == (
        "python -m benchmarks.rl_step --quick"
    )
    assert harness.command_line(["/usr/bin/pytest", "-q"]) == "pytest -q"
    assert harness.command_line([]) == ""


def test_append_csv_records_command_and_upgrades_old_csv(tmp_path, monkeypatch):
    monkeypatch.setattr(
        sys, "argv", [str(harness.REPO_ROOT / "benchmarks" / "__main__.py"), "x", "--quick"]
    )
    old = tmp_path / "old.csv"
    _write(old, [_row("a", "time", 1.0, stamp="t0")], columns=OLD)
    harness.append_csv(
        old, [{k: v for k, v in _row("b", "time", 2.0, stamp="t1").items() if k != "command"}]
    )
    with open(old, newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == harness.COLUMNS
        rows = list(reader)
    assert [(r["provider"], r["command"]) for r in rows] == [
        ("a", ""),
        ("b", "python -m benchmarks x --quick"),
    ]
    assert [r["p50"] for r in rows] == ["1.0", "2"]
