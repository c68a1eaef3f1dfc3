"""The self-supervised variant's central evaluation: a linear probe on the frozen embeddings.

``feddifrc-ssl`` trains no classifier head, so the server scores the global model by a
logistic-regression probe fit on the embeddings of the training split and read on each split.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import numpy as np
import torch
from torch import nn

from feddifrc_app.config import Config
from feddifrc_app.data.registry import load_dataset


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


class LinearProbe:
    """``model -> {split: loader | None}`` -> ``<split>-accuracy`` (the probe's) and ``<split>-loss``
    (None: a probe has no loss of the model's); the training split is loaded once, here, before
    the setup exchange (``rounds.CentralEvaluator``)."""

    def __init__(self, cfg: Config, loader: Callable, device: torch.device) -> None:
        self.cfg, self.device = cfg, device
        self.train = loader(load_dataset(cfg.dataset, "train", seed=cfg.seed))

    def __call__(self, model: nn.Module, splits: Mapping[str, Iterable | None]) -> dict[str, float | None]:
        fit = embed(model, self.train, self.device)
        out: dict[str, float | None] = {}
        for name, loader in splits.items():
            acc = None
            if loader is not None:
                f, y, _ = embed(model, loader, self.device)
                acc = linear_probe(fit[0], fit[1], f, y, epochs=self.cfg.ssl.probe_epochs, seed=self.cfg.seed)
            out |= {f"{name}-accuracy": acc, f"{name}-loss": None}
        return out
