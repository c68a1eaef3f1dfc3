"""SCAFFOLD (Karimireddy et al., ICML 2020): control variates that correct client drift.

Client i, K local steps of lr eta_l from the global model x, with server / own control
variates c / c_i: every step adds (c - c_i) to the gradient; afterwards (option II)
``c_i+ = c_i - c + (x - y_i) / (K * eta_l)`` and the node sends y_i and
``delta_c_i = c_i+ - c_i``. Server: ``x <- x + eta_g * sum_i w_i (y_i - x)`` (w_i the
example weights, as FedAvg) and ``c <- c + (|S| / N) * mean_i delta_c_i``, with |S| the
nodes that replied and N the federation's distinct nodes: the train config's ``num-nodes``
(``federation.NUM_NODES``, set by the round loop) or, without it, the nodes the Grid has (all
that Flower's own ``Strategy.start`` samples from). Control variates cover trainable parameters only.

A node's new c_i counts only once the server has added its delta_c_i to c: the node keeps
c_i+ as pending (with its round) and each train message tells it the last round whose
delta_c_i from it the server accepted (``ACCEPTED``). A round whose aggregate the server
rejects (non-finite: ``rounds.RoundLoop`` restores the strategy state, so also ``accepted``),
and a reply that never arrived, leave both c and c_i as they were: c = (1/N) sum_i c_i holds.

With SGD momentum rho (the paper uses plain SGD), K steps of lr move the model like a_K
plain steps, ``a_K = (K - rho (1 - rho^K) / (1 - rho)) / (1 - rho)`` (FedNova's factor),
so option II divides by ``a_K * lr``; dividing by ``K * lr`` overstates c_i about
1 / (1 - rho) times, and on mnist-5k (rho = 0.9, alpha = 0.05) drove the loss up from
round 2 and the model to chance by round 4. With rho = 0 it is the paper's ``K * lr``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from feddifrc_app.federation import NUM_NODES
from feddifrc_app.methods import Node, NodeHalf
from feddifrc_app.methods._local_steps import fresh_momentum, normalising_factor
from feddifrc_app.privacy import TWO_RECORDS
from feddifrc_app.records import arrays_to_record, example_weights, is_bn_statistic, record_to_state

CONTROL = "scaffold-c"  # server -> node: the server control variate
DELTA = "scaffold-dc"  # node -> server: the change of the node's control variate
OWN = "scaffold-ci"  # Context.state: this node's control variate, kept across rounds
PENDING = "scaffold-ci-pending"  # Context.state: c_i+ of the node's last training, not yet confirmed
PENDING_ROUND = "scaffold-ci-round"  # Context.state: {"round": the round that c_i+ is from}
ACCEPTED = "scaffold-accepted"  # server -> node config: last round whose delta_c_i from it made c


def check_config(v: Mapping[str, Any], raw: Mapping[str, Any]) -> None:
    if v["strategy.name"] == "scaffold":
        fresh_momentum(v)  # option II divides by FedNova's a_K


def node_state(v: Mapping[str, Any]) -> str:
    return "strategy.name = 'scaffold'" if v["strategy.name"] == "scaffold" else ""


def dp_refusal(v: Mapping[str, Any]) -> str:
    # Server-side clipping would clip delta c against the model; the client mods refuse it.
    return f"strategy.name = 'scaffold' {TWO_RECORDS}" if v["strategy.name"] == "scaffold" else ""


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


def confirmed_control(state: RecordDict, accepted: int) -> dict[str, torch.Tensor]:
    """This node's c_i: its pending c_i+ becomes c_i if the server accepted that round's
    delta_c_i (``accepted`` is the round), else it is dropped; either way it is pending no more."""
    if PENDING in state:
        if int(state[PENDING_ROUND]["round"]) == accepted:
            state[OWN] = state[PENDING]
        del state[PENDING], state[PENDING_ROUND]
    return record_to_state(state[OWN]) if OWN in state else {}


class Corrected(NodeHalf):
    """The node half: every step's gradient corrected by ``c - c_i``; afterwards c_i+ kept in
    ``Context.state`` as pending (until the server confirms it) and delta_c_i sent back."""

    def __init__(self, c: dict[str, torch.Tensor], node: Node, server_round: int, accepted: int) -> None:
        self.c, self.node, self.round = c, node, server_round
        self.c_i = confirmed_control(node.state, accepted)
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
        self.node.state[PENDING] = ArrayRecord(c_new)
        self.node.state[PENDING_ROUND] = ConfigRecord({"round": self.round})
        return {DELTA: ArrayRecord(delta)}


def node_half(msg: Message, node: Node) -> Corrected | None:
    if CONTROL not in msg.content:
        return None
    config = msg.content["config"]
    c = record_to_state(msg.content[CONTROL])
    return Corrected(c, node, int(config["server-round"]), int(config[ACCEPTED]))


class Scaffold(FedAvg):
    """FedAvg's sampling and metrics, SCAFFOLD's model and control-variate updates."""

    CHECKPOINTED = ("current_arrays", "control", "accepted")  # the server state resume restores

    def __init__(self, *, server_learning_rate: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.eta_g = server_learning_rate
        self.num_nodes = 0  # N of the round being trained
        self.fraction_of_nodes = 0.0  # |S| / N of the last aggregated round, as it really was
        self.current_arrays: dict[str, np.ndarray] | None = None
        self.control: dict[str, np.ndarray] = {}
        self.accepted: dict[int, int] = {}  # node id -> last round its delta_c_i was added to c

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self.current_arrays = {k: v.numpy() for k, v in arrays.items()}
        self.num_nodes = int(config.get(NUM_NODES, len(grid.get_node_ids())))
        control = arrays_to_record(self.control)
        out = []
        for m in super().configure_train(server_round, arrays, config, grid):
            # One content per node (FedAvg shares one): each node is told its own accepted round.
            dst = m.metadata.dst_node_id
            node_config = ConfigRecord({**m.content["config"], ACCEPTED: int(self.accepted.get(dst, 0))})
            content = RecordDict({"arrays": arrays, "config": node_config, CONTROL: control})
            out.append(Message(content=content, message_type=m.metadata.message_type, dst_node_id=dst))
        return out

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
        self.accepted |= {r.metadata.src_node_id: server_round for r in replies}
        return arrays_to_record(new), metrics


def strategies() -> dict[str, Any]:
    """``strategy.name`` -> (the run config, the arguments every strategy takes) -> SCAFFOLD."""
    return {"scaffold": lambda c, k: Scaffold(**k, server_learning_rate=c.strategy.server_learning_rate)}
