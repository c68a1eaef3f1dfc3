"""FedNH's classifier head: class prototypes, frozen on the nodes, moved by the server."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PrototypeHead(nn.Module):
    """FedNH's classifier (Dai et al., AAAI 2023): ``logits = s * cos(z, p_c)`` over frozen class
    prototypes (C, D), orthogonal at init as in the public code's default, with a learnable
    scale s. (B, D) -> (B, C). The server moves the prototypes; clients never train them."""

    def __init__(self, embedding_dim: int, num_classes: int, scale: float) -> None:
        super().__init__()
        # Unit rows also when classes outnumber dimensions (then orthogonal_ gives unit columns).
        protos = F.normalize(nn.init.orthogonal_(torch.rand(num_classes, embedding_dim)), dim=1)
        self.prototype = nn.Parameter(protos, False)
        self.scaling = nn.Parameter(torch.tensor([float(scale)]))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.scaling * F.normalize(z, dim=1, eps=1e-12) @ self.prototype.T
