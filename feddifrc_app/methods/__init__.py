"""The methods, one module (or package) each, holding both halves of the method and its config.

The server half writes what a node should do into the messages (a strategy subclass's
``configure_train``, ``train_config``, or a ``ServerHalf``'s records); the node half does what
the message carries, as Flower's ``FedProx`` writes ``proximal-mu`` and the node adds the
proximal term. A module in this package is picked up by being here; it may define

- ``train_config(cfg) -> dict``: keys the server adds to every train message's config;
- ``node_half(msg, node) -> NodeHalf | None``: what this node does with a train message,
  ``None`` when the message does not ask for the method;
- ``model_options(cfg) -> dict``: keyword arguments of ``model.build_model`` the method sets
  for this run (FedNH's prototype head);
- ``setup_reply(msg, node, info) -> dict``: the node half of the setup query: adds keys to the
  reply's ``info`` (e.g. the teacher's identity) and returns extra records for the reply
  (e.g. statistics the query's config asks for);
- ``server_half(cfg) -> ServerHalf | None``: the method's part of the server's run (what the
  setup query asks, what it does with the replies, records for every train message, its
  checkpointed state);
- ``STRATEGIES`` (with ``strategies()``): the ``strategy.name`` values it brings -> the
  strategy.* keys that shape their aggregate (``strategy_keys``; config.py names none of them);
- ``RESULTS``: the results.json keys its server half sets in ``Results.extra`` -> their types
  (``results_keys``; results.py names no method);
- ``central_evaluation(cfg, loader, device) -> callable | None``: replaces the server's
  central evaluation (``rounds.CentralEvaluator``) for a method that trains no classifier;
- ``own_strategy(cfg, common) -> Strategy | None``: the strategy the method brings in place of
  ``strategy.name``'s (FedNH), built with ``common``, the arguments every strategy takes;
- its config rules, on the cast values by dotted key (``load_config`` runs them, through
  ``hooks``): ``check_inputs(values, raw)`` (first: the inputs it reads, e.g. its teacher) and
  ``check_config(values, raw)`` (after the strategy's and DP's) raise ``ConfigError`` for keys
  that cannot work together; ``node_state(values) -> str`` names the setting that keeps per-node
  state across rounds ("" = none: a resumed run can repeat it); ``dp_refusal(values) -> str``
  says why ``strategy.dp`` cannot wrap it ("" = it can). A method package keeps them in its
  ``__init__`` or its ``rules`` module (``feddifrc/rules.py``).

``load_config`` imports every method module (and a package's ``rules``) to run those rules, and
it runs where Flower is not installed (a GPU host's check): a method module, a package's
``__init__`` and ``rules`` import Flower only for types or inside a hook; a package keeps its
Flower code in submodules its hooks import when called (``scaffold/server.py``: the strategy,
``scaffold/node.py``: the node half). ``tests/test_method_rules.py`` loads every run config
without Flower.

The ClientApp, the ServerApp, ``rounds`` and ``train.train_local`` name no method: they run
every half returned. Adding a method takes its module here (its ``NAMES``, the ``method`` values
it provides, and ``SECTIONS``, its config sections: ``config_loader`` composes them), its
defaults in pyproject.toml and its tests. The protocol itself (``NodeHalf``, ``ServerHalf``,
``Node``, ``Batch``) is ``halves.py``, below this package and ``train.py``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import pkgutil
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any

from feddifrc_app.config import Config
from feddifrc_app.halves import Node, NodeHalf, ServerHalf

# Types only: load_config imports this package where Flower is not installed, and without torch
# until it finds the method modules (`feddifrc report` / `status` never do).
if TYPE_CHECKING:
    import torch
    from flwr.app import ConfigRecord, Message, RecordDict

    from feddifrc_app.results import Results


class ServerHalves(ServerHalf):
    """The server halves of every method module, run as one."""

    def __init__(self, halves: list[ServerHalf]) -> None:
        self.halves = halves

    def setup_work(self) -> bool:
        return any(h.setup_work() for h in self.halves)

    def setup_nodes(self) -> int:
        wanted = [h.setup_nodes() for h in self.halves if h.setup_work()]
        return 0 if not wanted or 0 in wanted else max(wanted)  # every node, if any half asks

    def after_setup(
        self, setup: Mapping[int, RecordDict], partition_of: Mapping[int, int], results: Results
    ) -> None:
        for h in self.halves:
            h.after_setup(setup, partition_of, results)

    def train_records(self) -> dict[str, Any]:
        return {k: v for h in self.halves for k, v in h.train_records().items()}

    def state(self) -> dict[str, Any]:
        return {k: v for h in self.halves for k, v in h.state().items()}

    def restore(self, checkpoint: Mapping[str, Any]) -> None:
        for h in self.halves:
            h.restore(checkpoint)


@functools.cache
def modules() -> tuple[ModuleType, ...]:
    """Every method module of this package, in name order (the order their terms are added)."""
    names = sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
    return tuple(importlib.import_module(f"{__name__}.{n}") for n in names)


def hooks(name: str) -> list[Callable[..., Any]]:
    """Every method's hook ``name`` (above), in module order: a method package's come from
    the package and its ``rules`` module."""
    return [getattr(p, name) for p in _with_rules(modules()) if hasattr(p, name)]


@functools.cache
def _with_rules(found: tuple[ModuleType, ...]) -> tuple[ModuleType, ...]:
    """``found`` with each package's ``rules`` module after it. Once per set of modules: hooks run
    for every ClientApp message, and a find_spec per package each time was a fifth of a setup
    query's handler (5,000 of them at 5,000 nodes)."""
    out = []
    for m in found:
        out.append(m)
        rules = f"{m.__name__}.rules"
        if hasattr(m, "__path__") and importlib.util.find_spec(rules) is not None:
            out.append(importlib.import_module(rules))
    return tuple(out)


def names() -> tuple[str, ...]:
    """The ``method`` values the modules provide (their ``NAMES``), in module order."""
    return tuple(n for found in hooks("NAMES") for n in found)


def sections() -> dict[str, type]:
    """Every method's config sections (its ``SECTIONS``: name -> dataclass), in module order."""
    return {n: cls for found in hooks("SECTIONS") for n, cls in found.items()}


def strategy_keys() -> dict[str, tuple[str, ...]]:
    """The strategies the methods bring (their ``STRATEGIES``: name -> the strategy.* keys that
    shape its aggregate), in module order."""
    return {n: k for found in hooks("STRATEGIES") for n, k in found.items()}


def results_keys() -> dict[str, type | tuple[type, ...]]:
    """Every method's own results.json keys (its ``RESULTS``: key -> type), in module order:
    ``Results.from_json`` checks a file's against them."""
    return {k: t for found in hooks("RESULTS") for k, t in found.items()}


def section_readers() -> dict[str, tuple[str, ...]]:
    """Each method section -> the ``method`` values that read it (its module's ``NAMES``)."""
    found = _with_rules(modules())
    return {n: tuple(getattr(m, "NAMES", ())) for m in found for n in getattr(m, "SECTIONS", {})}


def train_config(cfg: Config) -> dict[str, Any]:
    """The config keys every method's server half adds to this run's train messages."""
    return {k: v for f in hooks("train_config") for k, v in f(cfg).items()}


def model_for(cfg: Config, num_classes: int) -> torch.nn.Module:
    """The run's classifier: ``model.*``, as the run's method changes it (``model_options``)."""
    from feddifrc_app.model import build_model

    options = {k: v for f in hooks("model_options") for k, v in f(cfg).items()}
    return build_model(cfg.model.name, num_classes, cfg.model.width, **options)


def node_halves(msg: Message, node: Node) -> list[NodeHalf]:
    """The node halves this train message asks for."""
    halves = (f(msg, node) for f in hooks("node_half"))
    return [h for h in halves if h is not None]


def setup_reply(msg: Message, node: Node, info: ConfigRecord) -> dict[str, Any]:
    """Every method's part of this node's setup reply: keys added to ``info``, extra records."""
    return {k: v for f in hooks("setup_reply") for k, v in f(msg, node, info).items()}


def server_half(cfg: Config) -> ServerHalves:
    """The server halves of this run's methods, as one."""
    halves = (f(cfg) for f in hooks("server_half"))
    return ServerHalves([h for h in halves if h is not None])


def central_evaluation(cfg: Config, loader: Callable, device: torch.device) -> Callable | None:
    """The run's method's own central evaluation (``model -> {split: loader}`` -> the row's
    ``<split>-accuracy`` / ``<split>-loss``), or None for the classifier's accuracy and loss.
    ``loader``: ``ImageData -> DataLoader`` as the server evaluates."""
    found = [e for f in hooks("central_evaluation") if (e := f(cfg, loader, device)) is not None]
    if len(found) > 1:
        raise ValueError(f"{len(found)} methods replace the central evaluation; at most one may")
    return found[0] if found else None
