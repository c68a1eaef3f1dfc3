"""Federated evaluation on the server: sampling, the strategy's example-weighted aggregate, the
rows it writes to results.json, failures, and a run (RoundLoop) that resumes with them."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from conftest import make_config
from fakes import FakeNodes
from flwr.app import Message, MetricRecord, RecordDict

from feddifrc_app.federated_eval import FederatedEvaluation, set_evaluation
from feddifrc_app.files import write_json
from feddifrc_app.outputs import RunDir
from feddifrc_app.records import state_to_record
from feddifrc_app.results import Results, RoundRow
from feddifrc_app.strategy import build_strategy
from feddifrc_app.tools.report import format_nodes, format_table, plot_accuracy

ON = dict(fraction_evaluate=1.0, evaluate_holdout=0.1)
# node id -> (partition id, held-out examples, accuracy, loss)
NODES = {11: (0, 10, 0.5, 1.0), 12: (1, 30, 0.9, 0.2)}


def reply(msg: Message) -> Message:
    """What client_app.evaluate answers for node ``msg``'s destination (NODES' numbers)."""
    _, n, acc, loss = NODES[msg.metadata.dst_node_id]
    metrics = MetricRecord({"eval-loss": loss, "eval-accuracy": acc, "num-examples": float(n)})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)


class FakeFederation(FakeNodes):
    """Nodes 11 and 12 (partitions 0, 1) that train (echoing the model) and evaluate (NODES);
    ``fail``: node ids whose evaluation fails."""

    def __init__(self, fail: tuple[int, ...] = ()) -> None:
        self.fail, self.sampled, self.sent = fail, [], []

    def sample(self, rnd: int, evaluate: bool = False) -> list[int]:
        self.sampled.append((rnd, evaluate))
        return [11, 12]

    def exchange(self, msgs, chosen):
        self.sent += [(m.metadata.message_type, m.metadata.dst_node_id) for m in msgs]
        ok, failures = [], []
        for m in sorted(msgs, key=lambda m: m.metadata.dst_node_id):
            node = m.metadata.dst_node_id
            if m.metadata.message_type == "train":
                metrics = MetricRecord({"num-examples": 10.0})
                ok.append(
                    Message(RecordDict({"arrays": m.content["arrays"], "metrics": metrics}), reply_to=m)
                )
            elif node in self.fail:
                failures.append({"node": node, "partition-id": self.partition_of[node], "reason": "boom"})
            else:
                ok.append(reply(m))
        return ok, failures


def _evaluate(cfg, fed, rnd: int = 1) -> dict:
    """The keys FederatedEvaluation adds to round ``rnd``'s row, as results.json writes them."""
    row = RoundRow(rnd)
    FederatedEvaluation(cfg, fed, build_strategy(cfg))(rnd, _arrays(), row)
    return {k: v for k, v in row.to_json().items() if k not in RoundRow(rnd).to_json()}


def _arrays():
    from feddifrc_app.methods import model_for

    return state_to_record(model_for(make_config(method="fedavg"), 10).state_dict())


def test_the_strategy_weights_the_nodes_by_their_held_out_examples() -> None:
    cfg = make_config(method="fedavg", **ON)
    fed = FakeFederation()
    row = _evaluate(cfg, fed, 3)
    assert fed.sampled == [(3, True)] and sorted(fed.sent) == [("evaluate", 11), ("evaluate", 12)]
    # (10 * 0.5 + 30 * 0.9) / 40 and (10 * 1.0 + 30 * 0.2) / 40
    assert row["federated-accuracy"] == pytest.approx(0.8)
    assert row["federated-loss"] == pytest.approx(0.4)
    assert row["evaluate-nodes"] == [
        {"node": 11, "partition-id": 0, "num-examples": 10, "accuracy": 0.5, "loss": 1.0},
        {"node": 12, "partition-id": 1, "num-examples": 30, "accuracy": 0.9, "loss": 0.2},
    ]
    assert row["evaluate-failures"] == []


def test_a_node_that_fails_evaluation_is_recorded_and_the_others_count(caplog) -> None:
    cfg = make_config(method="fedavg", **ON)
    with caplog.at_level("WARNING", logger="flwr.feddifrc"):
        row = _evaluate(cfg, FakeFederation(fail=(12,)))
    assert (row["federated-accuracy"], row["federated-loss"]) == (0.5, 1.0)  # node 11 alone
    assert row["evaluate-failures"] == [{"node": 12, "partition-id": 1, "reason": "boom"}]
    assert "round 1: 1 of 2 nodes failed evaluation" in caplog.text
    none = _evaluate(cfg, FakeFederation(fail=(11, 12)))
    assert none["federated-accuracy"] is None and none["federated-loss"] is None
    assert len(none["evaluate-failures"]) == 2 and none["evaluate-nodes"] == []


def test_without_federated_evaluation_no_node_is_asked_and_no_key_is_written() -> None:
    cfg = make_config(method="fedavg")
    fed = FakeFederation()
    assert _evaluate(cfg, fed) == {}
    assert fed.sampled == [] and fed.sent == []
    nothing = RoundRow(1)
    set_evaluation(nothing, None, [], [], {})
    assert nothing.federated_accuracy is None and nothing.to_json()["federated-accuracy"] is None


def _loop(tmp_path, rounds: int, fail: tuple[int, ...] = (), **over):
    from feddifrc_app.rounds import RoundLoop

    # FakeFederation's nodes reply with the model they were sent: not judged as a frozen run here.
    cfg = make_config(
        method="fedavg",
        num_server_rounds=rounds,
        outputs_dir=str(tmp_path),
        max_frozen_rounds=0,
        **ON,
        **over,
    )
    run = RunDir.for_config(cfg, 1)
    results, checkpoint = run.begin(cfg, 1)
    if not cfg.resume_from:  # as the ServerApp does
        write_json(run.path / "config.json", cfg.to_flat())

    def central(model):
        return {"val-accuracy": None, "val-loss": None, "test-accuracy": 0.7, "test-loss": 0.9}

    return RoundLoop(cfg, FakeFederation(fail), run, results, central, 10, checkpoint=checkpoint)


def test_a_run_writes_the_federated_numbers_per_round_and_resumes_with_them(tmp_path) -> None:
    loop = _loop(tmp_path, 2, run_name="r")
    loop.run_all()
    on_disk = json.loads((loop.run.path / "results.json").read_text())
    rounds = on_disk["rounds"]
    assert "federated-accuracy" not in rounds[0]  # the initial model: central evaluation only
    assert list(rounds[0]) == ["round", "val-accuracy", "val-loss", "test-accuracy", "test-loss"]
    assert list(rounds[1]) == [  # a trained round's keys, in the order results.json has always had
        "round",
        "nodes",
        "failures",
        "train-metrics",
        "federated-accuracy",
        "federated-loss",
        "evaluate-nodes",
        "evaluate-failures",
        "val-accuracy",
        "val-loss",
        "test-accuracy",
        "test-loss",
        "seconds",
        "origins",
    ]
    for r in rounds[1:]:
        assert r["federated-accuracy"] == pytest.approx(0.8) and r["federated-loss"] == pytest.approx(0.4)
        assert [n["partition-id"] for n in r["evaluate-nodes"]] == [0, 1] and r["evaluate-failures"] == []
        assert r["test-accuracy"] == 0.7  # central evaluation beside it
    assert on_disk["summary"]["final-federated-accuracy"] == pytest.approx(0.8)
    assert Results.from_json(on_disk).to_json() == on_disk  # the one schema, read back unchanged
    # Resume after round 2 into 3 rounds: rows 0..2 are kept, round 3 adds its own (node 12 fails).
    (loop.run.path / "results.json").write_text(json.dumps(on_disk))
    again = _loop(tmp_path, 3, fail=(12,), resume_from=str(loop.run.path))
    assert again.first == 3
    again.run_all()
    resumed = json.loads((loop.run.path / "results.json").read_text())
    assert resumed["rounds"][:3] == rounds
    last = resumed["rounds"][3]
    assert last["federated-accuracy"] == 0.5 and last["evaluate-failures"][0]["partition-id"] == 1
    assert resumed["status"] == "completed" and resumed["summary"]["final-federated-accuracy"] == 0.5


def test_report_shows_federated_numbers_beside_central_and_per_node(tmp_path) -> None:
    row = {"val-accuracy": 0.6, "test-accuracy": 0.7, "test-loss": 0.9, "nodes": [0, 1], "failures": []}
    ev = [
        {"node": 11, "partition-id": 0, "num-examples": 10, "accuracy": 0.5, "loss": 1.0},
        {"node": 12, "partition-id": 1, "num-examples": 30, "accuracy": 0.9, "loss": 0.2},
    ]
    failed = {"node": 12, "partition-id": 1, "reason": "boom"}
    results = Results(
        method="fedavg",
        rounds=[
            RoundRow.from_json(r)
            for r in [
                {"round": 0, "test-accuracy": 0.1},
                {
                    "round": 1,
                    **row,
                    "federated-accuracy": 0.8,
                    "federated-loss": 0.4,
                    "evaluate-nodes": ev,
                    "evaluate-failures": [],
                },
                {
                    "round": 2,
                    **row,
                    "federated-accuracy": 0.5,
                    "federated-loss": 1.0,
                    "evaluate-nodes": ev[:1],
                    "evaluate-failures": [failed],
                },
            ]
        ],  # fmt: skip
        summary={
            "final-accuracy": 0.7,
            "best-accuracy": 0.7,
            "mean-last-5-accuracy": 0.7,
            "final-federated-accuracy": 0.5,
        },  # fmt: skip
    )
    table = format_table(results).splitlines()
    assert table[0].split()[:5] == ["round", "val-accuracy", "test-accuracy", "fed-accuracy", "fed-loss"]
    assert table[2].split()[:5] == ["1", "0.6000", "0.7000", "0.8000", "0.4000"]
    assert "final federated accuracy 50.00%" in table
    nodes = format_nodes(results).splitlines()
    assert nodes[0] == "federated accuracy (%) per node; held-out examples: p0 10, p1 30"
    assert [line.split() for line in nodes[1:]] == [
        ["round", "p0", "p1"],
        ["1", "50.00", "90.00"],
        ["2", "50.00", "failed"],
    ]
    # a node with its own data folder (partition id -1) is told apart by its node id
    own = Results(
        rounds=[RoundRow.from_json({"round": 1, "evaluate-nodes": [{**ev[0], "partition-id": -1}]})]
    )
    assert format_nodes(own).splitlines()[1].split() == ["round", "n11"]
    plot_accuracy(results, tmp_path / "acc.png")
    assert (tmp_path / "acc.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # without federated evaluation the table is as before: no federated columns, no node table
    plain = format_table(Results(rounds=[RoundRow.from_json({"round": 1, **row})]))
    assert "fed-accuracy" not in plain and "per node" not in plain


def test_evaluation_is_sampled_by_seed_and_round_apart_from_training() -> None:
    from feddifrc_app.federation import Federation

    grid = SimpleNamespace(get_node_ids=lambda: list(range(1, 11)))
    fed = Federation(grid, make_config(fraction_train=0.5, fraction_evaluate=0.3, evaluate_holdout=0.1))
    fed.partition_of = {n: n - 1 for n in range(1, 11)}
    ev = fed.sample(4, evaluate=True)
    assert len(ev) == 3 and ev == fed.sample(4, evaluate=True)  # seeded: a resume repeats it
    assert len(fed.sample(4)) == 5  # training: fraction-train
    two = Federation(SimpleNamespace(get_node_ids=lambda: [1, 2]), fed.cfg)
    two.partition_of = {1: 0, 2: 1}
    assert len(two.sample(1, evaluate=True)) == 1  # 0.3 of 2 nodes: at least 1, never 0
    assert {tuple(fed.sample(r, evaluate=True)) for r in range(1, 9)} != {tuple(ev)}  # per round
