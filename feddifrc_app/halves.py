"""A method's two halves, the protocol every method module implements (``methods/``).

``NodeHalf``: what a node does with a train message, inside ``train.train_local`` (``Batch`` is
one step as a half sees it); ``ServerHalf``: the method's part of the server's run (the setup
query, records for every train message, checkpointed state); ``Node``: what a node half may use.
The ClientApp, the ServerApp, ``rounds`` and ``train`` run these hooks and name no method; this
module sits below all of them and below ``methods/``, so imports run one way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from feddifrc_app.config import Config, NodeConfig

# Types only: loading a run config imports this module, and `feddifrc report` / `status` load one
# without torch; local training (train.py) runs without Flower installed.
if TYPE_CHECKING:
    import numpy as np
    import torch
    from flwr.app import RecordDict

    from feddifrc_app.data.images import ImageData
    from feddifrc_app.results import Results


@dataclass
class Batch:
    """One training step as the node halves see it (``halves.NodeHalf``); ``train_local``
    fills in the outputs.

    x (B, ...) images on the device (augmented when ``augmented``), y (B,) labels, idx (B,)
    dataset indices (CPU); z (B, D) embeddings, logits (B, C); ``z_view`` (B, D): the
    embeddings of a half's extra view of the batch (``NodeHalf.view``), else ``z``."""

    x: torch.Tensor
    y: torch.Tensor
    idx: torch.Tensor
    augmented: bool
    z: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    z_view: torch.Tensor | None = None


SETUP_WORK = "want-stats"  # server -> node, setup query config: do the methods' long setup work


@dataclass(frozen=True)
class Node:
    """What a method's node half may use: the run config, this node's data, its training
    device and seed (``None`` / unused in the setup query, which trains nothing), its
    ``Context.state`` (state kept across rounds; None outside a ClientApp: a tool or benchmark
    running a half that keeps none) and its node config."""

    cfg: Config
    data: ImageData
    ids: np.ndarray
    device: torch.device | None
    seed: int
    state: RecordDict | None = None
    config: NodeConfig | None = field(default=None, kw_only=True)


class NodeHalf:
    """A method's part of one local training; every hook is optional.

    ``train_local`` calls ``start`` once the model is on its device, embeds the half's ``view``
    of each batch in the same forward pass, takes the step's loss from ``loss`` (else CE),
    adds ``term`` (reported as ``train-<name>``, 0 when it never adds one: every node of a round
    reports the same keys) and calls ``before_step`` between backward and the optimiser step;
    the ClientApp calls ``finish`` after training. A diverged training names each half's
    ``divergence_remedy``.
    """

    name = ""
    supervised = True  # False: the half's loss uses no labels (no train-accuracy either)

    def start(self, model: torch.nn.Module) -> Mapping[str, float] | None:
        """Before the first step: ``model`` is the received global model, on its device, in
        training mode. Returns reply metrics of the half's own preparation (or None)."""
        return None

    def view(self, batch: Batch) -> torch.Tensor | None:
        """Other images of the batch (B, ...) to embed in the same forward pass (one call,
        BatchNorm statistics over both); their embeddings are ``batch.z_view``. None: none."""
        return None

    def loss(self, batch: Batch) -> dict[str, torch.Tensor] | None:
        """The step's loss parts in place of CE: ``"total"`` is minimised, every part is reported
        as ``train-<part>``. None: CE (``{"ce", "total"}``). One half of a message at most."""
        return None

    def term(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor | None:
        """An extra loss term for the batch (None: no term)."""
        return None

    def before_step(self, model: torch.nn.Module) -> None:
        """After ``loss.backward()``, before ``opt.step()``."""

    def divergence_remedy(self) -> str:
        """What else to change when local training diverges, besides train.lr and the loss
        weights, naming the key and its value (a contrastive temperature: "raise moon.tau (=
        0.5)"); "" = nothing."""
        return ""

    def finish(self, model: torch.nn.Module, metrics: dict[str, float]) -> dict[str, Any]:
        """After training: add reply metrics to ``metrics``; return extra records for the reply."""
        return {}


class ServerHalf:
    """A method's part of the server's run; every hook is optional. The ServerApp builds it
    before the setup exchange, the round loop restores it from a ``resume-from`` checkpoint."""

    def setup_work(self) -> bool:
        """Whether the setup query asks the nodes for their (long) setup work: sent as
        ``SETUP_WORK``, given ``strategy.setup-timeout``."""
        return False

    def setup_nodes(self) -> int:
        """How many nodes do the setup work: a sample seeded by the run seed, drawn in partition
        order after every node has said who it is; 0 = every node (one query)."""
        return 0

    def after_setup(
        self, setup: Mapping[int, RecordDict], partition_of: Mapping[int, int], results: Results
    ) -> None:
        """The nodes' setup replies (node id -> content; node id -> partition id): check them,
        derive what the rounds need, record it in ``results`` (``results.Results``)."""

    def train_records(self) -> dict[str, Any]:
        """Records added to every train message's content, beside the model."""
        return {}

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of this half (plain tensors / values)."""
        return {}

    def restore(self, checkpoint: Mapping[str, Any]) -> None:
        """Continue from a checkpoint's ``state`` (resume-from)."""
