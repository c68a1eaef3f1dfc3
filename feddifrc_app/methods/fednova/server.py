"""FedNova's strategy: FedAvg's sampling and metrics, the normalised model update (the method:
``fednova/__init__.py``)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from feddifrc_app.methods.fednova import A_KEY
from feddifrc_app.records import arrays_to_record, example_weights, is_bn_statistic


class FedNova(FedAvg):
    """FedAvg's sampling and metrics, FedNova's normalised model update."""

    CHECKPOINTED = ("current_arrays",)  # the server state resume restores

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.current_arrays: dict[str, np.ndarray] | None = None

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self.current_arrays = {k: v.numpy() for k, v in arrays.items()}
        config[A_KEY] = True
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        averaged, metrics = super().aggregate_train(server_round, replies)
        p = example_weights([r.content for r in replies])
        a = np.array([float(r.content["metrics"][A_KEY]) for r in replies])
        tau_eff = float(p @ a)
        new = {}
        for k, x_k in self.current_arrays.items():
            if is_bn_statistic(k):
                new[k] = averaged[k].numpy()
                continue
            d = sum(
                p_i / a_i * (x_k - r.content["arrays"][k].numpy())
                for p_i, a_i, r in zip(p, a, replies, strict=True)
            )
            new[k] = (x_k - tau_eff * d).astype(x_k.dtype)
        return arrays_to_record(new), metrics
