"""FedDifRC (and its self-supervised variant ``feddifrc-ssl``): the diffusion teacher's targets
(TDCL + NDCR) and the federated basis, plugged in through the methods protocol (``methods``).

- node half (``node.py``): the setup reply (teacher identity, PCA statistics), the train
  message's half and its loss against the targets (``targets.py``: features -> basis -> fused
  targets, in numbered steps, kept per process and on disk; ``teacher.py``: the teacher's
  features; ``losses.py``: TDCL and NDCR);
- server half (``server.py``): teacher checks, the federated basis (``projection.py``; for the
  TDCL-anchors control ``loss.tdcl-targets = "anchors"``, the class anchors too), records for
  every train message, its checkpointed state;
- central evaluation of ``feddifrc-ssl`` (``probe.py``): a linear probe, no classifier head.

The hooks import their halves when called: the package itself loads without Flower (``node.py``'s
``FedDifRC`` runs in tools that have none).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from feddifrc_app.config import Config
from feddifrc_app.halves import Node
from feddifrc_app.methods.feddifrc.rules import self_supervised, uses_diffusion

if TYPE_CHECKING:
    from flwr.app import ConfigRecord, Message

    from feddifrc_app.methods.feddifrc.node import FedDifRC
    from feddifrc_app.methods.feddifrc.probe import LinearProbe
    from feddifrc_app.methods.feddifrc.server import FedDifRCServer

# The results.json keys the server half sets (server.py), checked on load (methods.results_keys).
RESULTS = {"basis": dict, "setup-cache-misses": int, "teacher": dict}


def setup_reply(msg: Message, n: Node, info: ConfigRecord) -> dict[str, Any]:
    from feddifrc_app.methods.feddifrc import node

    return node.setup_reply(msg, n, info) if uses_diffusion(n.cfg) else {}


def node_half(msg: Message, n: Node) -> FedDifRC | None:
    from feddifrc_app.methods.feddifrc import node

    return node.node_half(msg, n) if uses_diffusion(n.cfg) else None


def server_half(cfg: Config) -> FedDifRCServer | None:
    from feddifrc_app.methods.feddifrc.server import FedDifRCServer

    return FedDifRCServer(cfg) if uses_diffusion(cfg) else None


def central_evaluation(cfg: Config, loader: Callable, device: torch.device) -> LinearProbe | None:
    from feddifrc_app.methods.feddifrc.probe import LinearProbe

    return LinearProbe(cfg, loader, device) if self_supervised(cfg) else None
