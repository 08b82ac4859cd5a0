"""benchmarks/packing.py at a small size: it plans the update's passes and reports them."""

from benchmarks import packing


def test_packing_benchmark_reports_the_plan(capsys):
    assert packing.main(["--groups", "2", "--reps", "1"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("packing: ") and " passes, " in line and "s per step's plan" in line
    tokens = int(line.split()[1])
    batch = packing.preset_batch(0, 2)
    assert tokens == sum(len(r) for g in batch.groups for r in g.responses)
    longest = int(line.rsplit(" ", 1)[1])
    # the longest key run: one response of at most 8192 tokens reading its prompt of at most 1024
    assert longest == max(len(g.prompt_ids) + max(map(len, g.responses)) for g in batch.groups)
