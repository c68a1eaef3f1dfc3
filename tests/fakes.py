"""Stand-ins that several test files share, for the parts around the code under test: the nodes the
round loop talks to, Flower's Grid and the ServerApp's Context, a SuperLink's state, a run folder.

Each is the real interface's shape with fixed answers (or Flower's own in-memory classes, for the
SuperLink); the code under test is always the app's own.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
from conftest import default_run_config, make_config
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

# ----------------------------------------------------------------- the round loop's federation


class FakeNodes:
    """Nodes 11 and 12 (partitions 0 and 1) as the round loop's federation shows them; a subclass
    answers ``exchange`` (the replies and the failures of one round)."""

    partition_of = {11: 0, 12: 1}

    def sample(self, rnd: int, evaluate: bool = False) -> list[int]:
        return [11, 12]

    def view(self, chosen: list[int]) -> SimpleNamespace:
        return SimpleNamespace(get_node_ids=lambda: list(chosen))

    def round_config(self) -> dict[str, int]:
        return {}  # no N: the strategies count the nodes they are shown


class FailingFederation(FakeNodes):
    """Two nodes that both fail every round, as with a batch BatchNorm cannot normalise."""

    def exchange(self, msgs, chosen):
        reason = "ValueError: Expected more than 1 value per channel when training"
        return [], [{"node": n, "partition-id": self.partition_of[n], "reason": reason} for n in chosen]


class EchoingFederation(FakeNodes):
    """Two nodes that always reply with the model they were sent (the strategy's aggregate is set
    by each test)."""

    def exchange(self, msgs, chosen):
        replies = []
        for m in msgs:
            content = RecordDict(
                {
                    "arrays": m.content["arrays"],
                    "metrics": MetricRecord({"num-examples": 1.0, "train-total": 2.0}),
                }
            )
            replies.append(Message(content=content, dst_node_id=m.metadata.dst_node_id, message_type="train"))
        return replies, []


def shifted(arrays: ArrayRecord, by: float) -> ArrayRecord:
    """``arrays`` with ``by`` added to every value (in each array's own dtype)."""
    return ArrayRecord({k: Array(a.numpy() + np.asarray(by, a.numpy().dtype)) for k, a in arrays.items()})


def round_loop(tmp_path: Path, evaluator, **overrides):
    """A fedavg RoundLoop of 2 rounds (``overrides``: config fields) over EchoingFederation, writing
    to ``tmp_path / "run"``; ``evaluator``: the central evaluation."""
    from feddifrc_app.outputs import RunDir
    from feddifrc_app.results import Results
    from feddifrc_app.rounds import RoundLoop

    (tmp_path / "run").mkdir(parents=True)
    cfg = make_config(**{"method": "fedavg", "num_server_rounds": 2, **overrides})
    return RoundLoop(
        cfg, EchoingFederation(), RunDir(tmp_path / "run"), Results(rounds=[], resumed=[]), evaluator, 10
    )


def central_scores(loss: float) -> dict[str, float | None]:
    """A central evaluation's scores: test only, at ``loss``."""
    return {"val-accuracy": None, "val-loss": None, "test-accuracy": 0.1, "test-loss": loss}


# ----------------------------------------------------------------------- the ServerApp's side


class RecordingGrid(Grid):
    """Flower's transport interface (``Grid``) that records every call the ServerApp makes.

    ``reply`` answers each pushed message (as a node would); without one, sending anything
    fails the test. Message ids are stamped as Flower's own grids stamp them on push."""

    def __init__(self, node_ids: list[int], reply=None) -> None:
        self.calls: list[str] = []
        self.node_ids, self.reply = node_ids, reply
        self.pending: dict[str, Message] = {}

    def set_run(self, run) -> None:
        self.calls.append("set_run")

    @property
    def run(self):
        self.calls.append("run")
        raise AssertionError("the ServerApp reads no Run from its Grid")

    def create_message(self, *args, **kwargs) -> Message:
        self.calls.append("create_message")
        raise AssertionError("the ServerApp builds its messages itself")

    def get_node_ids(self) -> list[int]:
        self.calls.append("get_node_ids")
        return list(self.node_ids)

    def push_messages(self, messages) -> list[str]:
        self.calls.append("push_messages")
        if self.reply is None:
            raise AssertionError(f"a message was sent: {[m.metadata.message_type for m in messages]}")
        ids = []
        for m in messages:
            m.metadata.__dict__["_message_id"] = f"m{len(self.calls)}-{m.metadata.dst_node_id}"
            self.pending[m.metadata.message_id] = self.reply(m)
            ids.append(m.metadata.message_id)
        return ids

    def pull_messages(self, message_ids) -> list[Message]:
        self.calls.append("pull_messages")
        return [self.pending.pop(i) for i in list(message_ids) if i in self.pending]

    def send_and_receive(self, messages, *, timeout=None) -> list[Message]:
        self.calls.append("send_and_receive")
        raise AssertionError("the ServerApp sends through push_messages / pull_messages")


def server_context(tmp_path: Path, **overrides) -> Context:
    """The ServerApp's Context: the app's defaults (conftest's plumbing) writing runs under
    ``tmp_path / "runs"`` as run "r", with dotted-key ``overrides``."""
    run_config = default_run_config(outputs_dir=str(tmp_path / "runs"), run_name="r", **overrides)
    return Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)


class SuperLink:
    """A SuperLink's state as the ServerApp's Grid reads it (Flower's in-memory LinkState and the
    Grid over it), with SuperNodes that register and come online as the Fleet API records them."""

    def __init__(self) -> None:
        from flwr.server.superlink.linkstate import LinkStateFactory
        from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME
        from flwr.supercore.object_store import ObjectStoreFactory
        from flwr.superlink.federation import NoOpFederationManager
        from flwr.superlink.federation.noop_federation_manager import NOOP_FEDERATION_ID, NOOP_FLWR_AID
        from flwr.superlink.grid import InMemoryGrid
        from flwr.superlink.servicer.control.control_handlers import TaskType

        factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory())
        self.state = factory.state()
        run_id = self.state.create_run(
            None, None, None, {}, NOOP_FEDERATION_ID, None, NOOP_FLWR_AID, TaskType.SERVER_APP
        )
        self.grid = InMemoryGrid(factory)
        (run,) = self.state.get_run_info(run_ids=[run_id])
        self.grid.set_run(run)

    def supernode(self) -> int:
        """One SuperNode online (registered, then its first heartbeat), as fleet_handlers does."""
        import secrets

        from flwr.superlink.federation.noop_federation_manager import NOOP_ACCOUNT_NAME, NOOP_FLWR_AID

        node = self.state.create_node(NOOP_FLWR_AID, NOOP_ACCOUNT_NAME, secrets.token_bytes(32), 3600.0)
        assert self.state.activate_node(node, 3600.0)
        return node


# ------------------------------------------------------------------------------- a run folder


def fake_run(run_dir: Path) -> None:
    """A run folder as a run leaves it: config.json and results.json (rounds 0 to 2, a node lost in
    round 2)."""
    from feddifrc_app.files import write_json
    from feddifrc_app.outputs import RunDir
    from feddifrc_app.results import Results

    run = RunDir(run_dir)
    run_dir.mkdir(parents=True)
    write_json(run_dir / "config.json", {"num-server-rounds": 3})
    run.save_results(
        Results.from_json(
            {
                "method": "feddifrc",
                "strategy": "fedavg",
                "dataset": "digits",
                "partition": "dirichlet",
                "teacher": {"model": "tiny-seed0", "random-weights": True},
                "platforms": {
                    "server": {"torch": "2.14.1", "cpu-kernels": "AVX512", "machine": "x86_64"},
                    "nodes": [
                        {"torch": "2.14.1", "cpu-kernels": "AVX2", "machine": "x86_64", "partitions": [0, 2]},
                        {"torch": "2.14.1", "cpu-kernels": "AVX512", "machine": "x86_64", "partitions": [1]},
                    ],
                },
                "rounds": [
                    {"round": 0, "test-accuracy": 0.1, "test-loss": 2.3},
                    {
                        "round": 1,
                        "test-accuracy": 0.4,
                        "test-loss": 1.9,
                        "failures": [],
                        "train-metrics": {"train-tdcl": 2.2},
                    },
                    {
                        "round": 2,
                        "test-accuracy": 0.3,
                        "test-loss": 1.7,
                        "failures": [{"node": 5, "partition-id": 1, "reason": "lost"}],
                    },
                ],
            }
        )
    )
