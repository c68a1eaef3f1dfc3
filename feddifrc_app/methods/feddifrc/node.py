"""FedDifRC's node half, message side: the setup reply (teacher identity, PCA statistics) and
the train message's half (``local.FedDifRC`` under the message's basis).

Setup query: the node names its teacher (the server checks that every node runs the same
weights) and, when the query asks for the setup work (``halves.SETUP_WORK``), sends the
sufficient statistics of its pooled teacher features for the federated basis (and, for
``loss.tdcl-targets = "anchors"``, its per-prompt sums: ``anchors.py``). Train message: the
half (``local.FedDifRC``) prepares the node's targets under the message's basis when training
starts, then adds TDCL + NDCR to every step's loss (in place of CE when self-supervised).
"""

from __future__ import annotations

from typing import Any

import torch
from flwr.app import ConfigRecord, Message

from feddifrc_app.files import ensure_writable_dir
from feddifrc_app.halves import SETUP_WORK, Node
from feddifrc_app.methods.feddifrc.anchors import ANCHORS
from feddifrc_app.methods.feddifrc.local import FedDifRC, cache_dir
from feddifrc_app.methods.feddifrc.projection import Basis
from feddifrc_app.methods.feddifrc.targets import node_stats, plan, require_basis
from feddifrc_app.methods.feddifrc.teacher import teacher_spec
from feddifrc_app.records import arrays_to_record, record_to_arrays

BASIS = "basis"  # server -> node, train message: the shared basis (projection.Basis.to_arrays)
STATS = "pca-stats"  # node -> server, setup reply: the statistics (projection.stats_to_arrays)
_CACHE_KEY = "cache-dir (node-config, else diffusion.cache-dir)"  # named in its errors


def setup_reply(msg: Message, node: Node, info: ConfigRecord) -> dict[str, Any]:
    """The teacher's identity in ``info`` and, when asked, this node's PCA statistics."""
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
    anchors (each refused before any teacher work if the config needs it and the message has none)."""
    basis = Basis.from_arrays(record_to_arrays(msg.content[BASIS])) if BASIS in msg.content else None
    require_basis(node.cfg, basis)
    anchors = None
    if ANCHORS in msg.content:
        anchors = torch.from_numpy(record_to_arrays(msg.content[ANCHORS])[ANCHORS])
    elif node.cfg.loss.tdcl_targets == "anchors":
        raise ValueError("loss.tdcl-targets = 'anchors' but the server sent no anchors")
    return FedDifRC(node, basis=basis, anchors=anchors)
