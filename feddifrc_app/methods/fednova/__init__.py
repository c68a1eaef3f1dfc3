"""FedNova (Wang et al., NeurIPS 2020): normalised averaging of heterogeneous local progress.

Node i runs tau_i SGD steps with momentum rho from the global model x; its normalising
factor is ``a_i = (tau_i - rho (1 - rho^tau_i) / (1 - rho)) / (1 - rho)`` (= tau_i without
momentum). Server, with p_i the example weights: ``d_i = (x - y_i) / a_i``,
``tau_eff = sum_i p_i a_i``, ``x <- x - tau_eff * sum_i p_i d_i``. BatchNorm running
statistics are not gradient steps: they are averaged as in FedAvg.

Here: the record key, the config rules and the node half (Flower-free: ``load_config`` runs the
rules where Flower is not installed); the strategy in ``server.py``, imported when one is built.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from feddifrc_app.halves import Node, NodeHalf
from feddifrc_app.methods._local_steps import fresh_momentum, normalising_factor

if TYPE_CHECKING:
    from flwr.app import Message

A_KEY = "fednova-a"  # server -> node config: "report a_i"; node -> server metric: a_i


def check_config(v: Mapping[str, Any], raw: Mapping[str, Any]) -> None:
    if v["strategy.name"] == "fednova":
        fresh_momentum(v)


def dp_refusal(v: Mapping[str, Any]) -> str:
    if v["strategy.name"] != "fednova":
        return ""
    # x <- x - tau_eff sum_i p_i (x - y_i) / a_i: a node with fewer local steps than tau_eff
    # moves the model by more than its clipped update, so the noise (z C / m) is too small.
    return (
        "strategy.name = 'fednova' scales each clipped update by tau_eff / a_i (above 1 for a node "
        "with fewer local steps) and weighs it by its examples, so one node's influence exceeds "
        "the C / m that Flower's noise is calibrated for; use fedavg or fedprox"
    )


class Normalised(NodeHalf):
    """The node half: report a_i of the steps this node ran."""

    def __init__(self, momentum: float) -> None:
        self.momentum = momentum

    def finish(self, model: torch.nn.Module, metrics: dict[str, float]) -> dict[str, Any]:
        metrics[A_KEY] = normalising_factor(int(metrics["local-steps"]), self.momentum)
        return {}


def node_half(msg: Message, node: Node) -> Normalised | None:
    return Normalised(node.cfg.train.momentum) if msg.content["config"].get(A_KEY) else None


# The strategies this package brings (``strategies``) -> the strategy.* keys that shape their aggregate.
STRATEGIES: dict[str, tuple[str, ...]] = {"fednova": ()}


def strategies() -> dict[str, Any]:
    """``strategy.name`` -> (the run config, the arguments every strategy takes) -> FedNova."""
    from feddifrc_app.methods.fednova.server import FedNova

    return {"fednova": lambda c, k: FedNova(**k)}


def reply_metrics(cfg: Any) -> set[str]:
    """The metric FedNova's aggregation reads off every train reply."""
    return {A_KEY} if cfg.strategy.name == "fednova" else set()
