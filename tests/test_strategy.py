"""Strategy factory: every config name builds the right Flower strategy with its parameters."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_config
from fakes import RecordingGrid
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAdam, FedAvg, FedAvgM, FedProx, FedTrimmedAvg

from feddifrc_app import config, config_loader, methods
from feddifrc_app.config import ConfigError
from feddifrc_app.federation import NUM_NODES
from feddifrc_app.methods import scaffold
from feddifrc_app.strategy import (
    build_strategy,
    factories,
    load_strategy_state,
    nodes_per_round,
    strategy_state,
)
from feddifrc_app.strategy_rules import STRATEGY_KEYS

STRATEGIES = config_loader.strategy_names()


@pytest.mark.parametrize("name", STRATEGIES)
def test_every_name_builds(name):
    s = build_strategy(make_config(strategy__name=name, min_nodes=3))  # bulyan needs 3 nodes
    assert type(s).__name__.lower() == name


def test_every_strategy_name_has_one_factory_and_its_keys_are_strategy_keys():
    assert set(factories()) == set(STRATEGIES)
    assert set(STRATEGY_KEYS) <= set(STRATEGIES)
    brought = methods.strategy_keys()  # each named by its package, with the keys it reads
    assert set(brought) == {"scaffold", "fednova"} and not set(brought) & set(config.STRATEGIES)
    assert all(f"strategy.{k}" in config_loader.keys() for names in brought.values() for k in names)
    assert all(f"strategy.{k}" in config_loader.keys() for names in STRATEGY_KEYS.values() for k in names)


def test_parameters_reach_the_strategy():
    s = build_strategy(make_config(strategy__name="fedprox", strategy__proximal_mu=0.3))
    assert isinstance(s, FedProx) and s.proximal_mu == 0.3
    s = build_strategy(make_config(strategy__name="fedavgm", strategy__server_momentum=0.5))
    assert isinstance(s, FedAvgM) and s.server_momentum == 0.5
    s = build_strategy(make_config(strategy__name="fedadam", strategy__eta=0.05, strategy__beta_2=0.9))
    assert isinstance(s, FedAdam) and (s.eta, s.beta_2) == (0.05, 0.9)
    s = build_strategy(make_config(strategy__name="fedtrimmedavg", strategy__trim_beta=0.1))
    assert isinstance(s, FedTrimmedAvg) and s.beta == 0.1


def test_min_nodes_derived_from_federation_size():
    cfg = make_config(fraction_train=0.5)
    assert nodes_per_round(cfg, 10) == 5  # paper: 5 of 10
    assert nodes_per_round(cfg, 1) == 1  # never 0, never more than exist
    # the strategy itself never waits for a minimum (a dead node must not stall a round)
    s = build_strategy(cfg)
    assert s.min_available_nodes == 1 and s.min_train_nodes == 1 and s.fraction_train == 1.0
    # the same for evaluation: the ServerApp samples fraction-evaluate, the strategy takes them all
    assert s.fraction_evaluate == 0.0  # the default: no federated evaluation
    s = build_strategy(make_config(fraction_train=0.5, fraction_evaluate=0.3, evaluate_holdout=0.1))
    assert s.fraction_evaluate == 1.0 and s.min_evaluate_nodes == 1


def test_fedavg_weights_by_num_examples():
    s = build_strategy(make_config())
    assert isinstance(s, FedAvg)
    msgs = []
    for val, n in ((1.0, 1), (4.0, 3)):
        content = RecordDict(
            {
                "arrays": ArrayRecord(numpy_ndarrays=[np.full((2,), val, dtype=np.float32)]),
                "metrics": MetricRecord({"num-examples": n}),
            }
        )
        m = Message(content=content, message_type="train", dst_node_id=1)
        msgs.append(Message(content, reply_to=m))
    arrays, _ = s.aggregate_train(1, msgs)
    np.testing.assert_allclose(arrays.to_numpy_ndarrays()[0], [(1 * 1 + 4 * 3) / 4] * 2)


def test_fedprox_sends_mu_in_config():
    s = build_strategy(make_config(strategy__name="fedprox", strategy__proximal_mu=0.25))

    class OneNode:
        def get_node_ids(self):
            return [7]

    msgs = list(s.configure_train(1, ArrayRecord(numpy_ndarrays=[np.zeros(1)]), ConfigRecord({}), OneNode()))
    assert msgs[0].content["config"]["proximal-mu"] == 0.25


def test_strategy_state_round_trip():
    s = build_strategy(make_config(strategy__name="fedadam"))
    s.m_t = {"w": np.ones(3)}
    s.v_t = {"w": np.full(3, 2.0)}
    state = strategy_state(s)
    t = build_strategy(make_config(strategy__name="fedadam"))
    load_strategy_state(t, state)
    np.testing.assert_array_equal(t.v_t["w"], [2, 2, 2])
    with pytest.raises(KeyError):
        load_strategy_state(t, {"bogus": {"dict": {}}})


def test_strategy_state_survives_a_weights_only_checkpoint():
    import io

    import torch

    s = build_strategy(make_config(strategy__name="fedavgm"))
    s.current_arrays = ArrayRecord({"w": torch.arange(3.0)})
    s.momentum_vector = [np.full(2, 0.5)]
    buf = io.BytesIO()
    torch.save(strategy_state(s), buf)
    buf.seek(0)
    t = build_strategy(make_config(strategy__name="fedavgm"))
    load_strategy_state(t, torch.load(buf, weights_only=True))  # no pickled Python objects needed
    assert isinstance(t.current_arrays, ArrayRecord)
    np.testing.assert_array_equal(t.current_arrays["w"].numpy(), [0, 1, 2])
    np.testing.assert_array_equal(t.momentum_vector[0], [0.5, 0.5])


# --------------------------------------------------------------------------- robust and fair aggregation


def _replies(values, losses=None) -> list[Message]:
    """One reply per value: a 1-element model ``w``, one example each, and its training loss."""
    out = []
    for i, v in enumerate(values):
        metrics = {"num-examples": 1.0, "train-total": float(losses[i]) if losses else 1.0}
        content = RecordDict(
            {"arrays": ArrayRecord({"w": torch.tensor([v])}), "metrics": MetricRecord(metrics)}
        )
        out.append(
            Message(content, reply_to=Message(content=content, message_type="train", dst_node_id=i + 1))
        )
    return out


class _Grid:
    def __init__(self, n: int) -> None:
        self.n = n

    def get_node_ids(self):
        return list(range(1, self.n + 1))


# Five updates, one far off. Krum scores each by the squared distances to its n - f - 2 = 2
# nearest others (f = 1): 0 -> 1 + 6.25, 1 -> 1 + 2.25, 2.5 -> 0.25 + 2.25, 3 -> 0.25 + 4, 100 -> huge.
FIVE = (0.0, 1.0, 2.5, 3.0, 100.0)


def _aggregate(name: str, values, n_grid=None, **overrides) -> float:
    s = build_strategy(make_config(strategy__name=name, min_nodes=len(values), **overrides))
    w0 = ArrayRecord({"w": torch.zeros(1)})
    list(s.configure_train(1, w0, ConfigRecord({}), _Grid(n_grid or len(values))))
    arrays, _ = s.aggregate_train(1, _replies(values, overrides.pop("losses", None)))
    return float(arrays["w"].numpy()[0])


def _rounds(name: str, rounds, **overrides) -> list[float]:
    """The global ``w`` after each round of hand-made replies (one example each), from w = 0."""
    s = build_strategy(make_config(strategy__name=name, min_nodes=len(rounds[0]), **overrides))
    w, out = ArrayRecord({"w": torch.zeros(1)}), []
    for rnd, values in enumerate(rounds, start=1):
        list(s.configure_train(rnd, w, ConfigRecord({}), _Grid(len(values))))
        w, _ = s.aggregate_train(rnd, _replies(values))
        out.append(float(w["w"].numpy()[0]))
    return out


def test_fedmedian_takes_the_coordinatewise_median():
    assert _aggregate("fedmedian", FIVE) == 2.5  # FedAvg: 21.3


def test_fedtrimmedavg_drops_the_trim_beta_share_at_each_end():
    # beta = 0.2 of 5 nodes: one value cut at each end (0 and 100), the mean of 1, 2.5, 3 kept
    assert _aggregate("fedtrimmedavg", FIVE) == pytest.approx(6.5 / 3)
    assert _aggregate("fedtrimmedavg", FIVE, strategy__trim_beta=0.0) == pytest.approx(106.5 / 5)


def test_fedavgm_keeps_moving_along_its_server_momentum():
    # Round 1: the mean 2 is the pseudo-gradient -2, so w = 2. Round 2: the nodes agree with w
    # (pseudo-gradient 0), but the momentum 0.9 * -2 still moves w to 3.8 (FedAvg: 2).
    got = _rounds("fedavgm", [(1.0, 3.0), (2.0, 2.0)], strategy__server_momentum=0.9)
    assert got == pytest.approx([2.0, 3.8])


def _fedopt_reference(deltas, v_step, eta=0.01, beta_1=0.9, tau=1e-3) -> list[float]:
    """Reddi et al.'s server update, w += eta * m / (sqrt(v) + tau), with ``v_step(v, d2)``."""
    w = m = v = 0.0
    out = []
    for d in deltas:
        m = beta_1 * m + (1 - beta_1) * d
        v = v_step(v, d * d)
        w += eta * m / (v**0.5 + tau)
        out.append(w)
    return out


def test_fedadagrad_accumulates_squared_steps_without_momentum():
    # Round 1: the mean 2 is delta 2 (v = 4); round 2: the nodes return 0, delta -w (v += w^2).
    got = _rounds("fedadagrad", [(1.0, 3.0), (0.0, 0.0)])
    want = _fedopt_reference([2.0, -got[0]], lambda v, d2: v + d2, beta_1=0.0)
    assert got == pytest.approx(want, rel=1e-6)
    assert got[0] == pytest.approx(0.01 * 2 / (2 + 1e-3), rel=1e-6)


def test_fedyogi_moves_its_second_moment_by_the_sign_of_the_difference():
    # Yogi: v -= (1 - beta_2) d^2 sign(v - d^2), an additive step (FedAdam: a moving average).
    got = _rounds("fedyogi", [(1.0, 3.0), (0.0, 0.0)])
    yogi = _fedopt_reference([2.0, -got[0]], lambda v, d2: v - 0.01 * d2 * np.sign(v - d2))
    assert got == pytest.approx(yogi, rel=1e-6)
    adam = _rounds("fedadam", [(1.0, 3.0), (0.0, 0.0)])
    assert abs(adam[1] - got[1]) > 1e-4  # the two second moments differ from round 1 on


def test_krum_picks_the_update_closest_to_its_neighbours():
    assert _aggregate("krum", FIVE, strategy__num_malicious_nodes=1) == 2.5  # FedAvg: 21.3


def test_multikrum_averages_the_m_best_scored_updates():
    # the two lowest scores: 2.5 (2.5) and 1 (3.25)
    assert (
        _aggregate("multikrum", FIVE, strategy__num_malicious_nodes=1, strategy__num_nodes_to_select=2)
        == 1.75
    )


def test_bulyan_averages_the_beta_coordinates_nearest_the_median_of_the_krum_selection():
    # n = 7, f = 1: MultiKrum keeps theta = n - 2f = 5 (the two +-50 are out), their median is 2,
    # and the beta = theta - 2f = 3 values nearest it are 2, 3, 3.2. FedMedian of all 7 is 2.
    got = _aggregate("bulyan", (0.0, 0.5, 2.0, 3.0, 3.2, 50.0, -50.0), strategy__num_malicious_nodes=1)
    assert got == pytest.approx((2.0 + 3.0 + 3.2) / 3)


def test_qfedavg_moves_towards_the_node_with_the_higher_loss():
    # L = 1 / train.lr = 10, q = 1. Node A at 1 with loss 1: delta = 1 * 10 (0 - 1) = -10,
    # h = q * 1^0 * 10^2 + L * 1 = 110; node B at -1 with loss 3: delta = 30, h = 100 + 30 = 130.
    # w = 0 - (-10 + 30) / (110 + 130) = -1/12, towards B (FedAvg: 0).
    s = build_strategy(make_config(strategy__name="qfedavg", strategy__q=1.0, train__lr=0.1, min_nodes=2))
    list(s.configure_train(1, ArrayRecord({"w": torch.zeros(1)}), ConfigRecord({}), _Grid(2)))
    arrays, _ = s.aggregate_train(1, _replies((1.0, -1.0), losses=(1.0, 3.0)))
    assert float(arrays["w"].numpy()[0]) == pytest.approx(-1 / 12, rel=1e-6)
    assert (s.client_learning_rate, s.q, s.train_loss_key) == (0.1, 1.0, "train-total")


@pytest.mark.parametrize(
    ("overrides", "needs"),
    [
        ({"strategy__name": "krum", "strategy__num_malicious_nodes": 1, "min_nodes": 4}, "2 * 1 + 3 = 5"),
        ({"strategy__name": "bulyan", "min_nodes": 2}, "4 * 0 + 3 = 3"),
        (
            {
                "strategy__name": "bulyan",
                "strategy__num_malicious_nodes": 1,
                "min_nodes": 10,
                "fraction_train": 0.5,
            },
            "= 7",
        ),
        ({"strategy__name": "multikrum", "strategy__num_nodes_to_select": 3, "min_nodes": 2}, "(2 - 0 = 2)"),
    ],
)
def test_byzantine_bounds_are_checked_at_load(overrides, needs):
    with pytest.raises(ConfigError, match="strategy.num-malicious-nodes") as e:
        make_config(**overrides)
    assert needs in str(e.value) and "min-nodes" in str(e.value)


def test_byzantine_bounds_hold_without_malicious_nodes_and_with_enough_nodes():
    make_config(strategy__name="krum", min_nodes=2)  # f = 0: a selection rule, any n
    make_config(strategy__name="bulyan", strategy__num_malicious_nodes=1, min_nodes=7)
    make_config(strategy__name="fedavg", strategy__num_malicious_nodes=5)  # not read by fedavg


def test_byzantine_bound_is_checked_again_against_the_nodes_really_sampled():
    # Loaded for 7 nodes; only 5 connected: round 1 fails, naming the key, before any message is sent.
    s = build_strategy(make_config(strategy__name="bulyan", strategy__num_malicious_nodes=1, min_nodes=7))
    w0 = ArrayRecord({"w": torch.zeros(1)})
    with pytest.raises(ConfigError, match=r"round 1: .*needs at least 4 \* 1 \+ 3 = 7 .*but 5 were sampled"):
        list(s.configure_train(1, w0, ConfigRecord({}), _Grid(5)))
    assert len(list(s.configure_train(1, w0, ConfigRecord({}), _Grid(7)))) == 7


# --------------------------------------------------------------------------- Flower's public Grid


def _scaffold_replies(msgs, ys: list[list[float]], deltas: list[list[float]], examples: list[float]):
    out = []
    for m, y, d, n in zip(msgs, ys, deltas, examples, strict=True):
        content = RecordDict(
            {
                "arrays": ArrayRecord({"w": torch.tensor(y)}),
                "metrics": MetricRecord({"num-examples": n}),
                scaffold.DELTA: ArrayRecord({"w": torch.tensor(d)}),
            }
        )
        out.append(Message(content, reply_to=m))
    return out


@pytest.mark.parametrize(("config", "n"), [({NUM_NODES: 4}, 4), ({}, 2)])
def test_scaffold_takes_n_from_the_train_config_on_flowers_public_grid(config, n):
    """N travels in the train config (federation.round_config); without it, N is the nodes the
    Grid has, as under Flower's own loop. The Grid is used through get_node_ids alone."""
    s = build_strategy(make_config(method="fedavg", strategy__name="scaffold"))
    grid = RecordingGrid([1, 2])
    msgs = list(s.configure_train(1, ArrayRecord({"w": torch.ones(2)}), ConfigRecord(config), grid))
    replies = _scaffold_replies(msgs, [[0.0, 1.0], [2.0, 3.0]], [[0.4, 0.0], [0.0, 0.8]], [1.0, 3.0])
    arrays, _ = s.aggregate_train(1, replies)
    np.testing.assert_allclose(arrays["w"].numpy(), [1.5, 2.5])  # x + 1/4 (y1 - x) + 3/4 (y2 - x)
    np.testing.assert_allclose(s.control["w"], np.array([0.2, 0.4]) * 2 / n, rtol=1e-6)  # |S| / N mean
    assert set(grid.calls) == {"get_node_ids"}


def test_scaffold_runs_under_flowers_own_strategy_start():
    """Flower's Strategy.start with a Grid that answers as four SCAFFOLD nodes would (each moves
    the model by +1 and its control variate by +1): N = 4 = |S|, so c grows by 1 a round."""

    class Nodes(RecordingGrid):
        def send_and_receive(self, messages, *, timeout=None):
            self.calls.append("send_and_receive")
            msgs = list(messages)
            ys = [(m.content["arrays"]["w"].numpy() + 1).tolist() for m in msgs]
            return _scaffold_replies(msgs, ys, [[1.0]] * len(msgs), [1.0] * len(msgs))

    s = build_strategy(make_config(method="fedavg", strategy__name="scaffold"))
    grid = Nodes([1, 2, 3, 4])
    result = s.start(grid, ArrayRecord({"w": torch.zeros(1)}), num_rounds=2)
    np.testing.assert_allclose(result.arrays["w"].numpy(), [2.0])
    np.testing.assert_allclose(s.control["w"], [2.0])
    assert s.accepted == {1: 2, 2: 2, 3: 2, 4: 2} and s.num_nodes == 4
    assert set(grid.calls) == {"get_node_ids", "send_and_receive"}


# --------------------------------------------------------------------------- checkpoints


def test_a_checkpoint_keeps_the_names_checkpoints_always_had():
    """strategy.STATE decides what is saved; the names are those of checkpoints written before it
    (Flower's attribute names: the same sets, measured over every strategy and DP mode), so those
    still load: here one as the old code wrote it."""
    want = {
        "fedavgm": {"current_arrays", "momentum_vector"},
        "fedadam": {"current_arrays", "m_t", "v_t"},
        "fedadagrad": {"current_arrays", "m_t", "v_t"},
        "qfedavg": {"current_arrays"},
        "scaffold": {"current_arrays", "control", "accepted"},
        "fednova": {"current_arrays"},
        "fedavg": set(),
        "krum": set(),
    }

    for name, keys in want.items():
        s = build_strategy(make_config(method="fedavg", strategy__name=name, min_nodes=2))
        for rnd in (1, 2):  # FedAvgM keeps a momentum from its second round
            msgs = list(
                s.configure_train(
                    rnd, ArrayRecord({"w": torch.zeros(2)}), ConfigRecord({}), RecordingGrid([1, 2])
                )
            )
            replies = _scaffold_replies(msgs, [[1.0, 1.0], [3.0, 3.0]], [[0.1, 0.1]] * 2, [1.0, 1.0])
            for r in replies:
                r.content["metrics"] = MetricRecord(
                    {"num-examples": 1.0, "train-total": 1.0, "fednova-a": 1.0}
                )
                if name != "scaffold":
                    del r.content[scaffold.DELTA]  # FedAvg refuses a second ArrayRecord
            s.aggregate_train(rnd, replies)
        assert set(strategy_state(s)) == keys, name
    old = {  # an adaptive-DP FedAdam checkpoint's strategy state, as the old code saved it
        "current_arrays": {"dict": {"w": torch.tensor([1.0, 2.0])}},
        "m_t": {"dict": {"w": torch.tensor([0.1, 0.2])}},
        "v_t": {"dict": {"w": torch.tensor([0.01, 0.04])}},
        "clipping_norm": {"float": torch.tensor(0.25, dtype=torch.float64)},
    }
    t = build_strategy(make_config(method="fedavg", strategy__name="fedadam", strategy__dp="server-adaptive"))
    load_strategy_state(t, old)
    assert t.clipping_norm == 0.25 and isinstance(t.clipping_norm, float)
    np.testing.assert_allclose(t.strategy.m_t["w"], [0.1, 0.2])
    np.testing.assert_allclose(t.strategy.v_t["w"], [0.01, 0.04])
    np.testing.assert_allclose(t.strategy.current_arrays["w"], [1.0, 2.0])
    assert set(strategy_state(t)) == set(old)


def test_a_strategy_added_as_docs_architecture_says_is_built_and_runs_rounds(tmp_path, monkeypatch) -> None:
    """docs/architecture.md, "Add a strategy" (one of Flower's): its entry in ``strategy.FACTORIES``
    is all that build_strategy and the round loop look up by ``strategy.name``. (Its name in
    config.STRATEGIES, what load_config accepts, is test_every_strategy_name_has_one_factory_...)"""
    import dataclasses

    from fakes import EchoingFederation, central_scores

    from feddifrc_app import strategy
    from feddifrc_app.outputs import RunDir
    from feddifrc_app.results import Results
    from feddifrc_app.rounds import RoundLoop

    aggregated: list[int] = []

    class Dummy(FedAvg):  # Flower's FedAvg that notes the rounds it aggregates
        def aggregate_train(self, server_round, replies):
            aggregated.append(server_round)
            return super().aggregate_train(server_round, replies)

    monkeypatch.setitem(strategy.FACTORIES, "dummy", lambda c, k: Dummy(**k))
    base = make_config(method="fedavg", num_server_rounds=2, max_frozen_rounds=0)  # the nodes echo the model
    cfg = dataclasses.replace(base, strategy=dataclasses.replace(base.strategy, name="dummy"))
    built = build_strategy(cfg)
    assert type(built) is Dummy and (built.fraction_train, built.min_available_nodes) == (1.0, 1)
    assert "dummy" in factories() and strategy_state(built) == {}  # no server state to checkpoint

    (tmp_path / "run").mkdir()
    run, results = RunDir(tmp_path / "run"), Results(rounds=[], resumed=[])
    loop = RoundLoop(cfg, EchoingFederation(), run, results, lambda m: central_scores(2.3), 10)
    loop.run_all()
    assert type(loop.strategy) is Dummy and aggregated == [1, 2]
    assert loop.results.status == "completed" and [r.round for r in loop.results.rounds] == [0, 1, 2]
