"""FedNH (Dai et al., AAAI 2023): class prototypes as the classifier, moved by the server.

Nodes train the network under frozen prototypes (``model.PrototypeHead``) and then send,
per class c they hold, ``n_c * normalise(mean of the normalised embeddings)`` and ``n_c``.
The server (as FedNH's public code): ``avg_c = normalise(sum_i scaled_ic / sum_i n_ic)``,
``p_c <- normalise(rho * p_c + (1 - rho) * avg_c)``; a class no node holds keeps p_c. The
rest of the model is averaged as in FedAvg. Local training clips the gradient norm of the
trainable parameters at ``fednh.max-grad-norm`` (FedNH's code: ``clip_grad_norm_(..., 10)``
after every backward), and the head's scale starts at ``fednh.scale`` (FedNH's ResNet: 20).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Strategy
from torch import nn

from feddifrc_app.casting import invalid
from feddifrc_app.config import Config
from feddifrc_app.data.loader import make_loader
from feddifrc_app.methods import Node, NodeHalf
from feddifrc_app.privacy import TWO_RECORDS
from feddifrc_app.records import arrays_to_record, example_weights

# server -> node config: "send your prototypes"; node -> server: {"scaled": (C, D), "counts": (C,)}
PROTOTYPES = "fednh-prototypes"
KEY = "fc.prototype"  # the prototypes in the model's state dict


def check_config(v: Mapping[str, Any], raw: Mapping[str, Any]) -> None:
    if v["method"] == "fednh" and v["strategy.name"] != "fedavg":
        raise invalid(
            "strategy.name", v["strategy.name"], "method 'fednh' brings its own aggregation: use 'fedavg'"
        )


def dp_refusal(v: Mapping[str, Any]) -> str:
    # Server-side clipping would clip the prototypes against the model; the client mods refuse them.
    return f"method = 'fednh' {TWO_RECORDS}" if v["method"] == "fednh" else ""


def own_strategy(cfg: Config, common: dict[str, Any]) -> Strategy | None:
    """FedAvg for the network, FedNH for the prototypes (in place of strategy.name's FedAvg)."""
    return FedNH(**common, rho=cfg.fednh.rho) if cfg.method == "fednh" else None


@torch.no_grad()
def class_prototypes(model: nn.Module, loader: Iterable, num_classes: int, device: torch.device):
    """(scaled (C, D), counts (C,)) of this node's data: the upload above."""
    model.to(device).eval()
    sums = torch.zeros(num_classes, model.embedding_dim, device=device)
    counts = torch.zeros(num_classes, device=device)
    for x, y, _ in loader:
        z = F.normalize(model.embed(x.to(device)), dim=1, eps=1e-12)
        y = y.to(device)
        sums.index_add_(0, y, z)
        counts.index_add_(0, y, torch.ones_like(y, dtype=counts.dtype))
    scaled = F.normalize(sums / counts.clamp(min=1).unsqueeze(1), dim=1) * counts.unsqueeze(1)
    return scaled.cpu(), counts.cpu()


def clip_gradients(model: nn.Module, max_norm: float) -> None:
    """FedNH's step: the trainable parameters' gradient norm clipped at ``max_norm`` (0 = none)."""
    if max_norm > 0:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_norm)


class Prototypes(NodeHalf):
    """The node half: every step's gradients clipped; after training, this node's class
    prototypes for the reply."""

    def __init__(self, node: Node) -> None:
        self.node = node

    def before_step(self, model: nn.Module) -> None:
        clip_gradients(model, self.node.cfg.fednh.max_grad_norm)

    def finish(self, model: nn.Module, metrics: dict[str, float]) -> dict[str, Any]:
        n = self.node
        loader = make_loader(n.data, n.ids, train=False, batch_size=n.cfg.train.eval_batch_size, seed=n.seed)
        scaled, counts = class_prototypes(model, loader, n.data.num_classes, n.device)
        return {PROTOTYPES: ArrayRecord({"scaled": scaled, "counts": counts})}


def model_options(cfg: Config) -> dict[str, Any]:
    """FedNH's classifier is its prototype head (``model.PrototypeHead``)."""
    return {"prototype_scale": cfg.fednh.scale} if cfg.method == "fednh" else {}


def node_half(msg: Message, node: Node) -> Prototypes | None:
    return Prototypes(node) if msg.content["config"].get(PROTOTYPES) else None


def smooth(old: np.ndarray, scaled: list[np.ndarray], counts: list[np.ndarray], rho: float) -> np.ndarray:
    """The server's prototype update: old (C, D), per node scaled (C, D) and counts (C,)."""
    total = sum(counts)
    avg = sum(scaled) / np.maximum(total, 1e-12)[:, None]
    avg = avg / np.maximum(np.linalg.norm(avg, axis=1, keepdims=True), 1e-12)
    new = rho * old + (1 - rho) * avg
    new = new / np.maximum(np.linalg.norm(new, axis=1, keepdims=True), 1e-12)
    return np.where((total > 0)[:, None], new, old).astype(old.dtype)


class FedNH(FedAvg):
    """FedAvg for the network, FedNH's smoothing for the prototypes."""

    def __init__(self, *, rho: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.rho = rho

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        config[PROTOTYPES] = True
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        # Not FedAvg.aggregate_train: it refuses replies that carry a second ArrayRecord.
        contents = [r.content for r in replies]
        metrics = self.train_metrics_aggr_fn(contents, self.weighted_by_key)
        weights = example_weights(contents)
        arrays = {
            k: sum(w * c["arrays"][k].numpy() for w, c in zip(weights, contents, strict=True))
            for k in contents[0]["arrays"]
        }
        # Frozen on the nodes: every reply holds the prototypes the server sent.
        old = contents[0]["arrays"][KEY].numpy()
        scaled = [c[PROTOTYPES]["scaled"].numpy() for c in contents]
        counts = [c[PROTOTYPES]["counts"].numpy() for c in contents]
        arrays[KEY] = smooth(old, scaled, counts, self.rho)
        return arrays_to_record({k: np.asarray(v, dtype=np.float32) for k, v in arrays.items()}), metrics
