"""Every Flower internal the app still overrides or reads, pinned against the installed flwr.

The app drives Flower's public API (strategies, Grid, records, mods) except for these names: a
Flower upgrade that renames, moves or stops calling one must fail here, by name, rather than
silently change what a run computes (DP noise added twice, a checkpoint without its moments).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from conftest import make_config
from fakes import RecordingGrid
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import strategy as flwr_strategy
from flwr.supercore import differential_privacy as flwr_dp

from feddifrc_app import privacy, strategy
from feddifrc_app.strategy import STATE, build_strategy

DP_WRAPPERS = {
    "server-fixed": flwr_strategy.DifferentialPrivacyServerSideFixedClipping,
    "client-fixed": flwr_strategy.DifferentialPrivacyClientSideFixedClipping,
    "server-adaptive": flwr_strategy.DifferentialPrivacyServerSideAdaptiveClipping,
    "client-adaptive": flwr_strategy.DifferentialPrivacyClientSideAdaptiveClipping,
}


def _round(s, nodes: int = 2, reply_metrics: dict[str, float] | None = None) -> None:
    """One configure_train / aggregate_train of ``s`` on Flower's public Grid: node i sends x + i."""
    x = ArrayRecord({"w": torch.zeros(3)})
    msgs = list(s.configure_train(1, x, ConfigRecord({}), RecordingGrid(list(range(1, nodes + 1)))))
    metrics = {"num-examples": 1.0, "train-total": 1.0, **(reply_metrics or {})}
    replies = [
        Message(
            RecordDict(
                {
                    "arrays": ArrayRecord({"w": torch.full((3,), float(i + 1))}),
                    "metrics": MetricRecord(metrics),
                }
            ),
            reply_to=m,
        )
        for i, m in enumerate(msgs)
    ]
    arrays, _ = s.aggregate_train(1, replies)
    assert arrays is not None


# ----------------------------------------------------------------------- the DP wrappers (privacy.py)


@pytest.mark.parametrize("mode", list(DP_WRAPPERS))
def test_the_private_noise_step_privacy_overrides_exists_and_is_called_once_per_round(mode, monkeypatch):
    """privacy.Accounted and _AdaptivePerRound override ``_add_noise_to_aggregated_arrays`` (to move
    the noise before a server optimiser, and to scale it by the round's clipping norm) and call
    Flower's through super(): it must exist, take the aggregate, and be what aggregate_train calls."""
    flower = DP_WRAPPERS[mode]._add_noise_to_aggregated_arrays
    params = list(inspect.signature(flower).parameters.values())
    assert len(params) == 2 and params[1].default is inspect.Parameter.empty  # (self, the aggregate)
    assert inspect.signature(flower).return_annotation in (ArrayRecord, "ArrayRecord")
    s = build_strategy(make_config(method="fedavg", strategy__dp=mode, strategy__dp_noise_multiplier=0.0))
    assert isinstance(s, DP_WRAPPERS[mode]) and isinstance(s, privacy.Accounted)
    calls = []
    ours = type(s)._add_noise_to_aggregated_arrays

    def spy(self, *args, **kwargs):
        calls.append((args, kwargs))
        return ours(self, *args, **kwargs)

    monkeypatch.setattr(type(s), "_add_noise_to_aggregated_arrays", spy)
    _round(s, reply_metrics={flwr_dp.KEY_NORM_BIT: 0.0})
    assert len(calls) == 1 and not calls[0][1] and isinstance(calls[0][0][0], ArrayRecord)


@pytest.mark.parametrize("mode", list(DP_WRAPPERS))
def test_the_dp_wrappers_attributes_privacy_reads_and_sets(mode):
    """privacy.wrap passes the constructor arguments by position (fixed) or name (adaptive); the
    wrappers keep the inner strategy, the norm (swapped for the round's C_t), the sampled count
    (set every round) and the multiplier (and the count noise, re-split every round)."""
    names = list(inspect.signature(DP_WRAPPERS[mode].__init__).parameters)
    if mode.endswith("fixed"):
        assert names[:5] == ["self", "strategy", "noise_multiplier", "clipping_norm", "num_sampled_clients"]
    else:
        assert names[:3] == ["self", "strategy", "noise_multiplier"]
        assert {"num_sampled_clients", "initial_clipping_norm", "target_clipped_quantile"} <= set(names)
        assert {"clip_norm_lr", "clipped_count_stddev"} <= set(names)
    s = build_strategy(make_config(method="fedavg", strategy__dp=mode, strategy__dp_noise_multiplier=0.5))
    _round(s, nodes=3, reply_metrics={flwr_dp.KEY_NORM_BIT: 0.0})
    assert isinstance(s.strategy, flwr_strategy.FedAvg)
    assert isinstance(s.clipping_norm, float) and isinstance(s.noise_multiplier, float)
    assert s.num_sampled_clients == 3  # ours, set from the round's nodes, read by Flower's noise
    if mode.endswith("adaptive"):
        assert isinstance(s.clipped_count_stddev, float)


def test_flowers_dp_helpers_privacy_imports_keep_their_names_and_arguments():
    assert (flwr_dp.KEY_CLIPPING_NORM, flwr_dp.KEY_NORM_BIT) == ("clipping_norm", "norm_bit")

    def names(f):
        return list(inspect.signature(f).parameters)

    assert names(flwr_dp.compute_stdv) == ["noise_multiplier", "clipping_norm", "num_sampled_clients"]
    assert names(flwr_dp.compute_adaptive_noise_params) == [
        "noise_multiplier",
        "num_sampled_clients",
        "clipped_count_stddev",
    ]
    assert names(flwr_dp.add_gaussian_noise_inplace) == ["input_arrays", "std_dev"]
    assert flwr_dp.compute_stdv(2.0, 1.5, 4) == pytest.approx(0.75)
    # privacy._flower_dp_failure tells Flower's DP errors by the files they are raised in.
    assert Path(flwr_dp.__file__).stem == "differential_privacy"
    for cls in DP_WRAPPERS.values():
        assert Path(inspect.getfile(cls)).stem.startswith("dp_")


# ----------------------------------------------------------------------- strategy state (strategy.STATE)


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("fedavgm", flwr_strategy.FedAvgM),
        ("fedadam", flwr_strategy.FedAdam),
        ("fedyogi", flwr_strategy.FedYogi),
    ]
    + [("fedadagrad", flwr_strategy.FedAdagrad), ("qfedavg", flwr_strategy.QFedAvg)],
)
def test_the_flower_attributes_a_checkpoint_keeps_exist_after_a_round(name, cls):
    """strategy.STATE names the attributes Flower keeps its server state in; after a round each
    holds a value strategy_state can write (FedAvgM's momentum needs a second round)."""
    s = build_strategy(make_config(method="fedavg", strategy__name=name))
    assert isinstance(s, cls) and STATE[cls]
    _round(s)
    _round(s)
    for a in STATE[cls]:
        assert isinstance(getattr(s, a), (ArrayRecord, dict, list)), (name, a, type(getattr(s, a, None)))
    assert set(strategy.strategy_state(s)) == set(STATE[cls])


def test_the_flower_attributes_our_strategies_read():
    """Scaffold and FedNH aggregate with FedAvg's metric aggregation and weighting key; RobustBound
    reads Krum's / MultiKrum's f and m."""
    s = build_strategy(make_config(method="fedavg", strategy__name="scaffold"))
    assert s.weighted_by_key == "num-examples"
    contents = [
        RecordDict({"metrics": MetricRecord({"num-examples": n, "train-ce": v})})
        for n, v in ((1.0, 0.0), (3.0, 1.0))
    ]
    assert s.train_metrics_aggr_fn(contents, s.weighted_by_key)["train-ce"] == pytest.approx(0.75)
    m = build_strategy(make_config(strategy__name="multikrum", strategy__num_nodes_to_select=2, min_nodes=3))
    assert (m.num_malicious_nodes, m.num_nodes_to_select) == (0, 2)


# ----------------------------------------------------------------------- Grid and run (federation, rounds)


def test_the_grid_and_run_internals_federation_and_rounds_use():
    from flwr.supercore.exit import add_exit_handler
    from flwr.supercore.run import RunNotRunningException
    from flwr.superlink.grid.inmemory_grid import InMemoryGrid

    # federation polls the simulation Grid at min(its pull_interval, 0.1 s)
    assert inspect.signature(InMemoryGrid.__init__).parameters["pull_interval"].default == 0.1
    assert "self.pull_interval = pull_interval" in inspect.getsource(InMemoryGrid.__init__)
    assert "run_before_force_exit" in inspect.signature(add_exit_handler).parameters
    # rounds.record_end tells a stopped run by it (a BaseException: not caught as an error)
    assert issubclass(RunNotRunningException, BaseException)
