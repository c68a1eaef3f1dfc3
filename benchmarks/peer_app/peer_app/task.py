"""Model, data, train and test, as in Flower's quickstart-pytorch ``task.py``, on feddifrc-app's parts.

The model (ResNet-10), the data (the app's training split and partition of it, its loaders and
transforms) and the SGD settings are the app's own, read from its run config, so the peer trains
exactly what the app's FedAvg round trains; the loops are quickstart-pytorch's, with the app's
optimiser (SGD with momentum and weight decay, not Adam)."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader

from feddifrc_app.config import Config, load_node_config
from feddifrc_app.config_loader import load_config
from feddifrc_app.data.loader import make_loader
from feddifrc_app.data.registry import load_dataset, load_validation
from feddifrc_app.data.shares import client_split
from feddifrc_app.model import build_model


@functools.cache
def app_config(path: str) -> Config:
    with open(path) as f:
        return load_config(json.load(f))


def Net(cfg: Config, num_classes: int) -> torch.nn.Module:  # noqa: N802 (quickstart's name)
    return build_model(cfg.model.name, num_classes, cfg.model.width)


def load_data(cfg: Config, node_config: Mapping[str, Any], seed: int) -> DataLoader:
    """This node's partition of the app's training split, with the app's training transforms."""
    data, ids = client_split(cfg, load_node_config(node_config))
    return make_loader(
        data, ids, train=True, batch_size=cfg.train.batch_size, seed=seed, augment=cfg.train.augment
    )


@functools.cache
def eval_loaders(path: str) -> dict[str, DataLoader]:
    """The server's validation and test splits, as the app scores them every round."""
    cfg = app_config(path)
    splits = {"val": load_validation(cfg.dataset), "test": load_dataset(cfg.dataset, "test", seed=cfg.seed)}
    return {
        name: make_loader(
            d, torch.arange(len(d)).numpy(), train=False, batch_size=cfg.train.eval_batch_size, seed=cfg.seed
        )
        for name, d in splits.items()
        if d is not None
    }


def train(net: torch.nn.Module, loader: DataLoader, cfg: Config) -> float:
    """Train the model on the training set; the mean loss over batches."""
    t = cfg.train
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(net.parameters(), lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
    net.train()
    running_loss, steps = 0.0, 0
    for _ in range(t.local_epochs):
        for images, labels, _idx in loader:
            optimizer.zero_grad()
            _, logits = net(images)  # the app's ResNet-10 returns (embedding, logits)
            loss = criterion(logits, labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
            steps += 1
    return running_loss / max(steps, 1)


def test(net: torch.nn.Module, loader: DataLoader) -> tuple[float, float]:
    """Validate the model on a split: (mean loss, accuracy)."""
    criterion = torch.nn.CrossEntropyLoss(reduction="sum")
    correct, loss, n = 0, 0.0, 0
    net.eval()
    with torch.no_grad():
        for images, labels, _idx in loader:
            _, outputs = net(images)
            loss += criterion(outputs, labels).item()
            correct += (outputs.argmax(1) == labels).sum().item()
            n += len(labels)
    return loss / n, correct / n
