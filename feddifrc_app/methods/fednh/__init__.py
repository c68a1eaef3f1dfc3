"""FedNH (Dai et al., AAAI 2023): class prototypes as the classifier, moved by the server.

Nodes train the network under frozen prototypes (``head.PrototypeHead``) and then send,
per class c they hold, ``n_c * normalise(mean of the normalised embeddings)`` and ``n_c``.
The server (as FedNH's public code): ``avg_c = normalise(sum_i scaled_ic / sum_i n_ic)``,
``p_c <- normalise(rho * p_c + (1 - rho) * avg_c)``; a class no node holds keeps p_c. The
rest of the model is averaged as in FedAvg. Local training clips the gradient norm of the
trainable parameters at ``fednh.max-grad-norm`` (FedNH's code: ``clip_grad_norm_(..., 10)``
after every backward), and the head's scale starts at ``fednh.scale`` (FedNH's ResNet: 20).

Here: the record keys, the config rules and the model options (Flower-free: ``load_config`` runs
the rules where Flower is not installed); the node half in ``node.py``, the strategy in
``server.py``, imported when a hook is called.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from feddifrc_app.casting import ConfigError, invalid
from feddifrc_app.config import Config, key
from feddifrc_app.strategy_rules import TWO_RECORDS

if TYPE_CHECKING:
    from flwr.app import Message
    from flwr.serverapp.strategy import Strategy

    from feddifrc_app.halves import Node
    from feddifrc_app.methods.fednh.node import Prototypes

NAMES = ("fednh",)  # the method values of this package


@dataclass(frozen=True)
class FedNHConfig:
    rho: float = key(lo=0.0, hi=1.0)  # prototype smoothing (FedNH: 0.9)
    scale: float = key(lo=0.0, lo_open=True)  # initial learnable logit scale (FedNH's ResNet: 20, CNN: 1)
    max_grad_norm: float = key(lo=0.0)  # local gradient clipping (FedNH's code: 10); 0 = none


SECTIONS = {"fednh": FedNHConfig}

# server -> node config: "send your prototypes"; node -> server: {"scaled": (C, D), "counts": (C,)}
PROTOTYPES = "fednh-prototypes"
KEY = "fc.prototype"  # the prototypes in the model's state dict


def check_config(v: Mapping[str, Any], raw: Mapping[str, Any]) -> None:
    if v["method"] == "fednh" and v["strategy.name"] != "fedavg":
        raise invalid(
            "strategy.name", v["strategy.name"], "method 'fednh' brings its own aggregation: use 'fedavg'"
        )
    own, every = v["fednh.max-grad-norm"], v["train.max-grad-norm"]
    if v["method"] == "fednh" and own > 0 and every > 0:
        # Both would clip each step, in effect at the smaller norm: one key must say which.
        raise ConfigError(
            f"config keys 'fednh.max-grad-norm' = {own:g} and 'train.max-grad-norm' = {every:g} both clip "
            "FedNH's local gradients: set one of them to 0"
        )


def dp_refusal(v: Mapping[str, Any]) -> str:
    # Server-side clipping would clip the prototypes against the model; the client mods refuse them.
    return f"method = 'fednh' {TWO_RECORDS}" if v["method"] == "fednh" else ""


def own_strategy(cfg: Config, common: dict[str, Any]) -> Strategy | None:
    """FedAvg for the network, FedNH for the prototypes (in place of strategy.name's FedAvg)."""
    if cfg.method != "fednh":
        return None
    from feddifrc_app.methods.fednh.server import FedNH

    return FedNH(**common, rho=cfg.fednh.rho)


def model_options(cfg: Config) -> dict[str, Any]:
    """FedNH's classifier is its prototype head (``head.PrototypeHead``)."""
    if cfg.method != "fednh":
        return {}
    from feddifrc_app.methods.fednh.head import PrototypeHead

    return {"head": functools.partial(PrototypeHead, scale=cfg.fednh.scale)}


def node_half(msg: Message, n: Node) -> Prototypes | None:
    from feddifrc_app.methods.fednh import node

    return node.node_half(msg, n)
