"""The ServerApp's setup checks: every node must number classes and run the teacher as the server expects."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from fakes import FailingFederation, FakeNodes, RecordingGrid, server_context
from flwr.app import ConfigRecord, Error, Message, RecordDict
from flwr.common.constant import ErrorCode

from feddifrc_app import server_app
from feddifrc_app.device import DeviceError, platform_info
from feddifrc_app.methods.feddifrc.server import check_teachers
from feddifrc_app.results import Results
from feddifrc_app.server_app import check_classes, record_platforms


def _setup(**infos: dict) -> tuple[dict[int, RecordDict], SimpleNamespace]:
    """Setup replies keyed by node id (100 + partition id) and the node -> partition map."""
    setup = {100 + int(p[1:]): RecordDict({"info": ConfigRecord(info)}) for p, info in infos.items()}
    return setup, SimpleNamespace(partition_of={n: n - 100 for n in setup})


def test_nodes_with_one_teacher_pass_and_mixed_weights_name_each_partition() -> None:
    same, fed = _setup(p0={"teacher-weights": "a" * 64}, p1={"teacher-weights": "a" * 64})
    check_teachers(same, fed.partition_of)
    none, fed = _setup(p0={}, p1={})
    check_teachers(none, fed.partition_of)  # FedAvg: no teacher at all
    mixed, fed = _setup(
        p0={"teacher-weights": "a" * 64}, p1={"teacher-weights": "b" * 64}, p2={"teacher-weights": "a" * 64}
    )
    with pytest.raises(
        ValueError, match=r"aaaaaaaaaaaa -> \[0, 2\]; bbbbbbbbbbbb -> \[1\]\): give every node"
    ):
        check_teachers(mixed, fed.partition_of)


def test_a_node_numbering_classes_differently_from_the_test_set_is_named() -> None:
    test = SimpleNamespace(class_names=["cat", "dog"])
    ok, fed = _setup(p0={"class-names": ["cat", "dog"]}, p1={"class-names": ["cat", "dog"]})
    check_classes(ok, fed, test)
    bad, fed = _setup(p0={"class-names": ["cat", "dog"]}, p1={"class-names": ["dog", "cat"]})
    with pytest.raises(ValueError, match=r"node 101 \(partition-id 1\) numbers its classes \['dog', 'cat'\]"):
        check_classes(bad, fed, test)


def _on(torch_version: str, kernels: str) -> dict:
    return {"platform-torch": torch_version, "platform-cpu-kernels": kernels, "platform-machine": "x86_64"}


def test_platforms_name_the_server_and_each_nodes_kernels_and_a_resume_elsewhere_is_warned() -> None:
    setup, fed = _setup(p0=_on("2.14.1", "AVX2"), p1=_on("2.14.1", "AVX512"), p2=_on("2.14.1", "AVX2"))
    results = Results()
    record_platforms(setup, fed, results)
    machine = {"torch": "2.14.1", "machine": "x86_64"}
    assert results.platforms == {
        "server": platform_info(),
        "nodes": [
            {**machine, "cpu-kernels": "AVX2", "partitions": [0, 2]},
            {**machine, "cpu-kernels": "AVX512", "partitions": [1]},
        ],
    }
    first = results.platforms
    record_platforms(setup, fed, results)  # resumed where it ran: nothing to say
    assert results.warnings is None and results.platforms == first
    moved, fed = _setup(p0=_on("2.14.1", "AVX512"), p1=_on("2.14.1", "AVX512"), p2=_on("2.14.1", "AVX2"))
    record_platforms(moved, fed, results)  # resumed where partition 0 computes with other kernels
    (warning,) = results.warnings
    assert warning.startswith("resumed on other platforms") and "not an uninterrupted run's" in warning
    assert results.platforms["nodes"][1]["partitions"] == [0, 1]


def test_a_round_in_which_no_node_trains_fails_the_run_with_the_reason(tmp_path) -> None:
    import json

    from conftest import make_config

    from feddifrc_app.outputs import RunDir
    from feddifrc_app.rounds import MAX_EMPTY_ROUNDS, NoUpdateError, RoundLoop

    cfg = make_config(method="fedavg", num_server_rounds=3)
    (tmp_path / "run").mkdir()
    run = RunDir(tmp_path / "run")
    results = Results(rounds=[], resumed=[])

    def evaluator(model):
        return {"val-accuracy": None, "val-loss": None, "test-accuracy": 0.103, "test-loss": 2.3}

    loop = RoundLoop(cfg, FailingFederation(), run, results, evaluator, 10)
    with pytest.raises(NoUpdateError) as e:
        loop.run_all()
    assert MAX_EMPTY_ROUNDS == 1
    msg = str(e.value)
    assert msg.startswith("round 1: no node returned a usable update (2 of 2 nodes failed; first failure: ")
    assert "Expected more than 1 value per channel" in msg
    on_disk = json.loads((tmp_path / "run" / "results.json").read_text())
    assert on_disk["status"] == "failed" and on_disk["error"] == f"NoUpdateError: {msg}"
    assert [r["round"] for r in on_disk["rounds"]] == [0, 1] and len(on_disk["rounds"][1]["failures"]) == 2
    assert not list((tmp_path / "run").rglob("round-*.pt"))  # an untrained round is not checkpointed


def _reply(node: int) -> Message:
    """A train reply with nothing but its weight (the strategies under test are stubbed)."""
    from flwr.app import MetricRecord

    content = RecordDict({"metrics": MetricRecord({"num-examples": 1.0})})
    return Message(content, reply_to=Message(content=RecordDict(), message_type="train", dst_node_id=node))


def test_replies_the_strategy_cannot_combine_fail_the_run_saying_so(tmp_path) -> None:
    from conftest import make_config

    from feddifrc_app.outputs import RunDir
    from feddifrc_app.rounds import NoUpdateError, RoundLoop

    class Replying(FakeNodes):
        def exchange(self, msgs, chosen):
            return [_reply(11), _reply(12)], []  # two replies, no failure

    (tmp_path / "run").mkdir()
    results = Results(rounds=[], resumed=[])
    loop = RoundLoop(
        make_config(method="fedavg", num_server_rounds=2),
        Replying(),
        RunDir(tmp_path / "run"),
        results,
        lambda m: {"val-accuracy": None, "val-loss": None, "test-accuracy": 0.1, "test-loss": 2.3},
        10,
    )
    loop.strategy.aggregate_train = lambda rnd, replies: (None, None)  # as Flower's "Skipping aggregation"
    with pytest.raises(
        NoUpdateError,
        match=r"round 1: no node returned a usable update \(2 nodes replied but "
        r"strategy 'fedavg' aggregated nothing; the ServerApp log says why",
    ):
        loop.run_all()
    assert results.status == "failed"


def test_a_lost_node_is_accounted_for_before_flower_counts_the_aggregated_replies(tmp_path, caplog) -> None:
    """Flower's "Received N results and M failures" sees only the replies handed to aggregation
    (M = 0); the app's warning, logged just before it, is the round's account."""
    import logging

    from conftest import make_config

    from feddifrc_app.outputs import RunDir
    from feddifrc_app.rounds import NoUpdateError, RoundLoop

    class OneLost(FakeNodes):
        def exchange(self, msgs, chosen):
            return [_reply(11)], [{"node": 12, "partition-id": 1, "reason": "Node Unavailable"}]

    (tmp_path / "run").mkdir()
    loop = RoundLoop(
        make_config(method="fedavg", num_server_rounds=2),
        OneLost(),
        RunDir(tmp_path / "run"),
        Results(rounds=[], resumed=[]),
        lambda m: {"val-accuracy": None, "val-loss": None, "test-accuracy": 0.1, "test-loss": 2.3},
        10,
    )
    seen = []

    def aggregate(rnd, replies):
        seen.append((caplog.text, len(replies)))
        return None, None

    loop.strategy.aggregate_train = aggregate
    with caplog.at_level(logging.WARNING, logger="flwr.feddifrc"), pytest.raises(NoUpdateError):
        loop.run_all()
    ((logged_before, handed),) = seen
    assert handed == 1
    assert (
        "round 1: 1 of 2 nodes failed (aggregating the other 1): [{'node': 12, 'partition-id': 1,"
        in logged_before
    )


def test_the_serverapp_polls_for_replies_at_most_every_tenth_of_a_second(monkeypatch) -> None:
    from conftest import make_config

    from feddifrc_app import federation

    class Grid:  # the SuperLink's HTTP Grid has no pull_interval; a reply arrives on the 4th pull
        pulls = 0

        def push_messages(self, msgs):
            return ["m1"]

        def pull_messages(self, ids):
            self.pulls += 1
            return (
                [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id="m1"))]
                if self.pulls == 4
                else []
            )

    sleeps: list[float] = []
    # federation's own clock only: patching time.sleep itself would also count the sleeps of any
    # thread an earlier test of this worker left running
    clock = SimpleNamespace(sleep=sleeps.append, monotonic=federation.time.monotonic)
    monkeypatch.setattr(federation, "time", clock)
    fed = federation.Federation(Grid(), make_config())
    assert len(fed._send_and_receive([object()], timeout=60)) == 1
    assert sleeps == [0.1, 0.1, 0.1] and federation.REPLY_POLL_SECONDS == 0.1
    grid = Grid()
    grid.pull_interval = 0.05  # the in-memory (simulation) Grid's own, shorter: kept
    sleeps.clear()
    federation.Federation(grid, make_config())._send_and_receive([object()], timeout=60)
    assert sleeps == [0.05, 0.05, 0.05]


def test_scaffold_counts_data_folder_nodes_one_by_one_not_by_their_shared_partition_id(tmp_path) -> None:
    """Four nodes with their own data folders all report partition id -1: N is 4, not 1, so two
    replies move the server control variate by |S| / N = 1/2 of their mean, not 2x it."""
    import torch
    from conftest import make_config
    from flwr.app import ArrayRecord, Message, MetricRecord

    from feddifrc_app.federation import Federation
    from feddifrc_app.methods import scaffold
    from feddifrc_app.outputs import RunDir
    from feddifrc_app.rounds import RoundLoop

    class FolderNodes(Federation):
        def __init__(self) -> None:
            super().__init__(grid=None, cfg=make_config())
            self.partition_of = {11: -1, 12: -1, 13: -1, 14: -1}

        def sample(self, rnd):
            return [11, 12]

        def view(self, chosen):
            return SimpleNamespace(get_node_ids=lambda: list(chosen), num_nodes=self.distinct_nodes())

        def exchange(self, msgs, chosen):
            replies = []
            for m, dc in zip(msgs, (1.0, 3.0), strict=True):
                arrays = m.content["arrays"]
                content = RecordDict(
                    {
                        "arrays": arrays,
                        "metrics": MetricRecord({"num-examples": 10.0}),
                        scaffold.DELTA: ArrayRecord(
                            {k: torch.full(v.numpy().shape, dc) for k, v in arrays.items()}
                        ),
                    }
                )
                replies.append(
                    Message(content=content, dst_node_id=m.metadata.dst_node_id, message_type="train")
                )
            return replies, []

    fed = FolderNodes()
    assert fed.distinct_nodes() == 4
    fed.partition_of |= {15: 0, 16: 0, 17: 1}  # a simulated node rejoined under a new id: one partition
    assert fed.distinct_nodes() == 6
    fed.partition_of = {11: -1, 12: -1, 13: -1, 14: -1}

    cfg = make_config(method="fedavg", strategy__name="scaffold", num_server_rounds=1)
    (tmp_path / "run").mkdir()
    results = Results(rounds=[], resumed=[])
    loop = RoundLoop(cfg, fed, RunDir(tmp_path / "run"), results, lambda m: {"test-accuracy": 0.1}, 10)
    loop.train_round(1)
    assert loop.strategy.fraction_of_nodes == 0.5
    for c in loop.strategy.control.values():  # c = 0 + |S| / N * mean(1, 3) = 0.5 * 2
        assert float(abs(c - 1.0).max()) == 0.0


def test_a_new_serverapp_process_imports_dp_accounting_only_for_an_accounted_run() -> None:
    """dp-accounting imports scipy.stats and scipy.signal (1.7 s of the ServerApp's start): a run
    without DP never pays it; the first epsilon does."""
    code = (
        "import json, sys\n"
        "import feddifrc_app.server_app\n"
        "from feddifrc_app.privacy_accounting import epsilon\n"
        "seen = ['dp_accounting' in sys.modules, 'scipy.stats' in sys.modules]\n"
        "e = epsilon([(2, 2, 1.0)], 1e-5, amplified=False)\n"
        "print(json.dumps([*seen, 'dp_accounting' in sys.modules, e]))\n"
    )
    cp = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert cp.returncode == 0, cp.stderr
    *seen, eps = json.loads(cp.stdout.strip().splitlines()[-1])
    assert seen == [False, False, True]
    assert eps == pytest.approx(4.729, abs=1e-3)  # one round at multiplier 1 (test_privacy's value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_an_invalid_server_device_fails_before_any_node_is_asked_anything(tmp_path) -> None:
    """server.device = 'cuda' where the ServerApp has no GPU: the run fails before the Grid is
    touched at all, so no node is asked for statistics (no extraction is spent on a dead run)."""
    grid = RecordingGrid(node_ids=[11, 12])
    with pytest.raises(DeviceError, match=r"^server.device = 'cuda', but .*set server.device = 'cpu'"):
        server_app.main(grid, server_context(tmp_path, server__device="cuda"))
    assert grid.calls == []
    # The run folder is this run's by then: results.json says how it ended, the reason first.
    res = json.loads((tmp_path / "runs" / "r" / "results.json").read_text())
    assert res["status"] == "failed" and res["error"].startswith("DeviceError: server.device = 'cuda', but ")
    assert res["rounds"] == []


def test_train_device_cuda_is_the_nodes_business_the_server_goes_on_to_setup(tmp_path) -> None:
    """train.device = 'cuda' on this CPU-only process: the ServerApp needs no GPU (its central
    evaluation runs on server.device), so it reaches the setup exchange and asks each node once;
    nodes that all fail setup end the run with each node's own reason."""

    def fail(m: Message) -> Message:
        reason = f"Traceback ...\nDeviceError: node {m.metadata.dst_node_id} has no usable GPU"
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=m)

    grid = RecordingGrid(node_ids=[12, 11], reply=fail)
    with pytest.raises(RuntimeError, match=r"^setup: no node answered \(node 1[12]: ") as e:
        server_app.main(grid, server_context(tmp_path, train__device="cuda"))
    reasons = str(e.value).removeprefix("setup: no node answered (").removesuffix(")").split("; ")
    assert sorted(reasons) == [f"node {n}: DeviceError: node {n} has no usable GPU" for n in (11, 12)]
    assert grid.calls[:2] == ["get_node_ids", "push_messages"]
    assert set(grid.calls[2:]) == {"pull_messages"} and not grid.pending  # both replies read
    res = json.loads((tmp_path / "runs" / "r" / "results.json").read_text())
    assert res["status"] == "failed" and res["error"] == f"RuntimeError: {e.value}"


def test_the_central_evaluator_runs_on_server_device_and_scores_test_only_without_validation() -> None:
    """train.device = 'cuda' is never resolved by the server; with dataset.val-fraction = 0 there
    is no validation split and every round's validation keys are None (results, reports: '-')."""
    from conftest import make_config

    from feddifrc_app import methods
    from feddifrc_app.data.registry import load_dataset, load_validation
    from feddifrc_app.results import RoundRow, summarize
    from feddifrc_app.rounds import CentralEvaluator
    from feddifrc_app.tools.report import format_table

    cfg = make_config(
        method="fedavg",
        train__device="cuda",
        server__device="cpu",
        dataset__val_fraction=0,
        dataset__eval_limit=40,
    )
    test = load_dataset(cfg.dataset, "test")
    ev = CentralEvaluator(cfg, test, load_validation(cfg.dataset))
    assert ev.device == torch.device("cpu") and ev.splits["val"] is None
    torch.manual_seed(0)
    row = RoundRow(1)
    row.set_scores(ev(methods.model_for(cfg, test.num_classes)))
    assert row.val_accuracy is None and row.val_loss is None
    assert row.test_accuracy in {k / 40 for k in range(41)} and row.test_loss > 0  # 40 test images
    s = summarize([row])
    assert s["final-accuracy"] == row.test_accuracy and s["val-best-round"] is None
    table = format_table(Results(rounds=[row], summary=s))
    assert (
        "best (max over rounds, the paper's endpoint)" in table and "test at the best validation" not in table
    )


def test_fewer_nodes_than_min_nodes_go_on_after_min_nodes_timeout_not_round_timeout(
    monkeypatch, caplog
) -> None:
    """A simulation of 2 SuperNodes with min-nodes = 3 waited strategy.round-timeout (an hour)."""
    import logging

    from conftest import make_config

    from feddifrc_app import federation

    clock = [0.0]
    monkeypatch.setattr(federation.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(federation.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    grid = SimpleNamespace(get_node_ids=lambda: [12, 11])
    cfg = make_config(min_nodes=3, min_nodes_timeout=30.0)
    assert cfg.strategy.round_timeout == 3600.0
    with caplog.at_level(logging.WARNING, logger="flwr.feddifrc"):
        assert federation.Federation(grid, cfg).wait_for_nodes() == [11, 12]
    assert clock[0] == 31.0  # 30 s and the poll that passed it, not an hour
    assert "2 of min-nodes = 3 SuperNodes connected within min-nodes-timeout = 30s: going on" in caplog.text
    nobody = SimpleNamespace(get_node_ids=lambda: [])
    with pytest.raises(
        RuntimeError, match=r"^no SuperNode connected within min-nodes-timeout = 30s \(min-nodes = 3\)"
    ):
        federation.Federation(nobody, cfg).wait_for_nodes()


def test_the_self_supervised_method_replaces_the_central_evaluation_by_its_linear_probe() -> None:
    """feddifrc-ssl trains no classifier head: each split's accuracy is a logistic-regression probe
    fit on the embeddings of the training split (methods.central_evaluation), with no loss; the
    supervised methods keep the classifier's accuracy and loss."""
    from conftest import make_config

    from feddifrc_app import methods
    from feddifrc_app.data.registry import load_dataset, load_validation
    from feddifrc_app.methods.feddifrc.probe import LinearProbe, embed, linear_probe
    from feddifrc_app.rounds import CentralEvaluator

    over = dict(dataset__eval_limit=40, dataset__train_limit=60, server__device="cpu", ssl__probe_epochs=1)
    cfg = make_config(method="feddifrc-ssl", ssl__negatives="cat,dog", **over)
    test = load_dataset(cfg.dataset, "test")
    ev = CentralEvaluator(cfg, test, load_validation(cfg.dataset))
    assert isinstance(ev.override, LinearProbe) and len(ev.override.train.dataset) == 60
    assert CentralEvaluator(make_config(method="feddifrc", **over), test, None).override is None
    torch.manual_seed(0)
    model = methods.model_for(cfg, test.num_classes)
    row = ev(model)
    assert set(row) == {"val-accuracy", "val-loss", "test-accuracy", "test-loss"}
    assert row["val-loss"] is None and row["test-loss"] is None
    # the probe of the training split's embeddings, read on the test split's
    f, y, _ = embed(model, ev.override.train, ev.device)
    ft, yt, _ = embed(model, ev.splits["test"], ev.device)
    assert row["test-accuracy"] == linear_probe(f, y, ft, yt, epochs=1, seed=cfg.seed)
    assert row["test-accuracy"] in {k / 40 for k in range(41)}
