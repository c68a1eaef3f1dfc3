"""One split of a dataset held in memory (``ImageData``) and the fingerprint that names its content.

Every split is ONE uint8 tensor ``(N, 3, S, S)`` at the classifier size ``S = cfg.image_size``
plus int64 labels: the same bytes feed the classifier (through ``transforms.train_transform`` /
``eval_transform``) and the diffusion teacher (which needs the un-augmented image, as in the
paper), and their hash keys the feature cache (``ImageData.fingerprint``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

SPLITS: tuple[str, ...] = ("train", "val", "test")
PUBLIC_SPLIT = "public"  # mnist-5k only: the teacher's pretraining data, disjoint from train and test

Stats = tuple[tuple[float, float, float], tuple[float, float, float]]
# What a source gives for one of its splits: uint8 images (N, 3, S, S), int64 labels, class
# names (index = label) and the classifier's per-channel (mean, std) of pixels in [0, 1].
Loaded = tuple[torch.Tensor, np.ndarray, list[str], Stats]


class DatasetUnavailableError(RuntimeError):
    """A dataset is not on this machine and cannot be fetched; the message says how to provide it."""


@dataclass(frozen=True, eq=False)
class ImageData:
    """One split held in memory. Treat as read-only (loaders share its tensors)."""

    name: str
    split: str
    images: torch.Tensor  # uint8 (N, 3, S, S)
    labels: np.ndarray  # int64 (N,), values in 0..num_classes-1
    class_names: list[str]  # index = label; the words used in prompts
    fingerprint: str  # hex digest of (name, split, S, class names, labels, image bytes)
    mean: tuple[float, float, float]  # classifier input normalisation, pixels in [0, 1]
    std: tuple[float, float, float]

    def __post_init__(self) -> None:
        im, y, where = self.images, self.labels, f"{self.name}/{self.split}"
        if im.dtype != torch.uint8 or im.ndim != 4 or im.shape[1] != 3 or im.shape[2] != im.shape[3]:
            raise ValueError(f"{where}: images must be uint8 (N, 3, S, S), got {im.dtype} {tuple(im.shape)}")
        if y.dtype != np.int64 or y.ndim != 1 or len(y) != im.shape[0]:
            raise ValueError(
                f"{where}: labels must be int64 (N,) with N={im.shape[0]}, got {y.dtype} {y.shape}"
            )
        if len(y) and (y.min() < 0 or y.max() >= len(self.class_names)):
            raise ValueError(f"{where}: labels outside 0..{len(self.class_names) - 1}")
        if len(set(self.class_names)) != len(self.class_names):
            raise ValueError(f"{where}: duplicate class names {self.class_names}")

    def __len__(self) -> int:
        return int(self.images.shape[0])

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def image_size(self) -> int:
        return int(self.images.shape[-1])


def fingerprint_of(
    name: str, split: str, class_names: Sequence[str], labels: np.ndarray, images: torch.Tensor
) -> str:
    """Stable 32-hex digest of everything that defines a split's content."""
    h = hashlib.blake2b(digest_size=16)
    meta = {"v": 1, "name": name, "split": split, "shape": list(images.shape), "classes": list(class_names)}
    h.update(json.dumps(meta, sort_keys=True).encode())
    h.update(np.ascontiguousarray(labels, dtype=np.int64).tobytes())
    h.update(images.contiguous().numpy().tobytes())
    return h.hexdigest()
