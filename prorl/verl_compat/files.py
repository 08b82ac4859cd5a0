"""Reading verl configs: a YAML file with its hydra `defaults:` list composed the way verl's own
configs use it, verl's dotted overrides merged, interpolations resolved, flattened to {dotted key:
leaf}."""

from __future__ import annotations

import importlib.util
import json
import os
import re
from typing import Any

from omegaconf import OmegaConf

from prorl.config import ConfigError

# verl 0.9.1's composed ppo_trainer config (prorl/verl_compat/keys.py says more)
TEMPLATE_FILE = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "verl_0_9_1_ppo_trainer.json"
)
with open(TEMPLATE_FILE) as _f:
    VERL_TEMPLATE: dict = json.load(_f)  # {dotted key: leaf}, "${...}" interpolations kept


def nested(flat: dict) -> dict:
    """{dotted key: leaf} as a nested dict."""
    out: dict = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def load_file(path: str) -> dict:
    """A verl YAML file as a nested dict, its hydra `defaults:` composed (unresolved
    interpolations)."""
    if not os.path.isfile(path):
        raise ConfigError(f"--verl-config {path!r}: no such file")
    try:
        return OmegaConf.to_container(_compose(os.path.abspath(path), "", {}), resolve=False)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - a YAML or composition error, named with the file
        raise ConfigError(f"--verl-config {path}: {type(exc).__name__}: {exc}") from None


def _compose(path: str, package: str, choices: dict):
    """One file with its defaults list, placed at `package`."""
    text = open(path).read()
    if re.search(r"^#\s*@package\s+_global_", text, re.M):
        package = ""
    node = OmegaConf.create(text) if text.strip() else OmegaConf.create({})
    if not OmegaConf.is_dict(node):
        raise ConfigError(f"--verl-config {path}: not a mapping of keys")
    entries = []
    # unresolved: its entries may name other groups' choices (${model_engine})
    if "defaults" in node:
        entries = OmegaConf.to_container(node._get_node("defaults"), resolve=False)
        del node["defaults"]
    folder = os.path.dirname(path)
    search = [folder, *_search_path(node, path)]  # hydra.searchpath: where defaults are found
    result = OmegaConf.create({})
    if "_self_" not in entries:
        entries.append("_self_")
    for entry in entries:
        if entry == "_self_":
            result = OmegaConf.merge(result, _place(node, package))
            continue
        if isinstance(
            entry, str
        ):  # a config beside this one or on the search path, at this package
            result = OmegaConf.merge(result, _primary(entry, search, path, package, choices))
            continue
        ((group_pkg, option),) = entry.items()
        if str(group_pkg).startswith("override "):
            raise ConfigError(
                f"--verl-config {path}: hydra's 'override' needs the composed config file"
            )
        group, _, pkg = str(group_pkg).partition("@")
        option = re.sub(r"\$\{(\w+)\}", lambda m: str(choices[m.group(1)]), str(option))
        choices[os.path.basename(group)] = option
        pkg = pkg or os.path.basename(group)
        file = os.path.normpath(os.path.join(folder, group, option + ".yaml"))
        if not os.path.isfile(file):
            raise ConfigError(
                f"--verl-config {path}: defaults entry "
                f"{group_pkg}: {option} -> {file}: no such file"
            )
        result = OmegaConf.merge(
            result, _compose(file, ".".join(p for p in (package, pkg) if p), choices)
        )
    return result


def _search_path(node, path: str) -> list[str]:
    """The folders of the file's `hydra.searchpath` (file://DIR, relative to the working directory
    as in hydra, or to the file; pkg://a.b, an installed package's folder); the hydra block is
    removed (it configures hydra, not the run)."""
    if "hydra" not in node:
        return []
    hydra = OmegaConf.to_container(node._get_node("hydra"), resolve=False)
    del node["hydra"]
    folders = []
    for entry in (hydra or {}).get("searchpath") or []:
        scheme, _, where = str(entry).partition("://")
        if scheme == "file":
            folders += [os.path.abspath(where), os.path.join(os.path.dirname(path), where)]
        elif scheme == "pkg":
            spec = importlib.util.find_spec(where.split(".")[0])
            if spec is not None and spec.origin:
                root = os.path.dirname(os.path.dirname(spec.origin))
                folders.append(os.path.join(root, *where.split(".")))
    return folders


def _primary(name: str, search: list[str], path: str, package: str, choices: dict):
    """A defaults entry naming a config file: the first `name`.yaml on the search path; verl's
    `ppo_trainer` without verl's config folder: verl 0.9.1's, as prorl ships it (VERL_TEMPLATE)."""
    for folder in search:
        file = os.path.join(folder, name + ".yaml")
        if os.path.isfile(file):
            return _compose(file, package, choices)
    if name == "ppo_trainer":
        return _place(OmegaConf.create(nested(VERL_TEMPLATE)), package)
    raise ConfigError(
        f"--verl-config {path}: defaults entry {name!r}: no {name}.yaml in "
        f"{', '.join(dict.fromkeys(search))} (hydra.searchpath names more folders)"
    )


def _place(node, package: str):
    for part in reversed([p for p in package.split(".") if p]):
        node = OmegaConf.create({part: node})
    return node


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{dotted key: leaf value}; an empty dict is a leaf."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def resolve(tree: dict, overrides: list[str]) -> dict[str, Any]:
    """verl's overrides merged into the tree, interpolations resolved: the flat leaves verl would
    run."""
    dotlist = [o.lstrip("+") for o in overrides]
    try:
        cfg = OmegaConf.merge(OmegaConf.create(tree), OmegaConf.from_dotlist(dotlist))
        return flatten(OmegaConf.to_container(cfg, resolve=True))
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(
            f"verl config: {type(exc).__name__}: {str(exc).splitlines()[0]}"
        ) from None


def has_key(tree: dict, key: str) -> bool:
    node = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True
