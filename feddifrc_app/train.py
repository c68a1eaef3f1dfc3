"""Local training and evaluation of the classifier; returns plain ``dict[str, float]``.

Flower-free: the ClientApp/ServerApp convert between Flower records and the
torch objects used here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from feddifrc_app.config import Config, LossConfig
from feddifrc_app.data.loader import clean_batch
from feddifrc_app.methods.feddifrc import losses

if TYPE_CHECKING:  # only the types: training never touches the teacher or Flower itself
    from feddifrc_app.methods import NodeHalf
    from feddifrc_app.methods.feddifrc.targets import TeacherTargets


class DivergedError(FloatingPointError):
    """Local training produced a non-finite loss or weights; nothing is sent back."""

    TAG = "diverged:"  # how the server recognises this failure in a node's error reply

    def __init__(self, what: str, remedy: str) -> None:
        super().__init__(f"{self.TAG} {what} became non-finite; {remedy}")


def lr_remedy(lr: float) -> str:
    """What to change when local training diverges."""
    return f"lower train.lr (= {lr:g}) or the loss weights"


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
    targets: TeacherTargets | None = None,
    momentum_state: dict[str, torch.Tensor] | None = None,
    seed: int = 0,
    halves: Sequence[NodeHalf] = (),
) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Run ``cfg.train.local_epochs`` epochs of SGD on ``loader`` (items: x, y, dataset index).

    Loss = CE (unless self-supervised) + tdcl_weight * TDCL + ndcr_weight * NDCR, plus the
    ``term`` of every method's node half (``methods.NodeHalf``: FedProx, MOON), whose
    ``before_step`` runs between backward and the optimiser step (SCAFFOLD's correction).
    Returns (metrics averaged over samples, plus ``local-steps``; SGD momentum buffers by name).
    """
    tc, lc = cfg.train, cfg.loss
    ssl, use_teacher = cfg.self_supervised, cfg.uses_diffusion
    if use_teacher and targets is None:
        raise ValueError(f"method {cfg.method!r} needs teacher targets")
    model.to(device).train()
    targets = targets.on(device, loader.dataset.indices) if use_teacher else None
    opt = _optimizer(model, cfg, momentum_state, device)
    for h in halves:
        h.start(model)
    gen = torch.Generator().manual_seed(seed)  # negative sampling in TDCL
    run = _Running(device, ssl)
    clean = _clean_view_data(loader, lc) if use_teacher else None
    for _ in range(tc.local_epochs):
        for x, y, idx in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            z, logits, z_ndcr = _forward(model, x, idx, clean, device)
            reps, ndcr = _teacher_batch(targets, idx, device)
            parts = _loss_parts(
                logits, y, z, reps, ndcr, lc, ssl=ssl, use_teacher=use_teacher, gen=gen, ndcr_z=z_ndcr
            )
            loss = parts["total"]
            for h in halves:
                if (t := h.term(model, x, z)) is not None:
                    parts[h.name], loss = t, loss + t
            opt.zero_grad(set_to_none=True)
            loss.backward()
            for h in halves:
                h.before_step(model)
            opt.step()
            if ndcr is not None:
                parts["ndcr-cosine"] = losses.cosine_alignment(z_ndcr.detach(), ndcr)
            run.add(parts, logits, y)
        if not math.isfinite(float(run.sums.get("total", 0.0))):
            raise DivergedError("the training loss", lr_remedy(tc.lr))
    if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
        raise DivergedError("the model weights", lr_remedy(tc.lr))
    buffers = {n: opt.state.get(p, {}).get("momentum_buffer") for n, p in model.named_parameters()}
    # A half's term is reported by every node, as 0 where it added none (MOON's first round):
    # replies with different metric keys are not aggregated (metric_keys.py).
    metrics = {f"train-{h.name}": 0.0 for h in halves if h.name} | run.metrics()
    return metrics, {n: b.detach().cpu() for n, b in buffers.items() if b is not None}


class _Running:
    """Per-sample sums of the loss parts and the correct predictions of one local training.

    They stay on the device (float64, the same numbers as Python floats): no host sync per
    step; they are read once per epoch."""

    def __init__(self, device: torch.device, ssl: bool) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.seen = self.steps = 0
        self.correct = torch.zeros((), dtype=torch.int64, device=device)
        self.ssl, self.t0 = ssl, time.perf_counter()

    def add(self, parts: dict[str, torch.Tensor], logits: torch.Tensor, y: torch.Tensor) -> None:
        b = y.shape[0]
        self.steps += 1
        self.seen += b
        if not self.ssl:
            self.correct += (logits.argmax(1) == y).sum()
        for k, v in parts.items():
            self.sums[k] = self.sums.get(k, 0.0) + v.detach().double() * b

    def metrics(self) -> dict[str, float]:
        """Averages over samples (``train-<part>``, ``train-accuracy``), seconds and ``local-steps``."""
        metrics = {f"train-{k}": float(v) / max(self.seen, 1) for k, v in self.sums.items()}
        if not self.ssl:
            metrics["train-accuracy"] = int(self.correct) / max(self.seen, 1)
        metrics["train-seconds"] = time.perf_counter() - self.t0
        metrics["local-steps"] = float(self.steps)
        return metrics


def _clean_view_data(loader: DataLoader, lc: LossConfig):
    """The dataset's images when NDCR aligns the clean view of augmented batches, else None.

    NDCR's target was computed from the un-augmented image: that view's embedding is taken in
    the same forward pass as the augmented batch (one call, BatchNorm statistics over both)."""
    clean = lc.ndcr_weight > 0 and lc.ndcr_view == "clean" and loader.dataset.transform.random
    return loader.dataset.data if clean else None


def _forward(model: nn.Module, x: torch.Tensor, idx: torch.Tensor, clean, device: torch.device):
    """(z, logits, the embedding NDCR aligns) of the batch ``x``."""
    if clean is None:
        z, logits = model(x)
        return z, logits, z
    b = x.shape[0]
    z_all, logits_all = model(torch.cat([x, clean_batch(clean, idx).to(device)]))
    return z_all[:b], logits_all[:b], z_all[b:]


def _teacher_batch(targets: TeacherTargets | None, idx: torch.Tensor, device: torch.device):
    """(TDCL representations, NDCR targets) of the batch's images; (None, None) without a teacher."""
    if targets is None:
        return None, None
    reps, ndcr = targets.take(idx)
    # Per-batch fusion returns CPU tensors; targets moved by ``on`` are already there (a no-op).
    return tuple(None if t is None else t.to(device, non_blocking=True) for t in (reps, ndcr))


def _restore_momentum(
    opt: torch.optim.Optimizer, model: nn.Module, state: dict[str, torch.Tensor], device: torch.device
) -> None:
    """Momentum kept across rounds (train.keep-momentum): put the buffers back by parameter name."""
    for n, p in model.named_parameters():
        if n in state:
            opt.state[p]["momentum_buffer"] = state[n].to(device).clone()


def _loss_parts(
    logits: torch.Tensor,
    y: torch.Tensor,
    z: torch.Tensor,
    reps: torch.Tensor | None,
    ndcr: torch.Tensor | None,
    lc: LossConfig,
    *,
    ssl: bool,
    use_teacher: bool,
    gen: torch.Generator,
    ndcr_z: torch.Tensor,
) -> dict[str, torch.Tensor]:
    if not use_teacher:
        ce = F.cross_entropy(logits, y)
        return {"ce": ce, "total": ce}
    # Self-supervised: no CE; reps (B, 1 + K, D) = positive prompt first, then the negatives.
    parts = losses.feddifrc_loss(
        None if ssl else logits,
        None if ssl else y,
        z,
        reps,
        ndcr,
        variant=lc.variant,
        tdcl_weight=lc.tdcl_weight,
        ndcr_weight=lc.ndcr_weight,
        temperature=lc.temperature,
        num_negatives=lc.num_negatives,
        normaliser=lc.tdcl_normaliser,
        ndcr_space=lc.ndcr_space,
        generator=gen,
        ndcr_z=ndcr_z,
    )
    if ssl:
        del parts["ce"]  # not a loss term here: no "train-ce" metric (it would read as a CE of 0)
    return parts


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


@torch.no_grad()
def embed(
    model: nn.Module, loader: Iterable, device: torch.device
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(features (N, D), labels (N,), dataset indices (N,)) of ``model`` over ``loader``."""
    model.to(device).eval()
    feats, labels, ids = [], [], []
    for x, y, idx in loader:
        z, _ = model(x.to(device))
        feats.append(z.float().cpu().numpy())
        labels.append(y.numpy())
        ids.append(idx.numpy())
    return np.concatenate(feats), np.concatenate(labels), np.concatenate(ids)


def linear_probe(
    train_feats: np.ndarray,
    train_labels: np.ndarray,
    test_feats: np.ndarray,
    test_labels: np.ndarray,
    *,
    epochs: int,
    seed: int,
) -> float:
    """Accuracy of a logistic-regression probe fit on frozen features (self-supervised evaluation)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    scaler = StandardScaler().fit(train_feats)
    clf = LogisticRegression(max_iter=max(100, 10 * epochs), random_state=seed)
    clf.fit(scaler.transform(train_feats), train_labels)
    return float((clf.predict(scaler.transform(test_feats)) == test_labels).mean())
