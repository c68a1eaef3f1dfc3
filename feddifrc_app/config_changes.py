"""Whether a run folder's config is the run a new config asks for (``resume-from`` and sweeps).

Torch-free, so that the sweep orchestrator starts without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from feddifrc_app.config import RESUME_MAY_CHANGE

# Keys that change what a run computes, added after runs were written, with the value those runs
# computed with: a run folder whose config.json lacks one is compared against it (run_changes).
KEYS_ADDED_SINCE: dict[str, Any] = {
    "evaluate-holdout": 0.0,  # no node held data out
    "dataset.val-fraction": 0.1,
    "loss.tdcl-targets": "image",
    **{"diffusion.pooling": "mean", "diffusion.pool-grid": 2, "diffusion.dit-features": "raw"},
    "fednh.max-grad-norm": 0.0,  # FedNH did not clip
    **{"strategy.dp": "none", "strategy.dp-noise-multiplier": 1.0, "strategy.dp-clipping-norm": 10.0},
    **{"strategy.dp-initial-clipping-norm": 0.1, "strategy.dp-target-clipped-quantile": 0.5},
    **{"strategy.dp-clip-norm-lr": 0.2, "strategy.dp-clipped-count-stddev": 0.0, "strategy.dp-delta": 1e-5},
    # added with the strategies that read them, so no run of those strategies lacks them
    **{"strategy.num-malicious-nodes": 0, "strategy.num-nodes-to-select": 1, "strategy.q": 0.1},
}


def run_changes(old: Mapping[str, Any], flat: Mapping[str, Any]) -> list[str]:
    """``"key: old -> new"`` for every key of ``flat`` that computes differently from a run folder's
    config.json ``old`` ([] = the same run). A key the run predates counts at KEYS_ADDED_SINCE's value."""
    old = {**KEYS_ADDED_SINCE, **old}
    return [
        f"{k}: {old.get(k)!r} -> {v!r}"
        for k, v in flat.items()
        if k not in RESUME_MAY_CHANGE and old.get(k) != v
    ]
