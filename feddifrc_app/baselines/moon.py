"""MOON (Li et al., CVPR 2021): CE + mu * a model-contrastive term on each node.

The representation is the ResNet-10 embedding z that every method in this app shares
(MOON's code adds a 2-layer projection head; we keep one network for all methods, so the
comparison isolates the loss). The negative is the node's own previous local model, kept
in ``Context.state``; a node without one (its first round) trains with CE alone, as in
MOON's code, where the single-column contrastive loss is exactly 0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from feddifrc_app.losses import moon_contrastive

PREVIOUS = "moon-previous"  # Context.state: this node's model after its last local training


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
