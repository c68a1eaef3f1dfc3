"""Strategy factory: ``strategy.name`` picks the server-side aggregation.

Flower's own ``flwr.serverapp.strategy`` classes (FedAvg, FedAvgM, FedProx, FedAdam, FedYogi,
FedAdagrad, FedMedian, FedTrimmedAvg, Krum, MultiKrum, Bulyan, QFedAvg), one entry each in
``FACTORIES``, and the strategies Flower lacks that the methods bring (a method package's
``strategies()``); a method may replace it (its ``own_strategy``).
The hyper-parameters are ``strategy.*`` config keys with Flower's defaults. The strategy's
state (server momentum, control variates, a DP wrapper's clipping norm) is what a checkpoint
keeps of it (``STATE``, ``CHECKPOINTED``). The config's rules for ``strategy.*`` are in
strategy_rules.py, which ``load_config`` imports where Flower is not installed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
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

from feddifrc_app import methods, privacy
from feddifrc_app.config import Config, ConfigError
from feddifrc_app.strategy_rules import robust_aggregation_error, sampled_per_round


def nodes_per_round(cfg: Config, num_nodes: int) -> int:
    """Nodes sampled per round: ``fraction-train`` of the connected nodes, at least 1."""
    return sampled_per_round(cfg.fraction_train, num_nodes)


class RobustBound:
    """Krum / MultiKrum / Bulyan that refuse a round with too few sampled nodes for
    strategy.num-malicious-nodes (strategy_rules.robust_aggregation_error), naming the keys, rather than
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
REPLY_METRICS = {"qfedavg": {QFEDAVG_LOSS}}  # a method's own strategies declare theirs (reply_metrics)


def required_metrics(cfg: Config) -> frozenset[str]:
    """The reply metrics this run's aggregation reads: a reply without one cannot be aggregated."""
    own = set(REPLY_METRICS.get(cfg.strategy.name, set()))
    for declared in methods.hooks("reply_metrics"):
        own |= declared(cfg)
    return frozenset({"num-examples", *own}) | privacy.required_metrics(cfg)


def build_strategy(cfg: Config) -> Strategy:
    """The strategy named by ``strategy.name`` (or the method's own), under the DP wrapper
    ``strategy.dp`` names."""
    common = _common(cfg)
    for own in methods.hooks("own_strategy"):
        if (strategy := own(cfg, common)) is not None:
            return privacy.wrap(strategy, cfg)
    return privacy.wrap(factories()[cfg.strategy.name](cfg, common), cfg)


def _common(cfg: Config) -> dict[str, Any]:
    """The arguments every strategy takes. The ServerApp samples ``fraction-train`` of the nodes
    itself (seeded, by partition id) and shows the strategy only the chosen ones, so the strategy
    takes all it is shown and never waits for a minimum: a node that died mid-run cannot stall
    the next round. The same for ``fraction-evaluate`` (federated_eval.py): 1.0 of the nodes
    sampled for evaluation, or none."""
    common: dict[str, Any] = dict(
        fraction_train=1.0,
        fraction_evaluate=1.0 if cfg.fraction_evaluate > 0 else 0.0,
        min_train_nodes=1,
        min_evaluate_nodes=1 if cfg.fraction_evaluate > 0 else 0,
        min_available_nodes=1,
    )
    if cfg.strategy.dp != "none":
        # Flower's noise is calibrated to the plain mean of the clipped updates: weigh every reply
        # by the 1.0 the DP wrapper stamps on it, not by its examples (privacy.WEIGHT).
        # The methods whose strategies weigh by examples themselves refuse DP (their dp_refusal).
        common["weighted_by_key"] = privacy.WEIGHT
    return common


def _stepping(cfg: Config, cls: type[FedAvg]) -> type[FedAvg]:
    """A server optimiser's class; under DP it steps on the noisy mean (privacy.NoisyMean)."""
    return privacy.with_noisy_mean(cls) if cfg.strategy.dp != "none" else cls


def _fedopt(
    c: Config, k: dict[str, Any], cls: type[FedAdam | FedYogi | FedAdagrad], **extra: float
) -> Strategy:
    return _stepping(c, cls)(**k, eta=c.strategy.eta, eta_l=c.strategy.eta_l, tau=c.strategy.tau, **extra)


def _adaptive(c: Config) -> dict[str, float]:
    return {"beta_1": c.strategy.beta_1, "beta_2": c.strategy.beta_2}


# strategy.name -> (the run config, the arguments every strategy takes) -> the strategy.
FACTORIES: dict[str, Callable[[Config, dict[str, Any]], Strategy]] = {
    "fedavg": lambda c, k: FedAvg(**k),
    "fedprox": lambda c, k: FedProx(**k, proximal_mu=c.strategy.proximal_mu),
    "fedavgm": lambda c, k: _stepping(c, FedAvgM)(
        **k, server_learning_rate=c.strategy.server_learning_rate, server_momentum=c.strategy.server_momentum
    ),
    "fedadam": lambda c, k: _fedopt(c, k, FedAdam, **_adaptive(c)),
    "fedyogi": lambda c, k: _fedopt(c, k, FedYogi, **_adaptive(c)),
    "fedadagrad": lambda c, k: _fedopt(c, k, FedAdagrad),
    "fedmedian": lambda c, k: FedMedian(**k),
    "fedtrimmedavg": lambda c, k: FedTrimmedAvg(**k, beta=c.strategy.trim_beta),
    "krum": lambda c, k: Krum(**k, num_malicious_nodes=c.strategy.num_malicious_nodes),
    "multikrum": lambda c, k: MultiKrum(
        **k,
        num_malicious_nodes=c.strategy.num_malicious_nodes,
        num_nodes_to_select=c.strategy.num_nodes_to_select,
    ),
    "bulyan": lambda c, k: Bulyan(**k, num_malicious_nodes=c.strategy.num_malicious_nodes),
    # L = 1 / client_learning_rate: the nodes' own step size; q-FFL's F_k is the node's mean
    # training loss (the loss each method optimises, with its teacher terms).
    "qfedavg": lambda c, k: QFedAvg(
        **k, client_learning_rate=c.train.lr, q=c.strategy.q, train_loss_key=QFEDAVG_LOSS
    ),
}


def factories() -> dict[str, Callable[[Config, dict[str, Any]], Strategy]]:
    """Every strategy by name: Flower's (``FACTORIES``) and those the methods bring
    (``strategies()`` of a method module)."""
    out = dict(FACTORIES)
    for brought in methods.hooks("strategies"):
        out |= brought()
    return out


# The server state each strategy keeps between rounds, by the attribute it lives in: Flower's
# own for FedAvgM, FedAdam, FedYogi, FedAdagrad and QFedAvg (pinned by
# tests/test_flower_internals.py; ours name theirs in ``CHECKPOINTED``); a DP wrapper's clipping norm
# (the adaptive modes move it every round). A checkpoint keeps each under that name.
STATE: dict[type, tuple[str, ...]] = {
    FedAvgM: ("current_arrays", "momentum_vector"),
    FedAdam: ("current_arrays", "m_t", "v_t"),  # FedOpt's
    FedYogi: ("current_arrays", "m_t", "v_t"),
    FedAdagrad: ("current_arrays", "m_t", "v_t"),
    QFedAvg: ("current_arrays",),
    privacy.Accounted: ("clipping_norm",),
}


def _holders(strategy: Strategy) -> dict[str, Any]:
    """Each piece of state's name -> the object it lives on: the named strategy, and the DP
    wrapper around it if there is one."""
    inner = strategy.strategy if isinstance(strategy, privacy.Accounted) else None
    return {a: s for s in (inner, strategy) if s is not None for a in _state_attrs(s)}


def _state_attrs(s: Strategy) -> tuple[str, ...]:
    """The server state ``s`` keeps: Flower's classes by ``STATE``, ours by ``CHECKPOINTED``."""
    own = getattr(type(s), "CHECKPOINTED", None)
    return (
        own if own is not None else tuple(a for c, attrs in STATE.items() if isinstance(s, c) for a in attrs)
    )


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
