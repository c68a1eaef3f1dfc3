"""SCAFFOLD's node half: every step's gradient corrected by ``c - c_i``, then option II's
c_i+ and delta_c_i (the method: ``scaffold/__init__.py``)."""

from __future__ import annotations

from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from feddifrc_app.halves import Node, NodeHalf
from feddifrc_app.methods._local_steps import normalising_factor
from feddifrc_app.methods.scaffold import ACCEPTED, CONTROL, DELTA, OWN, PENDING, PENDING_ROUND
from feddifrc_app.records import record_to_state


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
