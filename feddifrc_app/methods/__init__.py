"""The comparison methods, one module each, holding both halves of the method.

The server half writes what a node should do into the train message (a strategy subclass's
``configure_train``, or ``train_config`` for a method that runs under any strategy); the node
half does what the message carries, as Flower's ``FedProx`` writes ``proximal-mu`` and the
node adds the proximal term. A module in this package is picked up by being here; it may define

- ``train_config(cfg) -> dict``: keys the server adds to every train message's config;
- ``node_half(msg, node) -> NodeHalf | None``: what this node does with a train message,
  ``None`` when the message does not ask for the method;
- ``model_options(cfg) -> dict``: keyword arguments of ``model.build_model`` the method sets
  for this run (FedNH's prototype head);
- ``own_strategy(cfg, common) -> Strategy | None``: the strategy the method brings in place of
  ``strategy.name``'s (FedNH), built with ``common``, the arguments every strategy takes;
- its config rules, on the cast values by dotted key (``load_config`` runs them, through
  ``hooks``): ``check_config(values, raw)`` raises ``ConfigError`` for keys that cannot work
  together; ``node_state(values) -> str`` names the setting that keeps per-node state across
  rounds ("" = none: a resumed run can repeat it); ``dp_refusal(values) -> str`` says why
  ``strategy.dp`` cannot wrap it ("" = it can). A method package keeps them in its ``rules``
  module (``feddifrc/rules.py``).

The ClientApp and ``train.train_local`` name no method: they run every ``NodeHalf`` returned.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from flwr.app import Message, RecordDict

from feddifrc_app.config import Config
from feddifrc_app.model import build_model

if TYPE_CHECKING:
    from feddifrc_app.data.images import ImageData


@dataclass(frozen=True)
class Node:
    """What a method's node half may use: the run config, this node's data, its device and
    training seed, and its ``Context.state`` (state kept across rounds)."""

    cfg: Config
    data: ImageData
    ids: np.ndarray
    device: torch.device
    seed: int
    state: RecordDict


class NodeHalf:
    """A method's part of one local training; every hook is optional.

    ``train_local`` calls ``start`` once the model is on its device, adds ``term`` to every
    step's loss (reported as ``train-<name>``, 0 when it never adds one: every node of a round
    reports the same keys) and calls ``before_step`` between backward and
    the optimiser step; the ClientApp calls ``finish`` after training.
    """

    name = ""

    def start(self, model: torch.nn.Module) -> None:
        """Before the first step: ``model`` is the received global model, on its device."""

    def term(self, model: torch.nn.Module, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor | None:
        """An extra loss term for the batch ``x`` with embeddings ``z`` (None: no term)."""
        return None

    def before_step(self, model: torch.nn.Module) -> None:
        """After ``loss.backward()``, before ``opt.step()``."""

    def finish(self, model: torch.nn.Module, metrics: dict[str, float]) -> dict[str, Any]:
        """After training: add reply metrics to ``metrics``; return extra records for the reply."""
        return {}


@functools.cache
def modules() -> tuple[ModuleType, ...]:
    """Every method module of this package, in name order (the order their terms are added)."""
    names = sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
    return tuple(importlib.import_module(f"{__name__}.{n}") for n in names)


def hooks(name: str) -> list[Callable[..., Any]]:
    """Every method's hook ``name`` (above), in module order: a method package's come from
    the package and its ``rules`` module."""
    found = []
    for m in modules():
        parts, rules = [m], f"{m.__name__}.rules"
        if hasattr(m, "__path__") and importlib.util.find_spec(rules) is not None:
            parts.append(importlib.import_module(rules))
        found += [getattr(p, name) for p in parts if hasattr(p, name)]
    return found


def train_config(cfg: Config) -> dict[str, Any]:
    """The config keys every method's server half adds to this run's train messages."""
    out: dict[str, Any] = {}
    for m in modules():
        if hasattr(m, "train_config"):
            out |= m.train_config(cfg)
    return out


def model_for(cfg: Config, num_classes: int) -> torch.nn.Module:
    """The run's classifier: ``model.*``, as the run's method changes it (``model_options``)."""
    options: dict[str, Any] = {}
    for m in modules():
        if hasattr(m, "model_options"):
            options |= m.model_options(cfg)
    return build_model(cfg.model.name, num_classes, cfg.model.width, **options)


def node_halves(msg: Message, node: Node) -> list[NodeHalf]:
    """The node halves this train message asks for."""
    halves = (m.node_half(msg, node) for m in modules() if hasattr(m, "node_half"))
    return [h for h in halves if h is not None]
