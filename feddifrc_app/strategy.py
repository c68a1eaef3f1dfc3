"""Strategy factory: ``strategy.name`` picks the server-side aggregation.

Flower's own ``flwr.serverapp.strategy`` classes (FedAvg, FedAvgM, FedProx, FedAdam, FedYogi,
FedAdagrad, FedMedian, FedTrimmedAvg, Krum, MultiKrum, Bulyan, QFedAvg) and the baselines'
server halves that Flower lacks (``methods/``: SCAFFOLD, FedNova; FedNH for
``method = "fednh"``); their hyper-parameters are ``strategy.*`` config keys with Flower's
defaults. Minimum node counts are derived from the number of connected partitions so that a
run never waits forever for nodes that do not exist. The strategy's state (server momentum,
control variates, prototypes) is what a checkpoint keeps of it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid
from flwr.serverapp import strategy as flwr_strategy
from flwr.serverapp.strategy import (
    FedAdagrad,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedMedian,
    FedProx,
    FedTrimmedAvg,
    FedYogi,
    QFedAvg,
    Strategy,
)

from feddifrc_app import privacy
from feddifrc_app.config import Config, ConfigError, robust_aggregation_error, sampled_per_round
from feddifrc_app.methods.fednh import FedNH
from feddifrc_app.methods.fednova import A_KEY as FEDNOVA_A
from feddifrc_app.methods.fednova import FedNova
from feddifrc_app.methods.scaffold import Scaffold


def nodes_per_round(cfg: Config, num_nodes: int) -> int:
    """Nodes sampled per round: ``fraction-train`` of the connected nodes, at least 1."""
    return sampled_per_round(cfg.fraction_train, num_nodes)


class RobustBound:
    """Krum / MultiKrum / Bulyan that refuse a round with too few sampled nodes for
    strategy.num-malicious-nodes (config.robust_aggregation_error), naming the keys, rather than
    Flower's silent skip (Bulyan) or a selection with no Byzantine tolerance (Krum)."""

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        n = len(grid.get_node_ids())
        name = type(self).__name__.lower()
        why = robust_aggregation_error(
            name, self.num_malicious_nodes, getattr(self, "num_nodes_to_select", 1), n
        )
        if why:
            raise ConfigError(
                f"round {server_round}: {why}, but {n} were sampled (fraction-train of the connected "
                "nodes); lower strategy.num-malicious-nodes / strategy.num-nodes-to-select or start "
                "more SuperNodes"
            )
        return super().configure_train(server_round, arrays, config, grid)


class Krum(RobustBound, flwr_strategy.Krum):
    pass


class MultiKrum(RobustBound, flwr_strategy.MultiKrum):
    pass


class Bulyan(RobustBound, flwr_strategy.Bulyan):
    pass


# The metric a strategy reads off every train reply, beyond ``num-examples`` (metric_keys.conform).
QFEDAVG_LOSS = "train-total"


def required_metrics(cfg: Config) -> frozenset[str]:
    """The reply metrics this run's aggregation reads: a reply without one cannot be aggregated."""
    own = {"fednova": {FEDNOVA_A}, "qfedavg": {QFEDAVG_LOSS}}.get(cfg.strategy.name, set())
    return frozenset({"num-examples", *own}) | privacy.required_metrics(cfg)


def build_strategy(cfg: Config) -> Strategy:
    """The strategy named by ``strategy.name``, under the DP wrapper ``strategy.dp`` names."""
    return privacy.wrap(_named(cfg), cfg)


def _named(cfg: Config) -> Strategy:
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
    if s.dp != "none":
        # Flower's noise is calibrated to the plain mean of the clipped updates: weigh every reply
        # by the 1.0 the DP wrapper stamps on it, not by its examples (privacy.WEIGHT).
        # SCAFFOLD, FedNova and FedNH, which weigh by examples themselves, are refused under DP.
        common["weighted_by_key"] = privacy.WEIGHT
    name = s.name
    if cfg.method == "fednh":  # FedAvg for the network, FedNH for the prototypes
        return FedNH(**common, rho=cfg.fednh.rho)
    if name == "fedavg":
        return FedAvg(**common)
    if name == "fedprox":
        return FedProx(**common, proximal_mu=s.proximal_mu)
    # Under DP the server optimisers step on the noisy mean (privacy.NoisyMean).
    step = privacy.with_noisy_mean if s.dp != "none" else lambda cls: cls
    if name == "fedavgm":
        return step(FedAvgM)(
            **common, server_learning_rate=s.server_learning_rate, server_momentum=s.server_momentum
        )
    fedopt = dict(eta=s.eta, eta_l=s.eta_l, tau=s.tau)
    if name == "fedadam":
        return step(FedAdam)(**common, **fedopt, beta_1=s.beta_1, beta_2=s.beta_2)
    if name == "fedyogi":
        return step(FedYogi)(**common, **fedopt, beta_1=s.beta_1, beta_2=s.beta_2)
    if name == "fedadagrad":
        return step(FedAdagrad)(**common, **fedopt)
    if name == "fedmedian":
        return FedMedian(**common)
    if name == "fedtrimmedavg":
        return FedTrimmedAvg(**common, beta=s.trim_beta)
    if name in ("krum", "multikrum", "bulyan"):
        robust = {"krum": Krum, "multikrum": MultiKrum, "bulyan": Bulyan}[name]
        extra = {"num_nodes_to_select": s.num_nodes_to_select} if name == "multikrum" else {}
        return robust(**common, num_malicious_nodes=s.num_malicious_nodes, **extra)
    if name == "qfedavg":
        # L = 1 / client_learning_rate: the nodes' own step size; q-FFL's F_k is the node's mean
        # training loss (the loss each method optimises, with its teacher terms).
        return QFedAvg(client_learning_rate=cfg.train.lr, q=s.q, train_loss_key=QFEDAVG_LOSS, **common)
    if name == "scaffold":
        return Scaffold(**common, server_learning_rate=s.server_learning_rate)
    if name == "fednova":
        return FedNova(**common)
    raise ValueError(f"unknown strategy {name!r}")  # unreachable: load_config validated it


# Server-side optimiser state that must survive a resume for the numbers to match.
_STATE_ATTRS = ("current_arrays", "m_t", "v_t", "momentum_vector", "control", "accepted")


# A DP wrapper's own state: the adaptive modes move the clipping norm every round.
_DP_ATTRS = ("clipping_norm",)


def _holders(strategy: Strategy) -> dict[str, Any]:
    """Where each piece of state lives: the named strategy, inside the DP wrapper if there is one."""
    inner = getattr(strategy, "strategy", None)
    if inner is None:
        return {a: strategy for a in _STATE_ATTRS}
    return {a: inner for a in _STATE_ATTRS} | {a: strategy for a in _DP_ATTRS}


def strategy_state(strategy: Strategy) -> dict[str, dict[str, Any]]:
    """The strategy's mutable server state (FedOpt moments, FedAvgM momentum, a DP wrapper's
    clipping norm) as plain tensors, so a checkpoint loads with ``torch.load(weights_only=True)``."""
    out: dict[str, dict[str, Any]] = {}
    for a, holder in _holders(strategy).items():
        v = getattr(holder, a, None)
        if isinstance(v, ArrayRecord):
            out[a] = {"record": v.to_torch_state_dict()}
        elif isinstance(v, dict):
            out[a] = {"dict": {k: torch.from_numpy(np.asarray(x)) for k, x in v.items()}}
        elif isinstance(v, list):
            out[a] = {"list": [torch.from_numpy(np.asarray(x)) for x in v]}
        elif isinstance(v, float):
            out[a] = {"float": torch.tensor(v, dtype=torch.float64)}
        elif v is not None:
            raise TypeError(f"cannot checkpoint strategy state {a!r} of type {type(v).__name__}")
    return out


def load_strategy_state(strategy: Strategy, state: dict[str, dict[str, Any]]) -> None:
    holders = _holders(strategy)
    for a, packed in state.items():
        if a not in holders:
            raise KeyError(f"unexpected strategy state {a!r} in checkpoint")
        ((kind, v),) = packed.items()
        if kind == "record":
            setattr(holders[a], a, ArrayRecord(v))
        elif kind == "dict":
            setattr(holders[a], a, {k: x.numpy() for k, x in v.items()})
        elif kind == "float":
            setattr(holders[a], a, float(v))
        else:
            setattr(holders[a], a, [x.numpy() for x in v])
