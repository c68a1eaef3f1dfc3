"""SCAFFOLD's strategy: FedAvg's sampling and metrics, the server's model and control-variate
updates (the method: ``scaffold/__init__.py``)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from feddifrc_app.federation import NUM_NODES
from feddifrc_app.methods.scaffold import ACCEPTED, CONTROL, DELTA
from feddifrc_app.records import arrays_to_record, example_weights, is_bn_statistic


class Scaffold(FedAvg):
    """FedAvg's sampling and metrics, SCAFFOLD's model and control-variate updates."""

    CHECKPOINTED = ("current_arrays", "control", "accepted")  # the server state resume restores

    def __init__(self, *, server_learning_rate: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.eta_g = server_learning_rate
        self.num_nodes = 0  # N of the round being trained
        self.fraction_of_nodes = 0.0  # |S| / N of the last aggregated round, as it really was
        self.current_arrays: dict[str, np.ndarray] | None = None
        self.control: dict[str, np.ndarray] = {}
        self.accepted: dict[int, int] = {}  # node id -> last round its delta_c_i was added to c

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self.current_arrays = {k: v.numpy() for k, v in arrays.items()}
        self.num_nodes = int(config.get(NUM_NODES, len(grid.get_node_ids())))
        control = arrays_to_record(self.control)
        out = []
        for m in super().configure_train(server_round, arrays, config, grid):
            # One content per node (FedAvg shares one): each node is told its own accepted round.
            dst = m.metadata.dst_node_id
            node_config = ConfigRecord({**m.content["config"], ACCEPTED: int(self.accepted.get(dst, 0))})
            content = RecordDict({"arrays": arrays, "config": node_config, CONTROL: control})
            out.append(Message(content=content, message_type=m.metadata.message_type, dst_node_id=dst))
        return out

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        self.fraction_of_nodes = len(replies) / max(self.num_nodes, 1)
        # Not FedAvg.aggregate_train: it refuses replies that carry a second ArrayRecord (delta c).
        metrics = self.train_metrics_aggr_fn([r.content for r in replies], self.weighted_by_key)
        x = self.current_arrays
        weights = example_weights([r.content for r in replies])
        new = {}
        for k, x_k in x.items():
            step = sum(
                w * (r.content["arrays"][k].numpy() - x_k) for w, r in zip(weights, replies, strict=True)
            )
            eta = 1.0 if is_bn_statistic(k) else self.eta_g  # statistics are averaged, not stepped
            new[k] = (x_k + eta * step).astype(x_k.dtype)
        deltas = [{k: v.numpy() for k, v in r.content[DELTA].items()} for r in replies]
        for k in deltas[0]:
            mean = sum(d[k] for d in deltas) / len(deltas)
            self.control[k] = self.control.get(k, np.zeros_like(mean)) + self.fraction_of_nodes * mean
        self.accepted |= {r.metadata.src_node_id: server_round for r in replies}
        return arrays_to_record(new), metrics
