"""MOON (Li et al., CVPR 2021): CE + mu * a model-contrastive term on each node.

The representation is the ResNet-10 embedding z that every method in this app shares
(MOON's code adds a 2-layer projection head; we keep one network for all methods, so the
comparison isolates the loss). The negative is the node's own previous local model, kept
in ``Context.state``; a node without one (its first round) trains with CE alone, as in
MOON's code, where the single-column contrastive loss is exactly 0.

Server half: ``moon-mu`` and ``moon-tau`` in every train message of a ``method = "moon"`` run,
under any strategy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from feddifrc_app.casting import MIN_TEMPERATURE
from feddifrc_app.config import Config, key
from feddifrc_app.halves import Batch, Node, NodeHalf
from feddifrc_app.methods import model_for
from feddifrc_app.model import load_weights

# Flower only in types and where a node trains (records, imported in Moon): load_config runs
# node_state where Flower is not installed.
if TYPE_CHECKING:
    from flwr.app import Message

NAMES = ("moon",)  # the method values of this module


@dataclass(frozen=True)
class MoonConfig:
    mu: float = key(lo=0.0)  # weight of the model-contrastive term (MOON: 5 for CIFAR-10, 1 otherwise)
    tau: float = key(lo=MIN_TEMPERATURE)  # its temperature (MOON: 0.5); MIN_TEMPERATURE: casting.py


SECTIONS = {"moon": MoonConfig}
PREVIOUS = "moon-previous"  # Context.state: this node's model after its last local training
MU, TAU = "moon-mu", "moon-tau"  # server -> node: the term's weight and temperature


def node_state(v: Mapping[str, Any]) -> str:
    return "method = 'moon'" if v["method"] == "moon" else ""  # PREVIOUS


def train_config(cfg: Config) -> dict[str, Any]:
    return {MU: cfg.moon.mu, TAU: cfg.moon.tau} if cfg.method == "moon" else {}


def moon_contrastive(z: Tensor, z_global: Tensor, z_prev: Tensor, temperature: float) -> Tensor:
    """MOON's model-contrastive loss (Li et al., CVPR 2021), 0-dim: the local representation
    ``z`` (B, D) is pulled to the global model's ``z_global`` (B, D) and pushed from the
    previous local model's ``z_prev`` (B, D): cross-entropy over cosine / temperature with
    the positive in column 0."""
    logits = torch.stack(
        [F.cosine_similarity(z, z_global, dim=-1), F.cosine_similarity(z, z_prev, dim=-1)], 1
    )
    return F.cross_entropy(logits / temperature, torch.zeros(z.shape[0], dtype=torch.long, device=z.device))


def regulariser(
    global_model: nn.Module, previous: nn.Module, mu: float, tau: float, device: torch.device
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``(x, z) -> mu * L_con(z, z_global(x), z_previous(x))`` with both reference models frozen."""
    for m in (global_model, previous):
        m.to(device).eval().requires_grad_(False)

    def term(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            z_global, z_prev = global_model(x)[0], previous(x)[0]
        return mu * moon_contrastive(z, z_global, z_prev, tau)

    return term


class Moon(NodeHalf):
    name = "moon"

    def __init__(self, mu: float, tau: float, node: Node) -> None:
        self.mu, self.tau, self.node = mu, tau, node
        self.reg: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def start(self, model: nn.Module) -> None:
        """The received global model and this node's previous local model, frozen (if it has one)."""
        if PREVIOUS not in self.node.state:
            return
        from feddifrc_app.records import record_to_state  # Flower's records (see above)

        cfg, num_classes = self.node.cfg, self.node.data.num_classes
        global_model, previous = model_for(cfg, num_classes), model_for(cfg, num_classes)
        global_model.load_state_dict(model.state_dict())
        load_weights(previous, record_to_state(self.node.state[PREVIOUS]))
        self.reg = regulariser(global_model, previous, self.mu, self.tau, self.node.device)

    def term(self, model: nn.Module, batch: Batch) -> torch.Tensor | None:
        return None if self.reg is None else self.reg(batch.x, batch.z)

    def divergence_remedy(self) -> str:
        return f"raise moon.tau (= {self.tau:g})"

    def finish(self, model: nn.Module, metrics: dict[str, float]) -> dict[str, Any]:
        from feddifrc_app.records import state_to_record  # Flower's records (see above)

        self.node.state[PREVIOUS] = state_to_record(model.state_dict())
        return {}


def node_half(msg: Message, node: Node) -> Moon | None:
    config = msg.content["config"]
    return Moon(float(config[MU]), float(config[TAU]), node) if MU in config else None
