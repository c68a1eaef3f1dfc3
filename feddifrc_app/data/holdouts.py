"""Which positions a split keeps: stratified subsets and the fixed hold-outs carved from a source.

Positions only (numpy in, sorted int64 positions out); the seeds here are fixed, so the
validation set and the digits / split-less image-folder test set never move with the run seed.
"""

from __future__ import annotations

import numpy as np

VAL_SPLIT_SEED = 0  # fixed: the validation set never moves with the run seed
DIGITS_SPLIT_SEED = 0  # fixed: the digits (and split-less image-folder) test set never moves
HOLDOUT_FRACTION = 0.2


def stratified_subset(labels: np.ndarray, n: int, seed: int) -> np.ndarray:
    """Sorted positions of ``n`` items whose class mix matches ``labels`` (largest remainder).

    Every class gets ``floor(n * count_c / N)``; the leftover go to the largest fractional
    parts (ties: lower class). Members are drawn per class with ``RandomState(seed)``.
    Hand-written rather than scikit-learn's ``train_test_split(stratify=)``, which breaks
    ties at random and rejects one-member classes: the published digits split depends on it.
    """
    labels = np.asarray(labels)
    total = len(labels)
    if not 0 < n <= total:
        raise ValueError(f"stratified subset of n={n} from {total} items: expected 0 < n <= {total}")
    classes, counts = np.unique(labels, return_counts=True)
    quota = n * counts / total
    take = np.floor(quota).astype(np.int64)
    order = np.lexsort((classes, -(quota - take)))
    take[order[: n - int(take.sum())]] += 1
    rng = np.random.RandomState(seed)
    picks = [rng.permutation(np.flatnonzero(labels == c))[:k] for c, k in zip(classes, take, strict=True)]
    return np.sort(np.concatenate(picks)).astype(np.int64)


def validation_holdout(labels: np.ndarray, fraction: float) -> np.ndarray:
    """Sorted positions of the validation hold-out in a training split: ``fraction`` of it
    (``dataset.val-fraction``), stratified, seed ``VAL_SPLIT_SEED`` (empty at 0, or for a split
    too small to spare one image)."""
    n = int(round(fraction * len(labels)))
    return stratified_subset(labels, n, VAL_SPLIT_SEED) if n else np.zeros(0, dtype=np.int64)


def carve_validation(labels: np.ndarray, split: str, fraction: float) -> np.ndarray:
    """Sorted positions in a source training split (``labels``) that ``split`` keeps: the
    validation hold-out (``validation_holdout``) for ``"val"``, every other image for ``"train"``."""
    held = validation_holdout(labels, fraction)
    return held if split == "val" else np.setdiff1d(np.arange(len(labels)), held).astype(np.int64)


def holdout_split(labels: np.ndarray, split: str) -> np.ndarray:
    """Fixed stratified 80/20 split (seed ``DIGITS_SPLIT_SEED``): sorted positions of ``split``."""
    test = stratified_subset(labels, int(round(HOLDOUT_FRACTION * len(labels))), DIGITS_SPLIT_SEED)
    if split == "test":
        return test
    return np.setdiff1d(np.arange(len(labels)), test).astype(np.int64)
