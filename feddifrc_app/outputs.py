"""The run directory: resolved config, results.json, per-round checkpoints, plots.

Layout of ``<outputs-dir>/<run-name>/``::

    config.json                 the resolved run config (flat dotted keys)
    results.json                per-round metrics + summary (final / best / mean of last 5)
    accuracy.png                test accuracy per round
    label_distribution.png      per-client label counts
    checkpoints/round-0003.pt   global model + strategy state + basis after round 3
    checkpoints/round-0003.pt.sha256   its digest, checked before it is loaded

Every file is written atomically (``files.atomic_write``), so a killed server never
leaves a half-written results.json or checkpoint behind.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from feddifrc_app import log
from feddifrc_app.config import Config
from feddifrc_app.config_changes import run_changes
from feddifrc_app.files import LOCK_NAME, FolderInUse, atomic_write, folder_holder, lock_folder, write_json
from feddifrc_app.results import Results, summarize

_CKPT = re.compile(r"^round-(\d{4,})\.pt$")


class RunDir:
    """``<outputs-dir>/<run-name>/``: it belongs to one run; only ``resume-from`` may continue it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.ckpt_dir = path / "checkpoints"

    @classmethod
    def for_config(cls, cfg: Config, run_id: int) -> RunDir:
        """A fresh run directory, or the one ``resume-from`` names (whose config must match)."""
        run = cls(
            Path(cfg.resume_from)
            if cfg.resume_from
            else Path(cfg.outputs_dir) / (cfg.run_name or f"{datetime.now():%Y%m%d-%H%M%S}-run{run_id}")
        )
        if run.path.is_dir() and (who := folder_holder(run.path)):  # named before any other check
            raise FolderInUse(
                f"run directory {run.path} is in use by {who}; wait for that run to end or stop it"
            )
        if cfg.resume_from:
            if not run.path.is_dir():
                raise FileNotFoundError(f"resume-from = {cfg.resume_from!r}: no such run directory")
            run.check_resume_config(cfg.to_flat())
        else:
            # A run whose setup failed left only config.json: its name may be used again.
            if run.path.exists() and (not run.path.is_dir() or run.holds_a_run()):
                raise FileExistsError(
                    f"run directory {run.path} already holds another run: pick a new run-name, or continue "
                    f"that run with resume-from = '{run.path}'"
                )
        try:
            run.ckpt_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OSError(
                f"outputs-dir = {cfg.outputs_dir!r}: cannot create the run directory {run.path} ({e})"
            ) from e
        # Owned from here until the ServerApp process ends: a second start or resume of this
        # folder, or a sweep about to delete it, is refused naming this process.
        lock_folder(run.path, "a feddifrc ServerApp")
        run.remove_partial_files()
        return run

    def holds_a_run(self) -> bool:
        return any(
            p.name not in ("config.json", "checkpoints", LOCK_NAME) for p in self.path.iterdir()
        ) or bool(self.checkpoints())

    def check_resume_config(self, flat: dict[str, Any]) -> None:
        """Refuse to continue a run under a config that computes something else; say what changed."""
        path = self.path / "config.json"
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(
                f"resume-from: {path} is missing or unreadable ({e}); cannot check the config"
            ) from None
        if changed := run_changes(old, flat):
            raise ValueError(
                f"resume-from = {str(self.path)!r}: the config differs from the run's own "
                f"({'; '.join(changed)}); resume with the original values or start a new run"
            )

    def remove_partial_files(self) -> None:
        """Temp files of a write that was killed (files.atomic_write names them ``.<name>.tmp-*``)."""
        for folder in (self.path, self.ckpt_dir):
            for p in folder.glob(".*.tmp-*"):
                p.unlink(missing_ok=True)

    # ---------------------------------------------------------------- results
    @property
    def results_path(self) -> Path:
        return self.path / "results.json"

    def load_results(self, declared: Mapping[str, type | tuple[type, ...]] | None = None) -> Results | None:
        """None when there is no results.json yet; a file that is not JSON or cannot be read (a
        folder, a symlink loop) is a ValueError naming it, one of another layout a TypeError (a key
        of the wrong type) or AttributeError (not an object). ``declared``: the methods' own keys
        (``methods.results_keys``), type-checked too (report and status import no method)."""
        if not self.results_path.exists() and not self.results_path.is_symlink():
            return None
        try:
            obj = json.loads(self.results_path.read_text())
        except ValueError as e:
            raise ValueError(
                f"{self.results_path} is not valid JSON ({e}); restore it or start a new run"
            ) from None
        except OSError as e:  # a folder, a symlink loop, no permission: named like bad JSON
            raise ValueError(
                f"{self.results_path} is unreadable ({e.strerror or e}); restore it or start a new run"
            ) from None
        return Results.from_json(obj, declared)

    def save_results(self, results: Results) -> None:
        results.summary = summarize(results.rounds)
        write_json(self.results_path, results.to_json())

    def begin(self, cfg: Config, run_id: int) -> tuple[Results, dict[str, Any] | None]:
        """The results this run writes and, under ``resume-from``, the checkpoint it continues
        (the newest readable one): the rows after its round are dropped, the resume is recorded,
        the error of the run that stopped or failed is cleared. The one place a run resumes."""
        if not cfg.resume_from:
            new = Results(cfg.method, cfg.strategy.name, cfg.dataset.name, cfg.partition.name, [], [])
            return new, None
        found = self.load_last_checkpoint()
        if found is None:
            raise FileNotFoundError(
                f"resume-from = {cfg.resume_from!r}: no readable checkpoint in {self.ckpt_dir}"
            )
        last, checkpoint = found
        results = self.resumed_results(last)
        results.rounds = [r for r in results.rounds if r.round <= last]
        if results.diverged_rounds is not None:
            results.diverged_rounds = [r for r in results.diverged_rounds if r <= last]
        if results.evaluated_rounds is not None:
            results.evaluated_rounds = [r for r in results.evaluated_rounds if r <= last]
        results.resumed = [*(results.resumed or []), {"after-round": last, "run-id": run_id}]
        results.error = None
        log.info("resumed from %s at round %d", self.path, last)
        return results, checkpoint

    def resumed_results(self, last: int) -> Results:
        """The results.json a resume after round ``last`` continues; refused when it is gone, since
        a new history would report rounds 1..last as never run."""
        from feddifrc_app import methods  # the run's: loaded already

        try:
            results = self.load_results(methods.results_keys())
        except (AttributeError, TypeError):  # valid JSON of another layout
            results = None
        if results is None or not results.rounds:
            raise FileNotFoundError(
                f"resume-from = '{self.path}': {self.results_path} is missing or holds no rounds, so the "
                f"history of rounds 0..{last} would be lost; restore it, or start a new run"
            )
        return results

    # ---------------------------------------------------------------- checkpoints
    def checkpoint_path(self, rnd: int) -> Path:
        return self.ckpt_dir / f"round-{rnd:04d}.pt"

    def save_checkpoint(self, rnd: int, payload: dict[str, Any], keep: int = 0) -> Path:
        """Tensors, numbers and strings only (loaded with ``weights_only=True``), plus a sha256 sidecar."""
        import torch  # here, not at the top: `feddifrc report`/`status` read results.json without it

        buf = io.BytesIO()
        torch.save(payload, buf)
        data = buf.getvalue()
        path = self.checkpoint_path(rnd)
        atomic_write(path, lambda f: f.write(data))
        # Written second: a checkpoint without its digest is never loaded.
        atomic_write(_digest_path(path), lambda f: f.write(hashlib.sha256(data).hexdigest()), mode="w")
        if keep > 0:
            for old in self.checkpoints()[:-keep]:
                old.unlink(missing_ok=True)
                _digest_path(old).unlink(missing_ok=True)
        return path

    def checkpoints(self) -> list[Path]:
        if not self.ckpt_dir.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.ckpt_dir.iterdir() if (m := _CKPT.match(p.name))]
        return [p for _, p in sorted(found)]

    def load_last_checkpoint(self) -> tuple[int, dict[str, Any]] | None:
        """The newest checkpoint whose digest matches; a corrupt or unverified one is reported and skipped."""
        import torch

        for path in reversed(self.checkpoints()):
            try:
                data = path.read_bytes()
                if _digest_path(path).read_text().strip() != hashlib.sha256(data).hexdigest():
                    raise ValueError("sha256 does not match its .sha256 file")
                payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
                _check_payload(path, payload)
            except Exception as e:  # noqa: BLE001 - a corrupt file must not end the resume
                log.warning("checkpoint %s is not loaded (%s); trying the previous one", path, e)
                continue
            return int(payload["round"]), payload
        return None


def _check_payload(path: Path, payload: Any) -> None:
    """A checkpoint is the round its name says, with a model state: a digest only proves the bytes
    are the ones written, not that they are a checkpoint of this round (resume continues from it)."""
    m = _CKPT.match(path.name)
    rnd = payload.get("round") if isinstance(payload, dict) else None
    if not isinstance(rnd, int) or isinstance(rnd, bool) or m is None or rnd != int(m.group(1)):
        raise ValueError(f"it says round {rnd!r}, its name round {int(m.group(1)) if m else '?'}")
    if not isinstance(payload.get("model"), dict):
        raise ValueError("it holds no model state")


def _digest_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")
