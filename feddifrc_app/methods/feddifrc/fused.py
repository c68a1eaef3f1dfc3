"""A client's frozen teacher targets, fused in the classifier's embedding space, ready to train on."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from feddifrc_app.methods.feddifrc.projection import fuse_per_batch


@dataclass
class TeacherTargets:
    """Frozen diffusion targets for one client's training images.

    ``rows[i]`` is the row of dataset index ``i`` (-1 = not in this client's set).
    Supervised: ``prompt_reps`` (n, K, D) = the image under each class prompt, ``ndcr`` (n, D).
    Self-supervised: ``prompt_reps`` (n, 1 + K_neg, D) = positive prompt first, then negatives.
    ``per_batch`` is the public code's behaviour: pooled per-block features are kept and the
    PCA is refit on every batch by ``fuse_batch`` (comparison only).
    """

    rows: torch.Tensor  # int64 (max_index + 1,)
    prompt_reps: torch.Tensor | None  # float32 (n, K, D)
    ndcr: torch.Tensor | None  # float32 (n, D)
    # per-batch mode: ({block: pooled (n, P, C_b)}, widths, K) -> PCA refit on each batch
    per_batch: tuple[dict[int, np.ndarray], tuple[int, ...], int] | None = None

    @property
    def nbytes(self) -> int:
        parts = [self.rows, self.prompt_reps, self.ndcr]
        size = sum(t.numel() * t.element_size() for t in parts if t is not None)
        return size + (sum(a.nbytes for a in self.per_batch[0].values()) if self.per_batch else 0)

    def on(self, device: torch.device, ids: np.ndarray) -> TeacherTargets:
        """These targets on ``device`` for training on dataset indices ``ids`` (moved once per round,
        gathered there every step). Every id must have a row (KeyError otherwise): checked here, once,
        so that ``take`` on a GPU gathers with device-resident indices and no host sync per step."""
        self._require(torch.as_tensor(np.asarray(ids, dtype=np.int64)))
        if self.per_batch is not None:  # fused on the CPU every batch: rows stay there
            return self

        def move(t):
            return None if t is None else t.to(device)

        return TeacherTargets(move(self.rows), move(self.prompt_reps), move(self.ndcr), self.per_batch)

    def _require(self, idx: torch.Tensor) -> None:
        rows = self.rows.cpu()
        if bool((idx >= len(rows)).any()) or bool((rows[idx.clamp(max=len(rows) - 1)] < 0).any()):
            raise KeyError("a training image has no teacher target (targets built for other indices)")

    def take(self, idx: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(TDCL representations (B, K, D), NDCR targets (B, D)) of dataset indices ``idx`` (B,),
        on the targets' device. On the CPU ``idx`` is checked here (free); on a GPU it must be among
        the ids given to ``on``, which checked them."""
        if self.rows.device.type == "cpu":
            self._require(idx.cpu())
        r = self.rows[idx.to(self.rows.device, non_blocking=True)]
        if self.per_batch is not None:
            pooled, widths, k = self.per_batch
            fused = torch.from_numpy(fuse_per_batch({b: x[r.numpy()] for b, x in pooled.items()}, widths))
            return fused[:, :k], fused[:, -1]
        reps = None if self.prompt_reps is None else self.prompt_reps[r]
        ndcr = None if self.ndcr is None else self.ndcr[r]
        return reps, ndcr


def target_rows(ids: np.ndarray) -> torch.Tensor:
    """``TeacherTargets.rows``: dataset index -> row in the client's arrays (-1: not this client's)."""
    rows = torch.full((int(ids.max()) + 1,), -1, dtype=torch.int64)
    rows[torch.as_tensor(ids)] = torch.arange(len(ids))
    return rows
