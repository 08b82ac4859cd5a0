"""verl configurations on prorl: `prorl/train.py --verl-config ppo_trainer.yaml [verl.key=v ...]`.

A verl run is a YAML file (verl's `ppo_trainer.yaml`, a composed `_generated_ppo_trainer.yaml`, or
the `.hydra/config.yaml` a verl run saved) plus dotted overrides. `translate` maps every leaf key of
it onto prorl's keys (verl 0.9.1's names and meanings) and sorts each key into one of four kinds:

- mapped: prorl has the setting; the verl value is translated (`data.train_batch_size` ->
  `trainer.prompts_per_step`, `actor_rollout_ref.actor.ppo_mini_batch_size` ->
  `trainer.mini_batches` = train_batch_size / ppo_mini_batch_size, `use_kl_loss` + `kl_loss_coef` +
  `kl_loss_type` -> `algorithm.kl_coef` + `kl_estimator` + `kl_clamp`, ...). verl's values count,
  its defaults included: a verl file describes verl's algorithm (verl's clip_ratio_high 0.2, not the
  recipe's 0.28; no KL loss unless use_kl_loss).
- matched: prorl has no key, but does what the value asks (`actor.ppo_epochs: 1`,
  `algorithm.use_kl_in_reward: false`); another value is refused.
- ignored: a setting that does not change what prorl trains (Ray, FSDP wrapping, micro-batch sizes
  in sequences - prorl's are in tokens -, profilers, the critic when no estimator uses one, logging
  formats): accepted at any value and counted in the table.
- refused: a key prorl cannot honour - a value that changes the algorithm with no prorl counterpart
  (`algorithm.adv_estimator: gae`, verl's default: prorl has no critic); a key verl 0.9.1 does not
  have, given on the command line without hydra's `+` (verl rejects it too; the nearest verl key is
  suggested: `rollout.temprature` -> `rollout.temperature`); a verl key that changes what is sampled
  or trained and that no rule reads (`rollout.repetition_penalty`, `rollout.dtype`), away from
  verl's default; or a key this table does not know, unless its value is null, false or empty (a
  feature left off). Each refused key is named with why; the run exits 2 before anything starts.
  `--print-config` lists every ignored key with why.

The prorl-only parts of the recipe that verl does not have (the cosine length penalty, reference
resets, the stop-properly multiplier) are switched off, and so is dynamic sampling unless the file
turns verl's on (`algorithm.filter_groups.enable`), so that the translated run is the verl run;
prorl keys on the same command line (`reward.length_penalty=true`, `algorithm.reset.interval=300`)
apply after the translation and turn them on: that is how a verl recipe becomes a ProRL one.

A file with a hydra `defaults:` list is composed the way verl's own configs use it (config groups in
folders beside the file, `group@package: option`, `${group}` in option names, `_self_`, `# @package
_global_`); a recipe's `hydra.searchpath` (file:// or pkg://) is searched for the files it names,
and `ppo_trainer` found nowhere is verl 0.9.1's, as prorl ships it; other hydra features need the
composed file. Overrides may carry hydra's `+` (add a
key). Without `--verl-config`, verl keys among the command line's overrides are translated the same
way, from the keys given alone: a rule whose other keys are absent leaves their prorl settings as
they are (`data.train_batch_size=8` sets trainer.prompts_per_step and keeps trainer.mini_batches),
and prorl's own additions stay on.

Decided for keys left at verl's defaults: they count like keys set by hand. A default prorl cannot
honour is refused (verl's `adv_estimator: gae`, `total_training_steps: null`: the user names an
estimator and a step count, as ProRL's recipe does anyway); a default that does not change the
result is ignored.

The full table: docs/verl.md (`python -m prorl.verl_compat > docs/verl.md`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from prorl.config import ConfigError
from prorl.verl_compat.files import has_key, load_file, resolve
from prorl.verl_compat.keys import _IGNORED, CHANGES_TRAINING, IGNORED, default, known, suggest
from prorl.verl_compat.rules import (
    ABSENT,
    RULES,
    VERL_KEYS_IN_SHARED_SECTIONS,
    VERL_SECTIONS,
    Derived,
    Refused,
)


@dataclass
class Translation:
    values: dict[str, Any] = field(default_factory=dict)  # prorl dotted key -> value
    # ("verl k=v, ...", "prorl k=v, ..." or note)
    rows: list[tuple[str, str]] = field(default_factory=list)
    ignored: list[tuple[str, str]] = field(default_factory=list)  # (key, why)
    warnings: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # "key=value: why"


MATCHED = "(as prorl does)"

# what a verl file sets before its keys are translated: prorl's own additions off (prorl keys given
# after turn them on), and dynamic sampling off as verl's algorithm.filter_groups.enable defaults to
PRORL_ONLY_OFF = {
    "reward.length_penalty": False,
    "reward.c_stop": 1.0,
    "algorithm.reset.interval": 0,
    "algorithm.reset.kl_spike_factor": 0.0,
    "algorithm.dynamic_sampling": False,
}


def _is_off(value) -> bool:
    return value is None or value is False or value in ("", [], {}, "???")


def translate(
    flat: dict[str, Any], *, from_file: bool, cli: dict[str, bool] | None = None
) -> Translation:
    """Map verl's flat {dotted key: value} onto prorl (module docstring). `from_file`: a whole verl
    config (PRORL_ONLY_OFF first); else command-line keys alone. `cli`: the keys given on the
    command line -> whether with hydra's `+`."""
    cli = cli or {}
    out = Translation()
    if from_file:
        out.values.update(PRORL_ONLY_OFF)
        shown = ", ".join(f"{k}={_fmt(v)}" for k, v in PRORL_ONLY_OFF.items())
        out.rows.append(("(prorl's additions off, as in verl)", shown))

    def get(key):
        return flat.get(key, ABSENT)

    seen: set[str] = set()
    for r in RULES:
        if not any(k in flat for k in r.keys):
            continue
        given = [k for k in r.keys if k in flat]
        seen.update(given)
        verl = ", ".join(f"{k}={_fmt(flat[k])}" for k in given)
        try:
            values = r.apply(get)
        except Refused as exc:
            out.refused.append(f"{verl}: {exc}")
            continue
        except (TypeError, ValueError) as exc:
            out.refused.append(f"{verl}: bad value ({exc})")
            continue
        out.values.update(values)
        if values:
            out.rows.append((verl, ", ".join(f"{k}={_fmt(v)}" for k, v in values.items())))
        elif r.kind == "matched":
            out.rows.append((verl, MATCHED))
    for key, value in flat.items():
        if key not in seen:
            _classify(out, key, value, from_file, cli.get(key))
    return out


def _classify(out: Translation, key: str, value, from_file: bool, plus: bool | None) -> None:
    """A verl key no rule reads: refused (a key verl rejects, one that changes what is sampled or
    trained away from verl's default, one with no counterpart) or ignored (`plus`: the key was on
    the command line, with hydra's `+` or not; None: from the file)."""
    rule_keys = {k for r in RULES for k in r.keys}
    if not known(key, rule_keys):
        near = suggest(key, rule_keys)
        hint = f" (did you mean {near}?)" if near else ""
        if plus is False:
            out.refused.append(
                f"{key}={_fmt(value)}: not a verl 0.9.1 key, verl rejects it too{hint}"
            )
            return
        if near and not _is_off(value) and plus is None:
            out.warnings.append(f"{key}: not a verl 0.9.1 key, verl ignores it{hint}")
    elif key in CHANGES_TRAINING or any(key.startswith(c + ".") for c in CHANGES_TRAINING):
        if value == default(key) or (_is_off(value) and _is_off(default(key))):
            out.ignored.append((key, "at verl's default"))
        else:
            out.refused.append(
                f"{key}={_fmt(value)}: changes what verl samples or trains and prorl has no "
                f"counterpart; leave it at verl's default {_fmt(default(key))}"
            )
        return
    why = next((w for p, w in _IGNORED if p.search(key)), None)
    if why is None and from_file and _is_off(value):
        why = "off"
    if why is not None:
        out.ignored.append((key, why))
    else:
        near = suggest(key, rule_keys) if not known(key, rule_keys) else None
        hint = f" (did you mean {near}?)" if near else ""
        out.refused.append(f"{key}={_fmt(value)}: no counterpart in prorl (docs/verl.md){hint}")


def _fmt(value) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def format_table(t: Translation, path: str | None, list_ignored: bool = False) -> str:
    """The printed table: what mapped to what; how many keys prorl honours as they are, and how many
    were ignored (`list_ignored`: each ignored key, by reason: --print-config)."""
    mapped = [(v, p) for v, p in t.rows if p != MATCHED]
    width = min(max((len(v) for v, _ in mapped), default=10), 60)
    head = f"prorl: verl config {path}" if path else "prorl: verl-style overrides"
    lines = [head + " -> prorl (the whole table: docs/verl.md):"]
    lines += [f"  {v:<{width}}  ->  {p}" for v, p in mapped]
    matched = len(t.rows) - len(mapped)
    if matched:
        lines.append(
            f"  ({matched} verl keys at values prorl honours as they are, e.g. ppo_epochs=1)"
        )
    if t.ignored:
        more = "" if list_ignored else "; --print-config lists them"
        lines.append(
            f"  ({len(t.ignored)} verl keys ignored: no effect on what prorl trains{more})"
        )
    if list_ignored:
        by_why: dict[str, list[str]] = {}
        for key, why in t.ignored:
            by_why.setdefault(why, []).append(key)
        for why, keys in by_why.items():
            lines.append(f"  ignored, {why}: {', '.join(keys)}")
    lines += [f"  warning: {w}" for w in t.warnings]
    return "\n".join(lines)


def is_verl_key(key: str, tree: dict | None = None) -> bool:
    """A dotted key that is verl's: in the verl config `tree`; else (not one of prorl's keys) under
    a section prorl lacks, read by a rule (`data.train_batch_size`), or one of verl's keys in the
    sections prorl shares (`trainer.n_gpus_per_node`: not a misspelt prorl key)."""
    from prorl.config import fields

    key = key.lstrip("+")
    if tree is not None and (has_key(tree, key) or any(key in r.keys for r in RULES)):
        return True  # a key both have (trainer.total_epochs) is read with the file's keys
    if key in {k for k, _ in fields()}:
        return False
    if key.split(".")[0] in VERL_SECTIONS or key in VERL_KEYS_IN_SHARED_SECTIONS:
        return True
    rule_keys = {k for r in RULES for k in r.keys}
    if key in rule_keys:
        return True
    return _nearer_to_verl(key, rule_keys, [k for k, _ in fields()])


def _nearer_to_verl(key: str, rule_keys, prorl_keys) -> bool:
    """A misspelt key nearer to one of verl's than to any of prorl's (`data.train_batch_szie`)."""
    import difflib

    near = suggest(key, rule_keys)
    if near is None:
        return False
    mine = difflib.get_close_matches(key, prorl_keys, n=1, cutoff=0.0)
    ratio = difflib.SequenceMatcher(None, key, near).ratio()
    return not mine or ratio > difflib.SequenceMatcher(None, key, mine[0]).ratio()


def from_command_line(
    verl_file: str | None, overrides: list[str]
) -> tuple[dict, list[str], Translation | None]:
    """(prorl values from verl, prorl's own overrides, the translation or None) of a command line:
    the verl file (if any) with the verl keys among `overrides`; the other overrides are prorl's."""
    tree = load_file(verl_file) if verl_file else None
    verl_over = [o for o in overrides if "=" in o and is_verl_key(o.split("=", 1)[0], tree)]
    own = [o for o in overrides if o not in verl_over]
    if tree is None and not verl_over:
        return {}, own, None
    flat = resolve(tree or {}, verl_over)
    cli = {o.split("=", 1)[0].lstrip("+"): o.startswith("+") for o in verl_over}
    t = translate(flat, from_file=tree is not None, cli=cli)
    if t.refused:
        listed = "\n  ".join(t.refused)
        raise ConfigError(f"verl keys prorl cannot honour (docs/verl.md):\n  {listed}")
    return t.values, _base_of_run_dir(t.values, own), t


def _base_of_run_dir(values: dict, own: list[str]) -> list[str]:
    """prorl's `output_dir=` on the command line as the folder verl's relative
    trainer.default_local_dir is resolved in (rules.py), rather than a value that replaces it: the
    override is consumed and the derived output_dir computed from it; the other overrides."""
    run_dir = values.get("output_dir")
    given = [o for o in own if o.split("=", 1)[0] == "output_dir"]
    if not isinstance(run_dir, Derived) or not given:
        return own
    base = os.path.expanduser(given[-1].split("=", 1)[1])  # the last wins, as for every key
    values["output_dir"] = run_dir.compute(SimpleNamespace(output_dir=base))
    return [o for o in own if o not in given]


def load_with_derived(values: dict, load):
    """`load(values)` -> config, with each Derived value (a verl key relative to a prorl setting it
    was given without) computed from the config loaded without it; with several, again from the
    config holding the others' values but not its own, so that one may rest on another (warmup
    steps x a derived mini-batch count) and none on itself (output_dir under output_dir)."""
    derived = {k: v for k, v in values.items() if isinstance(v, Derived)}
    plain = {k: v for k, v in values.items() if k not in derived}
    try:
        cfg = load(plain)
        got = {k: d.compute(cfg) for k, d in derived.items()}
        if len(derived) > 1:
            others = {k: {j: v for j, v in got.items() if j != k} for k in derived}
            got = {k: d.compute(load(plain | others[k])) for k, d in derived.items()}
    except Refused as exc:
        raise ConfigError(f"verl keys prorl cannot honour (docs/verl.md):\n  {exc}") from None
    return load(plain | got) if derived else cfg


def reference_markdown() -> str:
    """docs/verl.md: every rule and ignored pattern (`python -m prorl.verl_compat >
    docs/verl.md`)."""
    doc = __doc__.split("\n\n", 1)[1].rsplit("\n\nThe full table", 1)[0]
    lines = ["# Coming from verl: the key table", "", "Generated from prorl/verl_compat/ by "
             "`python -m prorl.verl_compat > docs/verl.md` (a test checks it is current).", "",
             doc, "", "| verl key(s) | kind | prorl |", "|---|---|---|"]  # fmt: skip
    for r in RULES:
        doc = " ".join(r.doc.split()).replace("|", "\\|")  # one table row, pipes escaped
        lines.append(f"| {'<br>'.join(f'`{k}`' for k in r.keys)} | {r.kind} | {doc} |")
    lines += ["", "Ignored at any value (pattern on the dotted key: why):", ""]
    lines += [f"- `{p}`: {why}" for p, why in IGNORED]
    changes = ", ".join(f"`{k}`" for k in sorted(CHANGES_TRAINING))
    lines += ["", f"Refused away from verl's default (they change what is sampled or trained): "
              f"{changes}."]  # fmt: skip
    off = ", ".join(f"`{k}={_fmt(v)}`" for k, v in PRORL_ONLY_OFF.items())
    lines += [
        "",
        f"Set by a verl file before its keys (prorl's additions, dynamic sampling off): {off}.",
        "",
    ]
    return "\n".join(lines)
