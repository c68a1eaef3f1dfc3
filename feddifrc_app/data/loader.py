"""Batches for training and evaluation: a node's indices into a split, seeded, with their dataset
positions (which key the per-sample diffusion features); and the un-augmented batch the teacher saw."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from feddifrc_app.data.images import ImageData
from feddifrc_app.data.partition import as_indices
from feddifrc_app.data.transforms import ImageTransform, eval_transform, train_transform, tv_functional


class IndexedDataset(Dataset):
    """``data`` restricted to ``indices``; item ``i`` -> (x float (3,S,S), y int64, idx int64).

    ``idx`` is the position in ``data`` (not in ``indices``): it keys the per-sample
    diffusion features. A random transform draws from this dataset's own generator
    (seeded by ``reseed``; each DataLoader worker reseeds from its worker seed).
    """

    def __init__(
        self, data: ImageData, indices: np.ndarray, transform: ImageTransform, seed: int | None = None
    ) -> None:
        self.data = data
        self.indices = as_indices(indices, f"indices of {data.name}/{data.split}", size=len(data))
        self.transform = transform
        self.generator: torch.Generator | None = None
        if seed is not None:
            self.reseed(seed)

    def reseed(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(int(seed))

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        j = int(self.indices[i])
        x = self.transform(self.data.images[j], self.generator)
        return x, torch.tensor(self.data.labels[j], dtype=torch.int64), torch.tensor(j, dtype=torch.int64)


def _worker_init(_: int) -> None:
    info = torch.utils.data.get_worker_info()
    # info.seed = loader base seed (drawn from the loader's generator) + worker id.
    info.dataset.reseed(info.seed % 2**63)


def make_loader(
    data: ImageData,
    indices: np.ndarray,
    *,
    train: bool,
    batch_size: int,
    seed: int,
    num_workers: int = 0,
    augment: bool = True,
    pin_memory: bool = False,
) -> DataLoader:
    """Batches of (x (B,3,S,S) float, y (B,) int64, idx (B,) int64).

    ``train=True``: reshuffled every epoch by a generator seeded with ``seed`` and
    augmented with ``train_transform`` (``augment=False``: eval transform, still
    shuffled). ``train=False``: in ``indices`` order, eval transform. The same
    ``seed`` (and ``num_workers``) gives the same batches, augmentation included,
    whatever the global torch RNG state. ``pin_memory`` (for a CUDA device) lets the
    ``non_blocking`` copies of a batch overlap the previous step.
    """
    if train and len(indices) < 2:
        raise ValueError(
            f"{len(indices)} training image(s) on this node: BatchNorm needs at least 2 per batch"
        )
    transform = train_transform(data) if train and augment else eval_transform(data)
    return DataLoader(
        IndexedDataset(data, indices, transform, seed=seed),
        batch_size=batch_size,
        shuffle=train,
        generator=torch.Generator().manual_seed(int(seed)),
        num_workers=num_workers,
        worker_init_fn=_worker_init if num_workers > 0 else None,
        pin_memory=pin_memory,
        # A last training batch of ONE image breaks BatchNorm: drop just that image (it is
        # seen in other epochs, the order being reshuffled).
        drop_last=train and len(indices) % batch_size == 1,
    )


def clean_batch(data: ImageData, idx: torch.Tensor) -> torch.Tensor:
    """float32 (B, 3, S, S): the un-augmented images at dataset positions ``idx`` (B,), exactly as
    ``eval_transform`` gives them, in one vectorised step (the view the teacher saw)."""
    x = data.images[idx.cpu()].float().div_(255.0)
    return tv_functional().normalize(x, list(data.mean), list(data.std))
