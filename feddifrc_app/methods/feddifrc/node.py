"""FedDifRC's node half: the setup reply (teacher identity, PCA statistics) and the local loss.

Setup query: the node names its teacher (the server checks that every node runs the same
weights) and, when the query asks (``want-stats``), sends the sufficient statistics of its
pooled teacher features for the federated basis. Train message: the node prepares its
targets under the message's basis (``targets.node_targets``) from the received model, then
every step's loss is CE (none when self-supervised) + TDCL + NDCR against them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from flwr.app import ConfigRecord, Message

from feddifrc_app.data.dataset import clean_batch
from feddifrc_app.files import ensure_writable_dir
from feddifrc_app.methods import Batch, Node, NodeHalf
from feddifrc_app.methods.feddifrc import losses
from feddifrc_app.methods.feddifrc.fused import TeacherTargets
from feddifrc_app.methods.feddifrc.projection import Basis
from feddifrc_app.methods.feddifrc.targets import node_stats, node_targets, plan, require_basis
from feddifrc_app.methods.feddifrc.teacher import teacher_spec
from feddifrc_app.records import BASIS, arrays_to_record, record_to_arrays

WANT_STATS = "want-stats"  # server -> node, setup query config: send the PCA statistics
STATS = "pca-stats"  # node -> server, setup reply: the statistics (projection.stats_to_arrays)
_CACHE_KEY = "cache-dir (node-config, else diffusion.cache-dir)"  # named in its errors


def _cache_dir(node: Node) -> Path:
    return node.config.resolve_cache_dir(node.cfg)


def setup_reply(msg: Message, node: Node, info: ConfigRecord) -> dict[str, Any]:
    """The teacher's identity in ``info`` and, when asked, this node's PCA statistics."""
    cfg = node.cfg
    # No SD load; no GPU for diffusion.device = 'cuda' fails here.
    spec = teacher_spec(cfg, ensure_writable_dir(_cache_dir(node), _CACHE_KEY))
    info["teacher-model"] = spec.identity.model_id
    info["teacher-random-weights"] = bool(spec.identity.random_weights)
    info["teacher-weights"] = spec.identity.weights_hash  # the server checks that all nodes agree
    info["teacher-device"] = spec.where  # where this node's teacher runs, the dtype in its cache key
    if not bool(msg.content["config"][WANT_STATS]):
        return {}
    arrays, stats = node_stats(plan(cfg, spec, node.data, node.ids))  # once, for the federated basis
    info["teacher-seconds"] = float(stats.seconds)
    info["teacher-cache-misses"] = int(stats.misses)
    return {STATS: arrays_to_record(arrays)}


def node_half(msg: Message, node: Node) -> FedDifRC:
    """The train message's half: its basis (refused before any teacher work if the projection
    needs one and the message has none)."""
    basis = Basis.from_arrays(record_to_arrays(msg.content[BASIS])) if BASIS in msg.content else None
    require_basis(node.cfg, basis)
    return FedDifRC(node, basis=basis)


class FedDifRC(NodeHalf):
    """CE (unless self-supervised) + TDCL + NDCR against this node's teacher targets.

    ``targets``: prepared ones (tests, benchmarks); else ``start`` prepares them under ``basis``
    from the received model (``targets.node_targets``, its cost in the reply's metrics)."""

    def __init__(self, node: Node, targets: TeacherTargets | None = None, basis: Basis | None = None) -> None:
        self.node, self.targets, self.basis = node, targets, basis
        self.lc = node.cfg.loss
        self.supervised = not node.cfg.self_supervised
        self.gen: torch.Generator | None = None

    def start(self, model: torch.nn.Module) -> dict[str, float]:
        n, cost = self.node, {}
        if self.targets is None:
            p = plan(n.cfg, teacher_spec(n.cfg, _cache_dir(n)), n.data, n.ids)
            self.targets, cost = node_targets(p, self.basis, model, n.device)
            model.train()  # conditioning embeds in eval mode
        self.targets = self.targets.on(n.device, n.ids)
        self.gen = torch.Generator().manual_seed(n.seed)  # negative sampling in TDCL
        return cost

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
