"""One rule for reply metrics: a node missing a key cannot fail a round."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import make_config
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

from feddifrc_app import metric_keys
from feddifrc_app.strategy import required_metrics


def _reply(node: int, arrays: ArrayRecord, **metrics: float) -> Message:
    content = RecordDict(
        {"arrays": arrays, "metrics": MetricRecord({k.replace("_", "-"): v for k, v in metrics.items()})}
    )
    return Message(content, reply_to=Message(content=RecordDict(), message_type="train", dst_node_id=node))


def _describe(r: Message) -> dict:
    return {"node": r.metadata.src_node_id, "partition-id": r.metadata.src_node_id - 10}


W = ArrayRecord({"w": torch.zeros(1)})


def test_a_key_not_every_node_sent_is_left_out_and_a_missing_required_key_fails_only_that_node():
    replies = [
        _reply(11, W, num_examples=1.0, train_ce=2.0, train_moon=0.5),
        _reply(12, W, num_examples=3.0, train_ce=1.0),  # no train-moon
        _reply(13, W, train_ce=1.0, train_moon=0.1),  # no num-examples: cannot be weighted
    ]
    kept, failures = metric_keys.conform(replies, {"num-examples"}, _describe)
    assert [r.metadata.src_node_id for r in kept] == [11, 12]
    assert [dict(r.content["metrics"]) for r in kept] == [
        {"num-examples": 1.0, "train-ce": 2.0},
        {"num-examples": 3.0, "train-ce": 1.0},
    ]
    assert failures == [
        {
            "node": 13,
            "partition-id": 3,
            "reason": "the reply lacks metric key(s) ['num-examples'], which the aggregation reads",
        }
    ]


def test_flower_itself_refuses_replies_with_mixed_metric_keys():
    """Why the rule exists: FedAvg raises when one reply has a key the other lacks (the run fails)."""
    from flwr.serverapp.exception import InconsistentMessageReplies
    from flwr.serverapp.strategy import FedAvg

    replies = [_reply(11, W, num_examples=1.0, train_moon=0.5), _reply(12, W, num_examples=1.0)]
    with pytest.raises(InconsistentMessageReplies):
        FedAvg().aggregate_train(1, replies)
    kept, _ = metric_keys.conform(replies, {"num-examples"}, _describe)
    arrays, _ = FedAvg().aggregate_train(1, kept)
    assert arrays["w"].numpy().tolist() == [0.0]


def test_the_strategy_names_what_its_aggregation_reads():
    assert required_metrics(make_config(strategy__name="fedavg")) == {"num-examples"}
    assert required_metrics(make_config(strategy__name="fednova")) == {"num-examples", "fednova-a"}
    assert required_metrics(make_config(strategy__name="qfedavg")) == {"num-examples", "train-total"}


def test_a_node_missing_a_metric_key_cannot_fail_a_round(tmp_path) -> None:
    """Through the real round loop and Flower's FedAvg, which refuses replies with mixed keys."""
    from feddifrc_app.federation import Federation
    from feddifrc_app.outputs import RunDir
    from feddifrc_app.results import Results
    from feddifrc_app.rounds import RoundLoop

    class TwoNodes(Federation):
        def __init__(self) -> None:
            super().__init__(grid=None, cfg=make_config())
            self.partition_of = {11: 0, 12: 1}

        def sample(self, rnd):
            return [11, 12]

        def view(self, chosen):
            return SimpleNamespace(get_node_ids=lambda: list(chosen), num_nodes=2)

        def exchange(self, msgs, chosen):
            out = []
            for m, v, extra in zip(msgs, (1.0, 3.0), ({"train_moon": 0.2}, {}), strict=True):
                arrays = ArrayRecord(
                    {k: torch.full(a.numpy().shape, v) for k, a in m.content["arrays"].items()}
                )
                content = RecordDict(
                    {
                        "arrays": arrays,
                        "metrics": MetricRecord(
                            {
                                "num-examples": 1.0,
                                "train-ce": v,
                                **{k.replace("_", "-"): x for k, x in extra.items()},
                            }
                        ),
                    }
                )
                out.append(Message(content, reply_to=m))
            return out, []

    cfg = make_config(method="fedavg", num_server_rounds=1)
    (tmp_path / "run").mkdir()
    loop = RoundLoop(
        cfg,
        TwoNodes(),
        RunDir(tmp_path / "run"),
        Results(rounds=[], resumed=[]),
        lambda m: {"test-accuracy": 0.1},
        10,
    )
    row = loop.train_round(1)
    assert row.failures == [] and loop.empty_rounds == 0
    assert row.train_metrics == {"train-ce": 2.0}  # train-moon left out (num-examples: the weight)
    for a in loop.arrays.values():  # the mean of 1 and 3 everywhere
        np.testing.assert_array_equal(a.numpy(), np.full(a.numpy().shape, 2.0, dtype=np.float32))
