"""FedProx (Li et al., MLSys 2020): a proximal term that keeps local models near the global one.

The server half is Flower's own ``FedProx``: its ``configure_train`` writes ``proximal-mu``
into every train message. The node half adds ``(mu / 2) * ||w - w_global||^2`` over the
trainable parameters to every step's loss; ``mu = 0`` (or no key) is plain training.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from feddifrc_app.halves import Batch, Node, NodeHalf

if TYPE_CHECKING:  # Flower only in types: load_config runs the methods' rules without Flower
    from flwr.app import Message

MU = "proximal-mu"  # server -> node (Flower's FedProx.configure_train): the term's weight


class Proximal(NodeHalf):
    name = "prox"

    def __init__(self, mu: float) -> None:
        self.mu = mu
        self.global_params: list[torch.Tensor] = []

    def start(self, model: torch.nn.Module) -> None:
        self.global_params = [p.detach().clone() for p in model.parameters()]

    def term(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        squares = sum(
            (p - g).pow(2).sum() for p, g in zip(model.parameters(), self.global_params, strict=True)
        )
        return 0.5 * self.mu * squares


def node_half(msg: Message, node: Node) -> Proximal | None:
    mu = float(msg.content["config"].get(MU, 0.0))
    return Proximal(mu) if mu > 0 else None
