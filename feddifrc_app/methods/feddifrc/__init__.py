"""FedDifRC (and its self-supervised variant ``feddifrc-ssl``): the diffusion teacher's targets
(TDCL + NDCR) and the federated basis, plugged in through the methods protocol (``methods``).

- node half (``node.py``): the setup reply (teacher identity, PCA statistics) and the local loss
  against the targets (``targets.py``: teacher spec -> features -> basis -> fused targets);
- server half (``server.py``): teacher checks, the federated basis, records for every train
  message, its checkpointed state;
- central evaluation of ``feddifrc-ssl`` (``probe.py``): a linear probe, no classifier head.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from flwr.app import ConfigRecord, Message

from feddifrc_app.config import Config
from feddifrc_app.methods import Node
from feddifrc_app.methods.feddifrc import node, probe, server


def setup_reply(msg: Message, n: Node, info: ConfigRecord) -> dict[str, Any]:
    return node.setup_reply(msg, n, info) if n.cfg.uses_diffusion else {}


def node_half(msg: Message, n: Node) -> node.FedDifRC | None:
    return node.node_half(msg, n) if n.cfg.uses_diffusion else None


def server_half(cfg: Config) -> server.FedDifRCServer | None:
    return server.FedDifRCServer(cfg) if cfg.uses_diffusion else None


def central_evaluation(cfg: Config, loader: Callable, device: torch.device) -> probe.LinearProbe | None:
    return probe.LinearProbe(cfg, loader, device) if cfg.self_supervised else None
