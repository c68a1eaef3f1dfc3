"""Whether a run folder's config is the run a new config asks for (``resume-from`` and sweeps).

Torch-free, so that the sweep orchestrator starts without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Keys that change what a run computes, added after the first run folders were written (commit
# 9ef3e3a), with the value those runs computed with: a run folder whose config.json lacks one is
# compared against it (run_changes). tests/test_config_changes.py lists every key's commit.
KEYS_ADDED_SINCE: dict[str, Any] = {
    "evaluate-holdout": 0.0,  # no node held data out
    "dataset.val-fraction": 0.1,  # (before the validation split: see _old_value)
    "dataset.eval-limit": 0,  # every validation and test image was scored
    "dataset.classes": "",  # image-folder: the sorted folders of data-dir
    "model.width": 64,  # ResNet-10 had the paper's widths, 64/128/256/512
    "loss.tdcl-targets": "image",
    "loss.ndcr-view": "augmented",  # NDCR aligned the student's (augmented) view
    **{"diffusion.pooling": "mean", "diffusion.pool-grid": 2, "diffusion.dit-features": "raw"},
    "diffusion.noise-seed": -1,  # the teacher's noise was drawn from the run seed
    "diffusion.basis-nodes": 0,  # the basis came from every node's statistics
    "server.evaluate-every": 1,  # the server scored every round
    "train.max-grad-norm": 0.0,  # no method but FedNH clipped
    "fednh.max-grad-norm": 0.0,  # FedNH did not clip (a run of another method never read it)
    **{"strategy.dp": "none", "strategy.dp-noise-multiplier": 1.0, "strategy.dp-clipping-norm": 10.0},
    **{"strategy.dp-initial-clipping-norm": 0.1, "strategy.dp-target-clipped-quantile": 0.5},
    **{"strategy.dp-clip-norm-lr": 0.2, "strategy.dp-clipped-count-stddev": 0.0, "strategy.dp-delta": 1e-5},
    # added with the strategies and methods that read them, so no run of those lacks them
    **{"strategy.num-malicious-nodes": 0, "strategy.num-nodes-to-select": 1, "strategy.q": 0.1},
    **{"moon.mu": 1.0, "moon.tau": 0.5, "fednh.rho": 0.9, "fednh.scale": 20.0},
}


def _old_value(key: str, old: Mapping[str, Any], new: Any) -> Any:
    """The value of ``key`` that the run folder's config.json ``old`` computed with."""
    if key in old:
        return old[key]
    # A method's section (methods.section_readers): a run folder of another method that lacks
    # such a key never read it, so any value computes the same run. (Imported here: finding the
    # methods loads torch, which `feddifrc report` / `status` start without.)
    from feddifrc_app import methods

    section = key.split(".", 1)[0]
    if old.get("method") not in methods.section_readers().get(section, (old.get("method"),)):
        return new
    if key == "dataset.val-fraction":
        # mnist-5k validates on its public split, whatever the key; every other dataset held no
        # validation images out of its training split before loss.ndcr-view came (commit e53e94c).
        if old.get("dataset.name") == "mnist-5k":
            return new
        return KEYS_ADDED_SINCE[key] if "loss.ndcr-view" in old else 0.0
    return KEYS_ADDED_SINCE.get(key)


def run_changes(old: Mapping[str, Any], flat: Mapping[str, Any]) -> list[str]:
    """``"key: old -> new"`` for every key of ``flat`` that computes differently from a run folder's
    config.json ``old`` ([] = the same run). A key the run predates counts at the value it computed
    with (KEYS_ADDED_SINCE's, or any value for a key the run never read)."""
    from feddifrc_app.config_loader import resume_may_change  # (as in _old_value)

    changes = []
    for k, v in flat.items():
        if k not in resume_may_change() and (was := _old_value(k, old, v)) != v:
            changes.append(f"{k}: {was!r} -> {v!r}")
    return changes
