"""The run directory: resolved config, results.json, per-round checkpoints, plots.

Layout of ``<outputs-dir>/<run-name>/``::

    config.json                 the resolved run config (flat dotted keys)
    results.json                per-round metrics + summary (final / best / mean of last 5)
    accuracy.png                test accuracy per round
    label_distribution.png      per-client label counts
    checkpoints/round-0003.pt   global model + strategy state + basis after round 3

Every file is written atomically (temp file in the same folder + ``os.replace``), so
a killed server never leaves a half-written results.json or checkpoint behind.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from feddifrc_app.config import Config

log = logging.getLogger(__name__)

_CKPT = re.compile(r"^round-(\d{4,})\.pt$")


def atomic_write(path: Path, write: Callable[[Any], None], mode: str = "wb") -> None:
    """Write via ``write(fileobj)`` to a temp file next to ``path``, fsync, then rename over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, obj: Any) -> None:
    atomic_write(path, lambda f: json.dump(obj, f, indent=2, sort_keys=False), mode="w")


def summarize(accuracies: list[float]) -> dict[str, float | None]:
    """Final, best and mean-of-last-5 accuracy, reported together (the paper's code reports the max)."""
    if not accuracies:
        return {"final-accuracy": None, "best-accuracy": None, "mean-last-5-accuracy": None}
    last5 = accuracies[-5:]
    return {
        "final-accuracy": accuracies[-1],
        "best-accuracy": max(accuracies),
        "mean-last-5-accuracy": sum(last5) / len(last5),
    }


class RunDir:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.ckpt_dir = path / "checkpoints"

    @classmethod
    def for_config(cls, cfg: Config, run_id: int) -> RunDir:
        if cfg.resume_from:
            path = Path(cfg.resume_from)
            if not path.is_dir():
                raise FileNotFoundError(f"resume-from = {cfg.resume_from!r}: no such run directory")
        else:
            name = cfg.run_name or f"{datetime.now():%Y%m%d-%H%M%S}-run{run_id}"
            path = Path(cfg.outputs_dir) / name
        path.mkdir(parents=True, exist_ok=True)
        return cls(path)

    # ---------------------------------------------------------------- results
    @property
    def results_path(self) -> Path:
        return self.path / "results.json"

    def load_results(self) -> dict[str, Any] | None:
        if not self.results_path.exists():
            return None
        with open(self.results_path) as f:
            return json.load(f)

    def save_results(self, results: dict[str, Any]) -> None:
        accs = [r["test-accuracy"] for r in results["rounds"] if r.get("test-accuracy") is not None]
        # Round 0 (the initial model) is not a training result: summarise rounds >= 1.
        accs_trained = [r["test-accuracy"] for r in results["rounds"]
                        if r["round"] >= 1 and r.get("test-accuracy") is not None]
        results["summary"] = summarize(accs_trained if accs_trained else accs)
        write_json(self.results_path, results)

    # ---------------------------------------------------------------- checkpoints
    def checkpoint_path(self, rnd: int) -> Path:
        return self.ckpt_dir / f"round-{rnd:04d}.pt"

    def save_checkpoint(self, rnd: int, payload: dict[str, Any], keep: int = 0) -> Path:
        path = self.checkpoint_path(rnd)
        atomic_write(path, lambda f: torch.save(payload, f))
        if keep > 0:
            for old in self.checkpoints()[:-keep]:
                old.unlink(missing_ok=True)
        return path

    def checkpoints(self) -> list[Path]:
        if not self.ckpt_dir.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.ckpt_dir.iterdir() if (m := _CKPT.match(p.name))]
        return [p for _, p in sorted(found)]

    def load_last_checkpoint(self) -> tuple[int, dict[str, Any]] | None:
        """The newest readable checkpoint; an unreadable newest one is reported and skipped."""
        for path in reversed(self.checkpoints()):
            try:
                payload = torch.load(path, map_location="cpu", weights_only=False)
            except Exception as e:  # noqa: BLE001 - a corrupt file must not end the resume
                log.warning("checkpoint %s is unreadable (%s); trying the previous one", path, e)
                continue
            return int(payload["round"]), payload
        return None
