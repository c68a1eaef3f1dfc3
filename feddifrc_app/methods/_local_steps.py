"""What FedNova and SCAFFOLD (option II) share about a node's local SGD steps: not a method
(the leading underscore keeps discovery away), so either module can be removed alone."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from feddifrc_app.casting import invalid


def normalising_factor(steps: int, momentum: float) -> float:
    """a_i of a node that ran ``steps`` SGD steps with momentum ``momentum``."""
    if momentum == 0:
        return float(steps)
    return (steps - momentum * (1 - momentum**steps) / (1 - momentum)) / (1 - momentum)


def fresh_momentum(v: Mapping[str, Any]) -> None:
    """a_i (and SCAFFOLD's a_K) assume momentum buffers that start at zero every round."""
    if v["train.keep-momentum"]:
        raise invalid("train.keep-momentum", True, f"not with strategy.name = '{v['strategy.name']}'")
