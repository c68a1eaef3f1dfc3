"""FedNH's strategy: FedAvg for the network, the server's prototype smoothing (the method:
``fednh/__init__.py``)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from feddifrc_app.methods.fednh import KEY, PROTOTYPES
from feddifrc_app.records import arrays_to_record, example_weights


def smooth(old: np.ndarray, scaled: list[np.ndarray], counts: list[np.ndarray], rho: float) -> np.ndarray:
    """The server's prototype update: old (C, D), per node scaled (C, D) and counts (C,)."""
    total = sum(counts)
    avg = sum(scaled) / np.maximum(total, 1e-12)[:, None]
    avg = avg / np.maximum(np.linalg.norm(avg, axis=1, keepdims=True), 1e-12)
    new = rho * old + (1 - rho) * avg
    new = new / np.maximum(np.linalg.norm(new, axis=1, keepdims=True), 1e-12)
    return np.where((total > 0)[:, None], new, old).astype(old.dtype)


class FedNH(FedAvg):
    """FedAvg for the network, FedNH's smoothing for the prototypes."""

    def __init__(self, *, rho: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.rho = rho

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        config[PROTOTYPES] = True
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        # Not FedAvg.aggregate_train: it refuses replies that carry a second ArrayRecord.
        contents = [r.content for r in replies]
        metrics = self.train_metrics_aggr_fn(contents, self.weighted_by_key)
        weights = example_weights(contents)
        arrays = {
            k: sum(w * c["arrays"][k].numpy() for w, c in zip(weights, contents, strict=True))
            for k in contents[0]["arrays"]
        }
        # Frozen on the nodes: every reply holds the prototypes the server sent.
        old = contents[0]["arrays"][KEY].numpy()
        scaled = [c[PROTOTYPES]["scaled"].numpy() for c in contents]
        counts = [c[PROTOTYPES]["counts"].numpy() for c in contents]
        arrays[KEY] = smooth(old, scaled, counts, self.rho)
        return arrays_to_record({k: np.asarray(v, dtype=np.float32) for k, v in arrays.items()}), metrics
