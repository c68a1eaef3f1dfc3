"""FedNH's node half: gradient clipping at every step, then this node's class prototypes for
the reply (the method: ``fednh/__init__.py``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, Message
from torch import nn

from feddifrc_app.data.loader import make_loader
from feddifrc_app.halves import Node, NodeHalf
from feddifrc_app.methods.fednh import PROTOTYPES
from feddifrc_app.train import clip_gradients


@torch.no_grad()
def class_prototypes(model: nn.Module, loader: Iterable, num_classes: int, device: torch.device):
    """(scaled (C, D), counts (C,)) of this node's data: the upload (``fednh/__init__.py``)."""
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


def node_half(msg: Message, node: Node) -> Prototypes | None:
    return Prototypes(node) if msg.content["config"].get(PROTOTYPES) else None
