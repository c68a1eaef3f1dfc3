"""FedNova (Wang et al., NeurIPS 2020): normalised averaging of heterogeneous local progress.

Node i runs tau_i SGD steps with momentum rho from the global model x; its normalising
factor is ``a_i = (tau_i - rho (1 - rho^tau_i) / (1 - rho)) / (1 - rho)`` (= tau_i without
momentum). Server, with p_i the example weights: ``d_i = (x - y_i) / a_i``,
``tau_eff = sum_i p_i a_i``, ``x <- x - tau_eff * sum_i p_i d_i``. BatchNorm running
statistics are not gradient steps: they are averaged as in FedAvg.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from feddifrc_app.methods import Node, NodeHalf
from feddifrc_app.methods._local_steps import fresh_momentum, normalising_factor
from feddifrc_app.records import arrays_to_record, example_weights, is_bn_statistic

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


class FedNova(FedAvg):
    """FedAvg's sampling and metrics, FedNova's normalised model update."""

    CHECKPOINTED = ("current_arrays",)  # the server state resume restores

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.current_arrays: dict[str, np.ndarray] | None = None

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self.current_arrays = {k: v.numpy() for k, v in arrays.items()}
        config[A_KEY] = True
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        averaged, metrics = super().aggregate_train(server_round, replies)
        p = example_weights([r.content for r in replies])
        a = np.array([float(r.content["metrics"][A_KEY]) for r in replies])
        tau_eff = float(p @ a)
        new = {}
        for k, x_k in self.current_arrays.items():
            if is_bn_statistic(k):
                new[k] = averaged[k].numpy()
                continue
            d = sum(
                p_i / a_i * (x_k - r.content["arrays"][k].numpy())
                for p_i, a_i, r in zip(p, a, replies, strict=True)
            )
            new[k] = (x_k - tau_eff * d).astype(x_k.dtype)
        return arrays_to_record(new), metrics


def strategies() -> dict[str, Any]:
    """``strategy.name`` -> (the run config, the arguments every strategy takes) -> FedNova."""
    return {"fednova": lambda c, k: FedNova(**k)}


def reply_metrics(cfg: Any) -> set[str]:
    """The metric FedNova's aggregation reads off every train reply."""
    return {A_KEY} if cfg.strategy.name == "fednova" else set()
