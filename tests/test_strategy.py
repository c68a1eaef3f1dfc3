"""Strategy factory: every config name builds the right Flower strategy with its parameters."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_config
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAdam, FedAvg, FedAvgM, FedProx, FedTrimmedAvg

from feddifrc_app.config import STRATEGIES
from feddifrc_app.strategy import build_strategy, load_strategy_state, nodes_per_round, strategy_state


@pytest.mark.parametrize("name", STRATEGIES)
def test_every_name_builds(name):
    s = build_strategy(make_config(strategy__name=name))
    assert type(s).__name__.lower() == name


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
