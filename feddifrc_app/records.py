"""Flower records <-> torch state dicts and numpy arrays: the only place that converts them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, RecordDict

MODEL = "arrays"  # the model's ArrayRecord in train and evaluate messages (Flower's strategies' key)


def shared_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The entries of a model state that travel: BN's ``num_batches_tracked`` is unused (momentum is
    set) and its integer type breaks FedOpt's float maths."""
    return {k: v.detach().cpu() for k, v in state.items() if not k.endswith("num_batches_tracked")}


def is_bn_statistic(key: str) -> bool:
    """BatchNorm running statistics: averaged, never treated as a gradient step."""
    return key.endswith(("running_mean", "running_var"))


def state_to_record(state: Mapping[str, torch.Tensor]) -> ArrayRecord:
    return ArrayRecord(shared_state(state))


def record_to_state(rec: ArrayRecord) -> dict[str, torch.Tensor]:
    return rec.to_torch_state_dict()


def arrays_to_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})


def example_weights(contents: Sequence[RecordDict]) -> np.ndarray:
    """Each reply's share of the examples (its ``num-examples`` metric), summing to 1."""
    w = np.array([float(c["metrics"]["num-examples"]) for c in contents])
    return w / w.sum()


def record_to_arrays(rec: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in rec.items()}
