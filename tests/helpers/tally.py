"""The reliability report: what the README's "tried / held" figures are made of, written by tests.

A test marked `@pytest.mark.tally(kind)` is one case of `kind` (`attacks`, `faults`, `bad_inputs`);
each collected item (each parametrization) is one case. At the end of a session that ran all of them
(the whole suite, or `pytest -m tally`), `tests/reliability_report.json` holds, per kind, the cases
tried (run, not skipped), held (passed), skipped and failed (their test ids). A session that ran
only some of them writes `tests/reliability_report.partial.json` instead, so a developer's partial
run does not overwrite the figures of a full one.

    python tests/helpers/tally.py          # the README's figures from the report
    python tests/helpers/tally.py --write  # ... and written into README.md
    python tests/helpers/tally.py --check  # exit 1 when README.md's figures differ from the report

The README's figures are found by their wording: "<what> tried / <verb> **T / H**" (and, for faults,
also "T tried, H survived"); `PHRASES` lists the patterns of each kind.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

KINDS = ("attacks", "faults", "bad_inputs")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# PRORL_RELIABILITY_REPORT: another path (tests/test_tally.py runs a session of its own)
REPORT = os.environ.get("PRORL_RELIABILITY_REPORT") or os.path.join(
    ROOT, "tests", "reliability_report.json"
)
PARTIAL = REPORT.removesuffix(".json") + ".partial.json"

# kind -> regexes over README.md, each with the groups (tried, held)
PHRASES = {
    "attacks": [r"attacks tried / contained \*\*(\d+) / (\d+)\*\*"],
    "faults": [r"faults tried / survived \*\*(\d+) / (\d+)\*\*", r"(\d+) tried, (\d+) survived"],
    "bad_inputs": [r"bad inputs tried / named \*\*(\d+) / (\d+)\*\*"],
}

# this session's cases: nodeid -> kind, and nodeid -> "passed" | "failed" | "skipped"
_kinds: dict[str, str] = {}
_outcomes: dict[str, str] = {}


def kind_of(item) -> str | None:
    """The tally kind of a collected test item, or None; a bad marker is a usage error."""
    import pytest

    marker = item.get_closest_marker("tally")
    if marker is None:
        return None
    if len(marker.args) != 1 or marker.args[0] not in KINDS:
        raise pytest.UsageError(
            f"{item.nodeid}: use @pytest.mark.tally(kind), kind one of {', '.join(KINDS)}"
        )
    return marker.args[0]


# -- pytest hooks (tests/conftest.py imports them; `-p tally` loads them as a plugin) --------------


def pytest_collection_finish(session) -> None:
    """The marked cases among the items that will run (after -k / -m deselection)."""
    _kinds.clear()
    _outcomes.clear()
    _kinds.update(
        {item.nodeid: kind for item in session.items if (kind := kind_of(item)) is not None}
    )


def pytest_runtest_logreport(report) -> None:
    """A case failed if any phase failed; skipped if set-up or the call skipped; else passed."""
    if report.nodeid not in _kinds:
        return
    previous = _outcomes.get(report.nodeid)
    if report.failed:
        _outcomes[report.nodeid] = "failed"
    elif report.skipped and previous != "failed":
        _outcomes[report.nodeid] = "skipped"
    elif report.when == "call" and report.passed and previous is None:
        _outcomes[report.nodeid] = "passed"


def _complete(session) -> bool:
    """Whether every tally case of the suite was selected and the session was not cut short: no
    paths other than the configured test paths, no -k, no -m other than `tally`, no --deselect or
    --lf, no -x stop."""
    config = session.config
    opt, root, here = config.option, str(config.rootpath), str(config.invocation_params.dir)
    whole = {os.path.normpath(os.path.join(root, p)) for p in config.getini("testpaths")} | {root}
    args = {os.path.normpath(os.path.join(here, a.split("::")[0])) for a in config.args}
    return (
        args <= whole
        and not getattr(opt, "keyword", "")
        and getattr(opt, "markexpr", "") in ("", "tally")
        and not getattr(opt, "deselect", None)
        and not getattr(opt, "lf", False)  # --last-failed runs only some
        and not session.shouldstop
        and not session.shouldfail
    )


def summarise(kinds: dict[str, str], outcomes: dict[str, str]) -> dict:
    """{kind: {tried, held, skipped, failed: [ids]}} from each case's kind and outcome."""
    out = {}
    for kind in KINDS:
        ids = sorted(n for n, k in kinds.items() if k == kind)
        got = {n: outcomes.get(n, "not run") for n in ids}
        failed = [n for n, o in got.items() if o in ("failed", "not run")]
        out[kind] = {
            "tried": sum(o in ("passed", "failed") for o in got.values()),
            "held": sum(o == "passed" for o in got.values()),
            "skipped": [n for n, o in got.items() if o == "skipped"],
            "failed": failed,
        }
    return out


def pytest_sessionfinish(session) -> None:
    if not _kinds or hasattr(session.config, "workerinput") or session.config.option.collectonly:
        return  # nothing marked was selected; an xdist worker; nothing ran
    complete = _complete(session)
    report = {
        "complete": complete,
        "args": list(session.config.invocation_params.args),
        "kinds": summarise(_kinds, _outcomes),
    }
    with open(REPORT if complete else PARTIAL, "w") as f:
        json.dump(report, f, indent=1, sort_keys=True)
        f.write("\n")


# -- figures in the README -------------------------------------------------------------------------


def read_report(path: str = REPORT) -> dict:
    """The report of a complete session; SystemExit with the reason otherwise."""
    if not os.path.isfile(path):
        raise SystemExit(f"{path}: no reliability report: run the tests first (python -m pytest)")
    with open(path) as f:
        report = json.load(f)
    if not report.get("complete"):
        raise SystemExit(
            f"{path}: written by a partial session ({report.get('args')}): run the whole suite"
        )
    return report


def readme_figures(text: str) -> dict[str, list[tuple[int, int]]]:
    """kind -> every (tried, held) pair the README states for it."""
    return {
        kind: [(int(t), int(h)) for pattern in patterns for t, h in re.findall(pattern, text)]
        for kind, patterns in PHRASES.items()
    }


def differences(text: str, report: dict) -> list[str]:
    """One line per README figure that is absent or differs from the report."""
    problems = []
    for kind, stated in readme_figures(text).items():
        want = (report["kinds"][kind]["tried"], report["kinds"][kind]["held"])
        if not stated:
            problems.append(f"{kind}: no figure found in README.md (patterns {PHRASES[kind]})")
        for pair in stated:
            if pair != want:
                problems.append(
                    f"{kind}: README.md says {pair[0]} / "
                    f"{pair[1]}, the report {want[0]} / {want[1]}"
                )
    return problems


def rewrite(text: str, report: dict) -> str:
    """`text` with every figure replaced by the report's."""
    for kind, patterns in PHRASES.items():
        tried, held = report["kinds"][kind]["tried"], report["kinds"][kind]["held"]
        for pattern in patterns:
            text = re.sub(pattern, lambda m, t=tried, h=held: _fill(m, t, h), text)
    return text


def _fill(match: re.Match, tried: int, held: int) -> str:
    s, base = match.group(0), match.start(0)
    (a, b), (c, d) = match.span(1), match.span(2)
    return s[: a - base] + str(tried) + s[b - base : c - base] + str(held) + s[d - base :]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="The README's reliability figures from the tests' report."
    )
    ap.add_argument("--report", default=REPORT)
    ap.add_argument("--readme", default=os.path.join(ROOT, "README.md"))
    group = ap.add_mutually_exclusive_group()
    group.add_argument(
        "--check", action="store_true", help="exit 1 when README.md's figures differ"
    )
    group.add_argument(
        "--write", action="store_true", help="write the report's figures into README.md"
    )
    args = ap.parse_args(argv)
    report = read_report(args.report)
    for kind in KINDS:
        k = report["kinds"][kind]
        print(
            f"{kind}: tried / held {k['tried']} / {k['held']}; skipped {len(k['skipped'])}", end=""
        )
        print(f"; failed: {', '.join(k['failed'])}" if k["failed"] else "")
    with open(args.readme) as f:
        text = f.read()
    if args.write:
        with open(args.readme, "w") as f:
            f.write(rewrite(text, report))
        return 0
    problems = differences(text, report)
    for line in problems:
        print(f"{args.readme}: {line}", file=sys.stderr)
    return 1 if problems and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
