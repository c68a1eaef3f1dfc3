"""SCAFFOLD (Karimireddy et al., ICML 2020): control variates that correct client drift.

Client i, K local steps of lr eta_l from the global model x, with server / own control
variates c / c_i: every step adds (c - c_i) to the gradient; afterwards (option II)
``c_i+ = c_i - c + (x - y_i) / (K * eta_l)`` and the node sends y_i and
``delta_c_i = c_i+ - c_i``. Server: ``x <- x + eta_g * sum_i w_i (y_i - x)`` (w_i the
example weights, as FedAvg) and ``c <- c + (|S| / N) * mean_i delta_c_i``, with |S| the
nodes that replied and N the federation's distinct nodes. Control variates cover trainable parameters only.

With SGD momentum rho (the paper uses plain SGD), K steps of lr move the model like a_K
plain steps, ``a_K = (K - rho (1 - rho^K) / (1 - rho)) / (1 - rho)`` (FedNova's factor),
so option II divides by ``a_K * lr``; dividing by ``K * lr`` overstates c_i about
1 / (1 - rho) times, and on mnist-5k (rho = 0.9, alpha = 0.05) drove the loss up from
round 2 and the model to chance by round 4. With rho = 0 it is the paper's ``K * lr``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from feddifrc_app.baselines import Node, NodeHalf
from feddifrc_app.baselines.fednova import normalising_factor
from feddifrc_app.records import arrays_to_record, example_weights, is_bn_statistic, record_to_state

CONTROL = "scaffold-c"  # server -> node: the server control variate
DELTA = "scaffold-dc"  # node -> server: the change of the node's control variate
OWN = "scaffold-ci"  # Context.state: this node's control variate, kept across rounds


def correction(
    c: dict[str, torch.Tensor], c_i: dict[str, torch.Tensor], device: torch.device
) -> dict[str, torch.Tensor]:
    """``c - c_i`` by parameter name, moved to ``device`` once (a missing entry is zero: early rounds)."""
    return {k: (c.get(k, 0) - c_i.get(k, 0)).to(device) for k in c.keys() | c_i.keys()}


def correct_gradients(model: torch.nn.Module, corr: dict[str, torch.Tensor]) -> None:
    """``grad += c - c_i`` for every parameter that has a gradient."""
    for name, p in model.named_parameters():
        if p.grad is not None and name in corr:
            p.grad += corr[name]


def control_update(
    x: dict[str, torch.Tensor],
    y: dict[str, torch.Tensor],
    c: dict[str, torch.Tensor],
    c_i: dict[str, torch.Tensor],
    steps: float,
    lr: float,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Option II: (c_i+, delta_c_i) per parameter name in ``y``; x, y, c, c_i by name;
    ``steps`` = K, or the momentum-effective a_K."""
    new, delta = {}, {}
    for name, y_p in y.items():
        zero = torch.zeros_like(y_p)
        old = c_i.get(name, zero)
        new[name] = old - c.get(name, zero) + (x[name] - y_p) / (steps * lr)
        delta[name] = new[name] - old
    return new, delta


class Corrected(NodeHalf):
    """The node half: every step's gradient corrected by ``c - c_i``; afterwards c_i+ kept in
    ``Context.state`` and delta_c_i sent back."""

    def __init__(self, c: dict[str, torch.Tensor], node: Node) -> None:
        self.c, self.node = c, node
        self.c_i = record_to_state(node.state[OWN]) if OWN in node.state else {}
        self.corr = correction(c, self.c_i, node.device)
        self.x: dict[str, torch.Tensor] = {}

    def start(self, model: torch.nn.Module) -> None:
        self.x = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}

    def before_step(self, model: torch.nn.Module) -> None:
        correct_gradients(model, self.corr)

    def finish(self, model: torch.nn.Module, metrics: dict[str, float]) -> dict[str, Any]:
        y = {n: p.detach().cpu() for n, p in model.named_parameters()}
        train = self.node.cfg.train
        # With momentum rho, K steps of lr move the model like a_K plain ones (FedNova's a_i).
        k = normalising_factor(int(metrics["local-steps"]), train.momentum)
        c_new, delta = control_update(self.x, y, self.c, self.c_i, k, train.lr)
        self.node.state[OWN] = ArrayRecord(c_new)
        return {DELTA: ArrayRecord(delta)}


def node_half(msg: Message, node: Node) -> Corrected | None:
    return Corrected(record_to_state(msg.content[CONTROL]), node) if CONTROL in msg.content else None


class Scaffold(FedAvg):
    """FedAvg's sampling and metrics, SCAFFOLD's model and control-variate updates."""

    def __init__(self, *, server_learning_rate: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.eta_g = server_learning_rate
        self.num_nodes = 0  # N: the federation's distinct nodes, from the Grid view of each round
        self.fraction_of_nodes = 0.0  # |S| / N of the last aggregated round, as it really was
        self.current_arrays: dict[str, np.ndarray] | None = None
        self.control: dict[str, np.ndarray] = {}

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self.current_arrays = {k: v.numpy() for k, v in arrays.items()}
        self.num_nodes = grid.num_nodes  # federation.Federation.view
        msgs = list(super().configure_train(server_round, arrays, config, grid))
        for m in msgs:
            m.content[CONTROL] = arrays_to_record(self.control)
        return msgs

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        self.fraction_of_nodes = len(replies) / max(self.num_nodes, 1)
        # Not FedAvg.aggregate_train: it refuses replies that carry a second ArrayRecord (delta c).
        metrics = self.train_metrics_aggr_fn([r.content for r in replies], self.weighted_by_key)
        x = self.current_arrays
        weights = example_weights([r.content for r in replies])
        new = {}
        for k, x_k in x.items():
            step = sum(
                w * (r.content["arrays"][k].numpy() - x_k) for w, r in zip(weights, replies, strict=True)
            )
            eta = 1.0 if is_bn_statistic(k) else self.eta_g  # statistics are averaged, not stepped
            new[k] = (x_k + eta * step).astype(x_k.dtype)
        deltas = [{k: v.numpy() for k, v in r.content[DELTA].items()} for r in replies]
        for k in deltas[0]:
            mean = sum(d[k] for d in deltas) / len(deltas)
            self.control[k] = self.control.get(k, np.zeros_like(mean)) + self.fraction_of_nodes * mean
        return arrays_to_record(new), metrics
