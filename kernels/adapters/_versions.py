"""The peer versions the adapters are tested against, and the warning when another one is installed.

The check reads the installed distribution's metadata (importlib.metadata): it never imports the
peer.
"""

from __future__ import annotations

import importlib.metadata
import re
import warnings

# distribution -> the release the adapter is tested against; a version whose release starts with it
# is in range ("1.16" takes 1.16.0, 1.16.1, ...). .ci/peers.sh installs verl and openrlhf at exactly
# these.
TESTED = {"verl": "0.9.1", "openrlhf": "0.11.2", "trl": "1.16"}


class PeerVersionWarning(UserWarning):
    """An adapter's peer is installed in a version outside the tested range."""


def _release(version: str) -> tuple[int, ...]:
    m = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(x) for x in m.group(0).split(".")) if m else ()


def in_tested_range(dist: str, version: str) -> bool:
    tested = _release(TESTED[dist])
    return _release(version)[: len(tested)] == tested


def check_peer_version(dist: str, version: str | None = None) -> bool:
    """Warn (PeerVersionWarning) if `dist` is installed outside its tested range; False then, else
    True.

    version: the installed version (default: read from the distribution's metadata; not installed ->
    True).
    """
    if version is None:
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return True
    if in_tested_range(dist, version):
        return True
    warnings.warn(
        f"prorl.kernels.adapters: {dist} {version} is installed, but the {dist} adapter is tested "
        f"against {dist} {TESTED[dist]} only (kernels/ADAPTERS.md); its argument names, loss or "
        "metrics may differ in this version",
        PeerVersionWarning,
        stacklevel=3,
    )
    return False


def check_peer_versions() -> None:
    """The import-time check of every installed peer."""
    for dist in TESTED:
        check_peer_version(dist)
