"""Local training and evaluation of the classifier; returns plain ``dict[str, float]``.

Flower-free: the ClientApp/ServerApp convert between Flower records and the
torch objects used here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from feddifrc_app import losses
from feddifrc_app.config import Config, LossConfig
from feddifrc_app.dataset import clean_batch

if TYPE_CHECKING:  # only the type: training never touches the teacher itself
    from feddifrc_app.targets import TeacherTargets


class DivergedError(FloatingPointError):
    """Local training produced a non-finite loss or weights; nothing is sent back."""

    TAG = "diverged:"  # how the server recognises this failure in a node's error reply

    def __init__(self, what: str, lr: float) -> None:
        super().__init__(
            f"{self.TAG} {what} became non-finite; lower train.lr (= {lr:g}) or the loss weights"
        )


def _proximal_term(model: nn.Module, global_params: list[torch.Tensor]) -> torch.Tensor:
    # FedProx: (mu/2) * ||w - w_global||^2 over trainable parameters; the caller scales by mu/2.
    return sum((p - g).pow(2).sum() for p, g in zip(model.parameters(), global_params, strict=True))


def train_local(
    model: nn.Module,
    loader: DataLoader,
    cfg: Config,
    device: torch.device,
    *,
    targets: TeacherTargets | None = None,
    proximal_mu: float = 0.0,
    momentum_state: dict[str, torch.Tensor] | None = None,
    seed: int = 0,
    before_step: Callable[[nn.Module], None] | None = None,
    extra_term: tuple[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] | None = None,
) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Run ``cfg.train.local_epochs`` epochs of SGD on ``loader`` (items: x, y, dataset index).

    Loss = CE (unless self-supervised) + tdcl_weight * TDCL + ndcr_weight * NDCR (+ FedProx).
    ``before_step(model)`` runs between backward and the optimiser step (SCAFFOLD's correction);
    ``extra_term = (name, f)`` adds ``f(x, z)`` to the loss (MOON's contrastive term).
    Returns (metrics averaged over samples, plus ``local-steps``; SGD momentum buffers by name).
    """
    tc, lc = cfg.train, cfg.loss
    ssl = cfg.method == "feddifrc-ssl"
    use_teacher = cfg.uses_diffusion
    if use_teacher and targets is None:
        raise ValueError(f"method {cfg.method!r} needs teacher targets")
    model.to(device).train()
    if use_teacher:
        targets = targets.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=tc.lr, momentum=tc.momentum, weight_decay=tc.weight_decay)
    if momentum_state and tc.momentum > 0:
        _restore_momentum(opt, model, momentum_state, device)
    global_params = [p.detach().clone() for p in model.parameters()] if proximal_mu > 0 else []
    gen = torch.Generator().manual_seed(seed)  # negative sampling in TDCL

    # Running sums stay on the device (float64, the same numbers as Python floats): no host sync
    # per step; they are read once per epoch.
    sums: dict[str, torch.Tensor] = {}
    seen = steps = 0
    correct = torch.zeros((), dtype=torch.int64, device=device)
    t0 = time.perf_counter()
    # NDCR's target was computed from the un-augmented image: align that view's embedding, in the
    # same forward pass as the augmented batch (one call, BatchNorm statistics over both).
    clean_view = (
        use_teacher and lc.ndcr_weight > 0 and lc.ndcr_view == "clean" and loader.dataset.transform.random
    )
    data = loader.dataset.data if clean_view else None
    for _ in range(tc.local_epochs):
        for x, y, idx in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            b = y.shape[0]
            if clean_view:
                z_all, logits_all = model(torch.cat([x, clean_batch(data, idx).to(device)]))
                z, logits, z_ndcr = z_all[:b], logits_all[:b], z_all[b:]
            else:
                z, logits = model(x)
                z_ndcr = z
            reps = ndcr = None
            if use_teacher:
                reps, ndcr = targets.take(idx)
                reps = None if reps is None else reps.to(device)
                ndcr = None if ndcr is None else ndcr.to(device)
            parts = _loss_parts(
                logits, y, z, reps, ndcr, lc, ssl=ssl, use_teacher=use_teacher, gen=gen, ndcr_z=z_ndcr
            )
            loss = parts["total"]
            if extra_term is not None:
                parts[extra_term[0]] = extra_term[1](x, z)
                loss = loss + parts[extra_term[0]]
            if proximal_mu > 0:
                prox = 0.5 * proximal_mu * _proximal_term(model, global_params)
                loss = loss + prox
                parts["prox"] = prox.detach()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if before_step is not None:
                before_step(model)
            opt.step()
            steps += 1
            if use_teacher and ndcr is not None:
                parts["ndcr-cosine"] = losses.cosine_alignment(z_ndcr.detach(), ndcr)
            seen += b
            if not ssl:
                correct += (logits.argmax(1) == y).sum()
            for k, v in parts.items():
                sums[k] = sums.get(k, 0.0) + v.detach().double() * b
        if not math.isfinite(float(sums.get("total", 0.0))):
            raise DivergedError("the training loss", tc.lr)
    if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
        raise DivergedError("the model weights", tc.lr)
    metrics = {f"train-{k}": float(v) / max(seen, 1) for k, v in sums.items()}
    if not ssl:
        metrics["train-accuracy"] = int(correct) / max(seen, 1)
    metrics["train-seconds"] = time.perf_counter() - t0
    metrics["local-steps"] = float(steps)
    buffers = {n: opt.state.get(p, {}).get("momentum_buffer") for n, p in model.named_parameters()}
    return metrics, {n: b.detach().cpu() for n, b in buffers.items() if b is not None}


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
