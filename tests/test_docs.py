"""The README stays a short front page whose links, data row, keys and reliability figures work:
under 300 lines; every relative link of README.md, docs/*.md and kernels/ADAPTERS.md names a file
that exists and, after '#', a heading of that file (GitHub's anchors); the data row it shows is read
by prorl's data reader and scored by the verifier its `data_source` names; the prorl keys and values
of its TRL table are accepted by the configuration; tests/helpers/tally.py finds each kind of
reliability figure in it."""

import json
import re
from pathlib import Path

import pytest
import tally

import prorl.rewards as rewards
from prorl import data

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "kernels" / "ADAPTERS.md"]
FENCE = re.compile(r"^```.*?^```[^\n]*$", re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """`text` without its fenced code blocks (a `#` there is a comment, a `[x](y)` is code)."""
    return FENCE.sub("", text)


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a markdown file's headings: lower case, punctuation other than '-' and
    '_' dropped, spaces to '-', a repeated anchor numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose(text).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(doc: Path) -> list[str]:
    """Every relative link of `doc` whose file or anchor does not exist."""
    bad, name = [], doc.relative_to(ROOT) if doc.is_relative_to(ROOT) else doc.name
    for target in LINK.findall(prose(doc.read_text())):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            bad.append(f"{name}: {target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            bad.append(f"{name}: {target} (no such heading)")
    return bad


def test_readme_is_a_short_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) < 300, f"README.md has {len(lines)} lines: move detail to docs/"
    # "how do I train my model on my parquet" is linked from the first screen
    assert "](#your-own-model-and-data)" in "\n".join(lines[:25])


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_relative_links_resolve(doc):
    assert broken_links(doc) == []


def test_the_link_check_finds_a_broken_file_and_anchor(tmp_path):
    (tmp_path / "a.md").write_text(
        "# Title: one\n\n## `x` and y (z)\n\n```bash\n# not a heading\n```\n"
    )
    doc = tmp_path / "b.md"
    doc.write_text(
        "[ok](a.md#title-one) [ok](a.md#x-and-y-z) [bad](a.md#not-a-heading) [gone](c.md)\n"
        "[web](https://example.com/x#y)\n```\n[code](nowhere.md)\n```\n"
    )
    assert [b.split(": ", 1)[1] for b in broken_links(doc)] == [
        "a.md#not-a-heading (no such heading)",
        "c.md (no such file)",
    ]


def test_the_readme_data_row_is_read_and_scored(tmp_path):
    text = README.read_text()
    section = text[text.index("## Your own model and data") :]
    row = json.loads(re.search(r"```json\n(.*?)```", section, re.S).group(1))
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(row) + "\n")
    (ex,) = data.load_file(str(path))
    # the question: 48 clips in April, half as many (24) in May: 72 in all
    assert rewards.score(ex.data_source, "48 + 24 = 72.\n#### 72", ex.ground_truth, ex.extra) == 1.0
    assert rewards.score(ex.data_source, "48 + 48 = 96.\n#### 96", ex.ground_truth, ex.extra) == 0.0


def test_tally_finds_each_reliability_figure_in_the_readme():
    found = tally.readme_figures(README.read_text())
    assert {kind: len(pairs) for kind, pairs in found.items()} == dict.fromkeys(tally.KINDS, 1)


def trl_table_settings() -> list[str]:
    """The prorl column of the README's `GRPOConfig` table as `key` or `key=value` strings; a bare
    word after `key=value` in the same cell (`grpo` / `dr-grpo`) is another value of that key."""
    text = README.read_text()
    table = text[
        text.index("| `GRPOConfig` | prorl |") : text.index("\n\n", text.index("| `GRPOConfig`"))
    ]
    out = []
    for row in table.splitlines()[2:]:
        key = None
        for token in re.findall(r"`([^`]+)`", row.split("|")[2]):
            if "=" in token or "." in token:
                key = token.split("=", 1)[0]
                out.append(token)
            elif key and re.fullmatch(r"[\w-]+", token):
                out.append(f"{key}={token}")
    return out


def test_the_trl_table_names_real_keys_and_values():
    from prorl.config import fields, load_config

    settings = trl_table_settings()
    assert "algorithm.advantage=dr-grpo" in settings and "algorithm.reset.interval=N" in settings
    keys = {key for key, _ in fields()}
    for setting in settings:
        key, _, value = setting.partition("=")
        assert key in keys, f"README's TRL table: no config key {key}"
        if value and value not in ("N", "file.py:compute_score"):  # placeholders
            load_config(None, ["model.path=/models/mine", setting])  # a refused value raises
