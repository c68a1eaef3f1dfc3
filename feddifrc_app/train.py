"""Local training and evaluation of the classifier; returns plain ``dict[str, float]``.

Flower-free: the ClientApp/ServerApp convert between Flower records and the
torch objects used here.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from feddifrc_app.config import Config, TrainConfig
from feddifrc_app.device import node_threads
from feddifrc_app.halves import Batch, NodeHalf


class DivergedError(FloatingPointError):
    """Local training produced a non-finite loss or weights; nothing is sent back."""

    TAG = "diverged:"  # how the server recognises this failure in a node's error reply

    def __init__(self, what: str, remedy: str) -> None:
        super().__init__(f"{self.TAG} {what} became non-finite; {remedy}")


def configure_torch(tc: TrainConfig) -> int:
    """A node's torch settings for one message, set at the start of each handler (a simulation
    actor serves messages of several runs): its intra-op threads (``train.threads``: the float
    sums, so a run's numbers, follow the count, never the machine's cores) and, under
    ``train.deterministic``, deterministic kernels. Returns the thread count."""
    threads = node_threads(tc.threads)
    torch.set_num_threads(threads)
    if tc.deterministic:
        # cuBLAS reads it when this process makes its first handle; set later, torch's error says so
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(tc.deterministic)
    return threads


def lr_remedy(lr: float, halves: Sequence[NodeHalf] = ()) -> str:
    """What to change when local training diverges: train.lr, the loss weights, and what the
    halves name (their contrastive temperatures: ``NodeHalf.divergence_remedy``)."""
    more = "".join(f", or {r}" for h in halves if (r := h.divergence_remedy()))
    return f"lower train.lr (= {lr:g}) or the loss weights{more}"


def clip_gradients(model: nn.Module, max_norm: float) -> None:
    """The trainable parameters' gradient norm clipped at ``max_norm`` (0 = none), as FedNH's code does."""
    if max_norm > 0:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_norm)


def _optimizer(
    model: nn.Module, cfg: Config, momentum_state: dict[str, torch.Tensor] | None, device: torch.device
) -> torch.optim.SGD:
    """The local SGD, with the momentum buffers this node kept from its last round (keep-momentum)."""
    tc = cfg.train
    opt = torch.optim.SGD(model.parameters(), lr=tc.lr, momentum=tc.momentum, weight_decay=tc.weight_decay)
    if momentum_state and tc.momentum > 0:
        _restore_momentum(opt, model, momentum_state, device)
    return opt


def train_local(
    model: nn.Module,
    loader: DataLoader,
    cfg: Config,
    device: torch.device,
    *,
    momentum_state: dict[str, torch.Tensor] | None = None,
    halves: Sequence[NodeHalf] = (),
) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Run ``cfg.train.local_epochs`` epochs of SGD on ``loader`` (items: x, y, dataset index).

    Loss = CE, or the ``loss`` of a method's node half (``halves.NodeHalf``) in its place,
    plus every half's ``term``; each half's ``before_step`` runs between backward and the
    optimiser step (e.g. a gradient correction).
    Returns (the halves' preparation metrics, then the loss parts averaged over samples, plus
    ``local-steps``; SGD momentum buffers by name).
    """
    tc = cfg.train
    model.to(device).train()
    opt = _optimizer(model, cfg, momentum_state, device)
    prepared = {k: v for h in halves for k, v in (h.start(model) or {}).items()}
    run = _Running(device, supervised=all(h.supervised for h in halves))
    augmented = bool(loader.dataset.transform.random)
    for _ in range(tc.local_epochs):
        for x, y, idx in loader:
            batch = Batch(x.to(device, non_blocking=True), y.to(device, non_blocking=True), idx, augmented)
            _forward(model, batch, halves, device)
            parts = _base_loss(batch, halves)
            loss = parts["total"]
            for h in halves:
                if (t := h.term(model, batch)) is not None:
                    parts[h.name], loss = t, loss + t
            opt.zero_grad(set_to_none=True)
            loss.backward()
            for h in halves:
                h.before_step(model)
            clip_gradients(model, tc.max_grad_norm)
            opt.step()
            run.add(parts, batch.logits, batch.y)
        if not math.isfinite(float(run.sums.get("total", 0.0))):
            raise DivergedError("the training loss", lr_remedy(tc.lr, halves))
    if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
        raise DivergedError("the model weights", lr_remedy(tc.lr, halves))
    buffers = {n: opt.state.get(p, {}).get("momentum_buffer") for n, p in model.named_parameters()}
    # A half's term is reported by every node, as 0 where it added none (e.g. a first round):
    # replies with different metric keys are not aggregated (metric_keys.py).
    metrics = prepared | {f"train-{h.name}": 0.0 for h in halves if h.name} | run.metrics()
    return metrics, {n: b.detach().cpu() for n, b in buffers.items() if b is not None}


class _Running:
    """Per-sample sums of the loss parts and the correct predictions of one local training.

    They stay on the device (float64, the same numbers as Python floats): no host sync per
    step; they are read once per epoch."""

    def __init__(self, device: torch.device, supervised: bool) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.seen = self.steps = 0
        self.correct = torch.zeros((), dtype=torch.int64, device=device)
        self.supervised, self.t0 = supervised, time.perf_counter()

    def add(self, parts: dict[str, torch.Tensor], logits: torch.Tensor, y: torch.Tensor) -> None:
        b = y.shape[0]
        self.steps += 1
        self.seen += b
        if self.supervised:
            self.correct += (logits.argmax(1) == y).sum()
        for k, v in parts.items():
            self.sums[k] = self.sums.get(k, 0.0) + v.detach().double() * b

    def metrics(self) -> dict[str, float]:
        """Averages over samples (``train-<part>``, ``train-accuracy``), seconds and ``local-steps``."""
        metrics = {f"train-{k}": float(v) / max(self.seen, 1) for k, v in self.sums.items()}
        if self.supervised:
            metrics["train-accuracy"] = int(self.correct) / max(self.seen, 1)
        metrics["train-seconds"] = time.perf_counter() - self.t0
        metrics["local-steps"] = float(self.steps)
        return metrics


def _forward(model: nn.Module, batch: Batch, halves: Sequence[NodeHalf], device: torch.device) -> None:
    """Fill in the batch's embeddings and logits, and those of a half's extra view (one call)."""
    view = next((v for h in halves if (v := h.view(batch)) is not None), None)
    if view is None:
        batch.z, batch.logits = model(batch.x)
        batch.z_view = batch.z
        return
    b = batch.x.shape[0]
    z_all, logits_all = model(torch.cat([batch.x, view.to(device)]))
    batch.z, batch.logits, batch.z_view = z_all[:b], logits_all[:b], z_all[b:]


def _base_loss(batch: Batch, halves: Sequence[NodeHalf]) -> dict[str, torch.Tensor]:
    """The step's loss parts: a half's ``loss`` in place of CE, else CE."""
    for h in halves:
        if (parts := h.loss(batch)) is not None:
            return parts
    ce = F.cross_entropy(batch.logits, batch.y)
    return {"ce": ce, "total": ce}


def _restore_momentum(
    opt: torch.optim.Optimizer, model: nn.Module, state: dict[str, torch.Tensor], device: torch.device
) -> None:
    """Momentum kept across rounds (train.keep-momentum): put the buffers back by parameter name."""
    for n, p in model.named_parameters():
        if n in state:
            opt.state[p]["momentum_buffer"] = state[n].to(device).clone()


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, device: torch.device) -> dict[str, float]:
    """Cross-entropy loss and accuracy of ``model`` on ``loader`` (items: x, y, idx)."""
    model.to(device).eval()
    total_loss, correct, n = 0.0, 0, 0
    for x, y, _ in loader:
        x, y = x.to(device), y.to(device)
        _, logits = model(x)
        total_loss += float(F.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(1) == y).sum())
        n += y.shape[0]
    return {"loss": total_loss / max(n, 1), "accuracy": correct / max(n, 1)}
