"""Dataset names -> sources, and the splits every dataset offers (``load_dataset``).

Sources (``SOURCES``; each module's docstring says what it reads): ``digits``, ``mnist-5k`` and
``mnist-5k-pool`` (``sources.digits``), ``cifar10`` / ``cifar100`` / ``tiny-imagenet``
(``sources.hub``), and ``image-folder`` (``sources.image_folder``).

Validation (``split="val"``): mnist-5k's public split (mnist-5k-pool: 500 of its public split);
for every other dataset a fixed stratified hold-out of ``dataset.val-fraction`` of the training
split (``holdouts.VAL_SPLIT_SEED``), carved before partitioning, so ``train`` is the rest
(CIFAR-10 at 0.1: 45,000 train, 5,000 val; at 0, the paper confs': all 50,000 train and no
validation split). Choices (lr, loss weights, a
checkpoint round) are read from ``val``; ``test`` is the endpoint. The fraction changes the
``train`` split's images, so its fingerprint, the feature-cache key and the partition follow.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from feddifrc_app import log
from feddifrc_app.config import DatasetConfig
from feddifrc_app.data.holdouts import carve_validation, stratified_subset
from feddifrc_app.data.images import PUBLIC_SPLIT, SPLITS, ImageData, Loaded, fingerprint_of
from feddifrc_app.data.sources.digits import load_digits, load_mnist5k
from feddifrc_app.data.sources.hub import load_hub_dataset
from feddifrc_app.data.sources.image_folder import image_folder_layout, load_image_folder

EVAL_LIMIT_SEED = 0  # dataset.eval-limit's subset: the same images whatever the run seed


@dataclass(frozen=True)
class Source:
    """How a dataset is read: ``load(cfg, split)`` for ``split`` in ``train``, ``test`` (and
    ``public`` when ``public_val``) gives its images at ``cfg.image_size``."""

    load: Callable[[DatasetConfig, str], Loaded]
    public_val: bool = False  # it has a public split (the teacher's data); validation comes from it
    own_val: bool = False  # its loader serves "val" (part of the public split), else val = all of it


SOURCES: dict[str, Source] = {
    "digits": Source(load_digits),
    "mnist-5k": Source(load_mnist5k, public_val=True),
    "mnist-5k-pool": Source(load_mnist5k, public_val=True, own_val=True),
    "cifar10": Source(load_hub_dataset),
    "cifar100": Source(load_hub_dataset),
    "tiny-imagenet": Source(load_hub_dataset),
    "image-folder": Source(load_image_folder),
}


def _check_split(name: str, split: str) -> None:
    if split not in SPLITS and not (split == PUBLIC_SPLIT and SOURCES[name].public_val):
        public = ", ".join(n for n, s in SOURCES.items() if s.public_val)
        raise ValueError(
            f"split={split!r}: expected one of {', '.join(SPLITS)} "
            f"('{PUBLIC_SPLIT}' exists for {public} only)"
        )


def load_dataset(cfg: DatasetConfig, split: str, *, seed: int = 0) -> ImageData:
    """One split of ``cfg.name`` at ``cfg.image_size``.

    ``cfg.train_limit > 0`` keeps a stratified subset of that many TRAINING images
    (deterministic in ``seed``, original order kept). ``cfg.eval_limit > 0`` does the same for
    the validation and test splits, with a fixed seed, so every run seed is scored on the same
    images (for smoke runs and tests: a cut test split is not the benchmark's endpoint).
    ``split="val"`` is the validation split (module docstring); ``train`` excludes it.
    ``cfg.classes`` (image-folder): the federation's class-folder names in label order,
    so a node missing a class numbers the others like everyone else; folders not in it
    are an error, listed classes absent locally are fine. Empty: this folder's, sorted.
    Raises ``DatasetUnavailableError`` when the data is not on disk and cannot be fetched.
    """
    _check_split(cfg.name, split)
    public_val, own_val = SOURCES[cfg.name].public_val, SOURCES[cfg.name].own_val
    source = ("val" if own_val else PUBLIC_SPLIT if public_val else "train") if split == "val" else split
    images, labels, names, (mean, std) = SOURCES[cfg.name].load(cfg, source)
    if source == "train" and not public_val:  # the validation hold-out, carved before partitioning
        keep = carve_validation(labels, split, cfg.val_fraction)
        images, labels = images[torch.from_numpy(keep)], labels[keep]
    limit, subset_seed = (cfg.train_limit, seed) if split == "train" else (cfg.eval_limit, EVAL_LIMIT_SEED)
    if split in SPLITS and 0 < limit < len(labels):
        keep = stratified_subset(labels, limit, subset_seed)
        images, labels = images[torch.from_numpy(keep)], labels[keep]
    return ImageData(
        name=cfg.name,
        split=split,
        images=images,
        labels=labels,
        class_names=list(names),
        fingerprint=fingerprint_of(cfg.name, split, names, labels, images),
        mean=mean,
        std=std,
    )


def load_validation(cfg: DatasetConfig) -> ImageData | None:
    """The server's validation split; None (logged) with ``dataset.val-fraction = 0``, for an image
    folder holding only a test set, which has no training images to hold out from, or a training
    split too small to spare one."""
    if cfg.val_fraction == 0 and not SOURCES[cfg.name].public_val:
        log.info("dataset.val-fraction = 0: no validation split, the server reports test only")
        return None
    if cfg.name == "image-folder" and image_folder_layout(Path(cfg.data_dir))[0] is None:
        log.warning("image folder %s holds only a test set: no validation split, test only", cfg.data_dir)
        return None
    val = load_dataset(cfg, "val")
    if not len(val):
        log.warning("%s: too few training images to hold out a validation split", cfg.name)
        return None
    return val
