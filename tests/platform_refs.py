"""Reference numbers per platform: a run's bits hold only on the CPU kernels and torch that wrote
them (docs/results.md, "Reproducibility"), so a reference file holds one entry per platform.

A file is a JSON list of entries, each with a ``platform`` (:func:`platform`) and that platform's
numbers. Used by tests/simulation_runs.py (the suite's quickstart run) and
scripts/quickstart_reference.py (the README's quickstart line); stdlib only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def platform() -> dict[str, str]:
    """What the numbers are conditional on: torch and the CPU's kernels."""
    import platform as host

    import torch

    return {
        "torch": torch.__version__,
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "machine": host.machine(),
    }


def entries(path: Path) -> list[dict[str, Any]]:
    return json.loads(path.read_text())


def entry(path: Path, where: dict[str, str]) -> dict[str, Any] | None:
    """The entry written on ``where`` (its numbers, without ``platform``), or None."""
    found = [e for e in entries(path) if e["platform"] == where]
    return {k: v for k, v in found[0].items() if k != "platform"} if found else None


def store(path: Path, where: dict[str, str], numbers: dict[str, Any]) -> None:
    """Add ``numbers`` as ``where``'s entry, replacing the one it had; the others are kept."""
    kept = [e for e in entries(path) if e["platform"] != where] if path.exists() else []
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps([*kept, {"platform": where, **numbers}], indent=1) + "\n")


def platforms(path: Path) -> list[dict[str, str]]:
    return [e["platform"] for e in entries(path)]
