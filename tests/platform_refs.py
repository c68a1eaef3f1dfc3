"""Reference numbers per platform: a run's bits hold only on the CPU kernels and torch that wrote
them (docs/results.md, "Reproducibility"), so a reference file holds one entry per platform.

A file is a JSON list of entries, each with a ``platform`` (the app's ``device.platform_info()``,
as results.json's ``platforms`` records it) and that platform's numbers. Used by
tests/simulation_runs.py (the suite's quickstart run) and scripts/quickstart_reference.py (the
README's quickstart line).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def entries(path: Path) -> list[dict[str, Any]]:
    found = json.loads(path.read_text())
    if not isinstance(found, list) or not all(isinstance(e, dict) and "platform" in e for e in found):
        raise ValueError(f"{path}: expected a JSON list of entries, each with a 'platform'")
    return found


def entry(path: Path, where: dict[str, str]) -> dict[str, Any] | None:
    """The entry written on ``where`` (its numbers, without ``platform``), or None."""
    found = [e for e in entries(path) if e["platform"] == where]
    if len(found) > 1:
        raise ValueError(f"{path}: {len(found)} entries for {where}; keep one")
    return {k: v for k, v in found[0].items() if k != "platform"} if found else None


def store(path: Path, where: dict[str, str], numbers: dict[str, Any]) -> None:
    """Write ``numbers`` as ``where``'s entry: in place of the one it had (the order is kept), else
    last."""
    new = {"platform": where, **numbers}
    old = entries(path) if path.exists() else []
    kept = [new if e["platform"] == where else e for e in old]
    if new not in kept:
        kept.append(new)
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(kept, indent=1) + "\n")


def platforms(path: Path) -> list[dict[str, str]]:
    return [e["platform"] for e in entries(path)]
