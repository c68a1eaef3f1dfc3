"""TDCL-anchors (``loss.tdcl-targets = "anchors"``): every image's TDCL targets replaced by the
teacher's class-prompt means of the fused representations, ``anchor_k = mean_i fused[i, k]`` over
all nodes' training images. Paired against TDCL-only it removes the per-image diffusion content
and keeps the fixed class anchors.

Exact from sums: ``fuse`` is affine per block (``(x_b - m_b) @ W_b``), so the mean of the fused
rows is the fused mean of the pooled rows. Each node sends, in its setup reply beside the PCA
statistics, the per-prompt SUMS of its pooled features over its images and its image count (no
raw feature leaves it); the server adds them up, divides and fuses the means with the federated
basis, and ships the ``(K, D)`` anchors in every train message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from feddifrc_app.methods.feddifrc.fused import TeacherTargets
from feddifrc_app.methods.feddifrc.projection import Basis, fuse

ANCHORS = "anchors"  # server -> node, train message: the (K, D) anchors (float32)
_COUNT = "anchors.count"


def prompt_sums(pooled: Mapping[int, np.ndarray], k: int) -> dict[str, np.ndarray]:
    """A node's share: per block the float64 sum over its images of the first ``k`` (class)
    prompts' pooled rows ``(k, C_b)``, and its image count (``pooled``: ``{block: (n, P, C_b)}``)."""
    counts = {int(x.shape[0]) for x in pooled.values()}
    if len(counts) != 1:
        raise ValueError(f"prompt_sums: blocks hold different numbers of images {sorted(counts)}")
    out = {_COUNT: np.array([counts.pop()], dtype=np.int64)}
    for b, x in pooled.items():
        out[f"anchors.{int(b)}.sum"] = np.asarray(x[:, :k], dtype=np.float64).sum(axis=0)
    return out


def class_anchors(parts: Sequence[Mapping[str, np.ndarray]], basis: Basis) -> np.ndarray:
    """The server's anchors ``(K, D)`` float32 from the nodes' :func:`prompt_sums`: summed,
    divided by the total image count and fused with ``basis`` (affine: = the mean fused row)."""
    parts = list(parts)
    missing = [i for i, p in enumerate(parts) if _COUNT not in p]
    if not parts or missing:
        raise ValueError(
            "loss.tdcl-targets = 'anchors': a setup reply lacks the per-prompt sums "
            "(the node runs an older app or another config)"
        )
    n = sum(int(np.asarray(p[_COUNT]).reshape(-1)[0]) for p in parts)
    if n < 1:
        raise ValueError("loss.tdcl-targets = 'anchors': the nodes hold no training images")
    means = {b: np.sum([p[f"anchors.{b}.sum"] for p in parts], axis=0) / n for b in basis.blocks}
    return fuse(means, basis)


def anchored(targets: TeacherTargets, anchors: torch.Tensor) -> TeacherTargets:
    """``targets`` with every image's TDCL representations replaced by the ``(K, D)`` anchors
    (a broadcast view: no per-image copy); the NDCR target stays the image's own."""
    reps = targets.prompt_reps
    if reps is None or targets.per_batch is not None:
        raise ValueError("loss.tdcl-targets = 'anchors' needs static TDCL targets under a shared basis")
    if anchors.shape != reps.shape[1:]:
        raise ValueError(
            f"the server's anchors have shape {tuple(anchors.shape)}, this node's TDCL targets "
            f"(K, D) = {tuple(reps.shape[1:])}: the nodes run different prompts or widths"
        )
    view = anchors.to(reps.device, reps.dtype).expand(reps.shape[0], -1, -1)
    return TeacherTargets(rows=targets.rows, prompt_reps=view, ndcr=targets.ndcr)
