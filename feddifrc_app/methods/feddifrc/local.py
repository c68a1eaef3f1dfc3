"""FedDifRC's part of local training: every step's loss is CE (none when self-supervised) + TDCL +
NDCR against this node's teacher targets. Flower-free, as ``train.py``: a tool or benchmark runs
it without Flower installed (``benchmarks/gpu_check.py``)."""

from __future__ import annotations

from pathlib import Path

import torch

from feddifrc_app.data.loader import clean_batch
from feddifrc_app.halves import Batch, Node, NodeHalf
from feddifrc_app.methods.feddifrc import losses
from feddifrc_app.methods.feddifrc.anchors import anchored
from feddifrc_app.methods.feddifrc.fused import TeacherTargets
from feddifrc_app.methods.feddifrc.projection import Basis
from feddifrc_app.methods.feddifrc.rules import resolve_cache_dir, self_supervised
from feddifrc_app.methods.feddifrc.targets import node_targets, plan
from feddifrc_app.methods.feddifrc.teacher import teacher_spec


def cache_dir(node: Node) -> Path:
    """The node's teacher cache folder (its node config's cache-dir, else diffusion.cache-dir)."""
    return resolve_cache_dir(node.cfg, node.config.cache_dir, "node cache-dir")


class FedDifRC(NodeHalf):
    """CE (unless self-supervised) + TDCL + NDCR against this node's teacher targets.

    ``targets``: prepared ones (tests, benchmarks); else ``start`` prepares them under ``basis``
    from the received model (``targets.node_targets``, its cost in the reply's metrics).
    ``anchors`` (K, D): the server's class anchors, which replace every image's TDCL targets."""

    def __init__(
        self,
        node: Node,
        targets: TeacherTargets | None = None,
        basis: Basis | None = None,
        anchors: torch.Tensor | None = None,
    ) -> None:
        self.node, self.targets, self.basis, self.anchors = node, targets, basis, anchors
        self.lc = node.cfg.loss
        self.supervised = not self_supervised(node.cfg)
        self.gen: torch.Generator | None = None

    def start(self, model: torch.nn.Module) -> dict[str, float]:
        n, cost = self.node, {}
        if self.targets is None:
            p = plan(n.cfg, teacher_spec(n.cfg, cache_dir(n)), n.data, n.ids)
            self.targets, cost = node_targets(p, self.basis, model, n.device)
            model.train()  # conditioning embeds in eval mode
        self.targets = self.targets.on(n.device, n.ids)
        if self.anchors is not None:  # after ``on``: the (K, D) anchors move, not n copies
            self.targets = anchored(self.targets, self.anchors)
        self.gen = torch.Generator().manual_seed(n.seed)  # negative sampling in TDCL
        return cost

    def divergence_remedy(self) -> str:
        return f"raise loss.temperature (= {self.lc.temperature:g})"  # TDCL's similarities / it

    def view(self, batch: Batch) -> torch.Tensor | None:
        """NDCR's target was computed from the un-augmented image: align that view's embedding."""
        clean = self.lc.ndcr_weight > 0 and self.lc.ndcr_view == "clean" and batch.augmented
        return clean_batch(self.node.data, batch.idx) if clean else None

    def loss(self, batch: Batch) -> dict[str, torch.Tensor]:
        lc, sup, device = self.lc, self.supervised, batch.z.device
        reps, ndcr = self.targets.take(batch.idx)
        # Per-batch fusion returns CPU tensors; targets moved by ``on`` are already there (a no-op).
        reps, ndcr = (None if t is None else t.to(device, non_blocking=True) for t in (reps, ndcr))
        # Self-supervised: no CE; reps (B, 1 + K, D) = positive prompt first, then the negatives.
        parts = losses.feddifrc_loss(
            batch.logits if sup else None,
            batch.y if sup else None,
            batch.z,
            reps,
            ndcr,
            variant=lc.variant,
            tdcl_weight=lc.tdcl_weight,
            ndcr_weight=lc.ndcr_weight,
            temperature=lc.temperature,
            num_negatives=lc.num_negatives,
            normaliser=lc.tdcl_normaliser,
            ndcr_space=lc.ndcr_space,
            generator=self.gen,
            ndcr_z=batch.z_view,
        )
        if not sup:
            del parts["ce"]  # not a loss term here: no "train-ce" metric (it would read as a CE of 0)
        if ndcr is not None:
            parts["ndcr-cosine"] = losses.cosine_alignment(batch.z_view.detach(), ndcr)
        return parts
