"""Strategy factory: ``strategy.name`` picks the server-side aggregation.

Flower's own ``flwr.serverapp.strategy`` classes (FedAvg, FedAvgM, FedProx, FedAdam, FedYogi,
FedAdagrad, FedMedian, FedTrimmedAvg) and the baselines' server halves that Flower lacks
(``baselines/``: SCAFFOLD, FedNova; FedNH for ``method = "fednh"``); their hyper-parameters
are ``strategy.*`` config keys. Minimum node counts are derived from the number of connected
partitions so that a run never waits forever for nodes that do not exist. The strategy's
state (server momentum, control variates, prototypes) is what a checkpoint keeps of it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord
from flwr.serverapp.strategy import (
    FedAdagrad,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedMedian,
    FedProx,
    FedTrimmedAvg,
    FedYogi,
    Strategy,
)

from feddifrc_app.baselines.fednh import FedNH
from feddifrc_app.baselines.fednova import FedNova
from feddifrc_app.baselines.scaffold import Scaffold
from feddifrc_app.config import Config


def nodes_per_round(cfg: Config, num_nodes: int) -> int:
    """Nodes sampled per round: ``fraction-train`` of the connected nodes, at least 1."""
    return max(1, int(math.floor(num_nodes * cfg.fraction_train + 1e-9)))


def build_strategy(cfg: Config) -> Strategy:
    """The strategy named by ``strategy.name``."""
    s = cfg.strategy
    # The ServerApp samples ``fraction-train`` of the nodes itself (seeded, by partition id) and
    # shows the strategy only the chosen ones, so the strategy takes all it is shown and never
    # waits for a minimum: a node that died mid-run cannot stall the next round. The same for
    # ``fraction-evaluate`` (federated_eval.py): 1.0 of the nodes sampled for evaluation, or none.
    common = dict(
        fraction_train=1.0,
        fraction_evaluate=1.0 if cfg.fraction_evaluate > 0 else 0.0,
        min_train_nodes=1,
        min_evaluate_nodes=1 if cfg.fraction_evaluate > 0 else 0,
        min_available_nodes=1,
    )
    name = s.name
    if cfg.method == "fednh":  # FedAvg for the network, FedNH for the prototypes
        return FedNH(**common, rho=cfg.fednh.rho)
    if name == "fedavg":
        return FedAvg(**common)
    if name == "fedprox":
        return FedProx(**common, proximal_mu=s.proximal_mu)
    if name == "fedavgm":
        return FedAvgM(
            **common, server_learning_rate=s.server_learning_rate, server_momentum=s.server_momentum
        )
    fedopt = dict(eta=s.eta, eta_l=s.eta_l, tau=s.tau)
    if name == "fedadam":
        return FedAdam(**common, **fedopt, beta_1=s.beta_1, beta_2=s.beta_2)
    if name == "fedyogi":
        return FedYogi(**common, **fedopt, beta_1=s.beta_1, beta_2=s.beta_2)
    if name == "fedadagrad":
        return FedAdagrad(**common, **fedopt)
    if name == "fedmedian":
        return FedMedian(**common)
    if name == "fedtrimmedavg":
        return FedTrimmedAvg(**common, beta=s.trim_beta)
    if name == "scaffold":
        return Scaffold(**common, server_learning_rate=s.server_learning_rate)
    if name == "fednova":
        return FedNova(**common)
    raise ValueError(f"unknown strategy {name!r}")  # unreachable: load_config validated it


# Server-side optimiser state that must survive a resume for the numbers to match.
_STATE_ATTRS = ("current_arrays", "m_t", "v_t", "momentum_vector", "control")


def strategy_state(strategy: Strategy) -> dict[str, dict[str, Any]]:
    """The strategy's mutable server state (FedOpt moments, FedAvgM momentum) as plain tensors,
    so a checkpoint loads with ``torch.load(weights_only=True)``."""
    out: dict[str, dict[str, Any]] = {}
    for a in _STATE_ATTRS:
        v = getattr(strategy, a, None)
        if isinstance(v, ArrayRecord):
            out[a] = {"record": v.to_torch_state_dict()}
        elif isinstance(v, dict):
            out[a] = {"dict": {k: torch.from_numpy(np.asarray(x)) for k, x in v.items()}}
        elif isinstance(v, list):
            out[a] = {"list": [torch.from_numpy(np.asarray(x)) for x in v]}
        elif v is not None:
            raise TypeError(f"cannot checkpoint strategy state {a!r} of type {type(v).__name__}")
    return out


def load_strategy_state(strategy: Strategy, state: dict[str, dict[str, Any]]) -> None:
    for a, packed in state.items():
        if a not in _STATE_ATTRS:
            raise KeyError(f"unexpected strategy state {a!r} in checkpoint")
        ((kind, v),) = packed.items()
        if kind == "record":
            setattr(strategy, a, ArrayRecord(v))
        elif kind == "dict":
            setattr(strategy, a, {k: x.numpy() for k, x in v.items()})
        else:
            setattr(strategy, a, [x.numpy() for x in v])
