"""FedDifRC's node half: the setup reply (teacher identity, PCA statistics), the train message's
half and its part of local training.

Setup query: the node names its teacher (the server checks that every node runs the same
weights) and, when the query asks for the setup work (``halves.SETUP_WORK``), sends the
sufficient statistics of its pooled teacher features for the federated basis (and, for
``loss.tdcl-targets = "anchors"``, its per-prompt sums: ``projection.prompt_sums``). Train
message: the message is checked here, once, and the node's plan resolved (``node_half``: the
teacher spec, prompts and feature-cache key, kept for the process) and, with the message's
basis, the targets' key (``FedDifRC``); ``FedDifRC.start`` prepares the node's targets by that
plan under the message's basis and anchors with one call (``targets.node_targets``), then every
step's loss is CE (none when self-supervised) + TDCL + NDCR against them.

Flower-free at import, as ``train.py``: a tool or benchmark runs ``FedDifRC`` without Flower
installed (``benchmarks/gpu_check.py``); the message side imports Flower's records when it runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from feddifrc_app.data.loader import clean_batch
from feddifrc_app.files import ensure_writable_dir
from feddifrc_app.halves import SETUP_WORK, Batch, Node, NodeHalf
from feddifrc_app.methods.feddifrc import losses
from feddifrc_app.methods.feddifrc.projection import ANCHORS, BASIS, STATS, Basis
from feddifrc_app.methods.feddifrc.rules import resolve_cache_dir, self_supervised
from feddifrc_app.methods.feddifrc.targets import Plan, TeacherTargets, node_stats, node_targets, plan
from feddifrc_app.methods.feddifrc.teacher import teacher_spec

if TYPE_CHECKING:
    from flwr.app import ConfigRecord, Message

_CACHE_KEY = "cache-dir (node-config, else diffusion.cache-dir)"  # named in its errors


def cache_dir(node: Node) -> Path:
    """The node's teacher cache folder (its node config's cache-dir, else diffusion.cache-dir)."""
    return resolve_cache_dir(node.cfg, node.config.cache_dir, "node cache-dir")


def node_plan(node: Node) -> Plan:
    """This node's targets plan (``targets.plan``, kept for the process)."""
    return plan(node.cfg, teacher_spec(node.cfg, cache_dir(node)), node.data, node.ids)


def setup_reply(msg: Message, node: Node, info: ConfigRecord) -> dict[str, Any]:
    """The teacher's identity in ``info`` and, when asked, this node's PCA statistics."""
    from feddifrc_app.records import arrays_to_record

    cfg = node.cfg
    # No SD load; no GPU for diffusion.device = 'cuda' fails here.
    spec = teacher_spec(cfg, ensure_writable_dir(cache_dir(node), _CACHE_KEY))
    info["teacher-model"] = spec.identity.model_id
    info["teacher-random-weights"] = bool(spec.identity.random_weights)
    info["teacher-weights"] = spec.identity.weights_hash  # the server checks that all nodes agree
    info["teacher-device"] = spec.where  # where this node's teacher runs, the dtype in its cache key
    if not bool(msg.content["config"][SETUP_WORK]):
        return {}
    arrays, stats = node_stats(plan(cfg, spec, node.data, node.ids))  # once, for the federated basis
    info["teacher-seconds"] = float(stats.seconds)
    info["teacher-cache-misses"] = int(stats.misses)
    return {STATS: arrays_to_record(arrays)}


def node_half(msg: Message, node: Node) -> FedDifRC:
    """The train message's half: its basis and, under ``loss.tdcl-targets = "anchors"``, the
    anchors, each refused here (before any teacher work) if the config needs it and the message
    has none; then the node's plan (the teacher spec resolved, kept for the process)."""
    from feddifrc_app.records import record_to_arrays

    basis = Basis.from_arrays(record_to_arrays(msg.content[BASIS])) if BASIS in msg.content else None
    if node.cfg.diffusion.projection == "federated-pca" and basis is None:
        raise ValueError("diffusion.projection = 'federated-pca' but the server sent no basis")
    anchors = None
    if ANCHORS in msg.content:
        anchors = torch.from_numpy(record_to_arrays(msg.content[ANCHORS])[ANCHORS])
    elif node.cfg.loss.tdcl_targets == "anchors":
        raise ValueError("loss.tdcl-targets = 'anchors' but the server sent no anchors")
    return FedDifRC(node, basis=basis, anchors=anchors, plan=node_plan(node))


class FedDifRC(NodeHalf):
    """CE (unless self-supervised) + TDCL + NDCR against this node's teacher targets.

    ``targets``: prepared ones (tests, benchmarks); else ``start`` prepares them by ``plan``
    under ``basis`` and ``anchors`` from the received model (``targets.node_targets``, its cost in
    the reply's metrics).
    ``anchors`` (K, D): the server's class anchors, which replace every image's TDCL targets (of
    a plan's targets: prepared ones are taken as they are given)."""

    def __init__(
        self,
        node: Node,
        targets: TeacherTargets | None = None,
        basis: Basis | None = None,
        anchors: torch.Tensor | None = None,
        plan: Plan | None = None,
    ) -> None:
        if anchors is not None and plan is None:
            raise ValueError("FedDifRC: anchors replace the targets of a plan (node_half gives one)")
        self.node, self.targets, self.basis, self.anchors, self.plan = node, targets, basis, anchors, plan
        # The targets' key, resolved with the message (the basis fingerprinted once, here).
        self.key = None if plan is None else plan.key(basis)
        self.lc = node.cfg.loss
        self.supervised = not self_supervised(node.cfg)
        self.gen: torch.Generator | None = None

    def start(self, model: torch.nn.Module) -> dict[str, float]:
        n, cost = self.node, {}
        if self.targets is None:
            if self.plan is None:
                raise ValueError(
                    "FedDifRC.start: no targets, and no plan to prepare them (node_half has one)"
                )
            self.targets, cost = node_targets(self.plan, self.key, self.basis, self.anchors, model, n.device)
            model.train()  # conditioning embeds in eval mode
        self.targets = self.targets.on(n.device, n.ids)  # anchored: the (K, D) anchors move, not n copies
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
