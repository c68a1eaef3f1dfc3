"""Hugging Face Hub datasets (``cifar10``, ``cifar100`` fine labels, ``tiny-imagenet``), with
torchvision's CIFAR folders in front of the Hub.

- ``cifar10`` / ``cifar100``: torchvision's folder under ``cfg.data_dir``
  (``cifar-10-batches-py`` / ``cifar-100-python``) if present, else the Hugging Face datasets
  ``uoft-cs/cifar10`` / ``uoft-cs/cifar100``.
- ``tiny-imagenet``: Hugging Face ``zh-plus/tiny-imagenet`` ("test" = its "valid"); its labels
  are wnids, named BY WNID from ``tiny_imagenet_names``, so prompts follow label order.

A Hub split comes from the ``datasets`` cache under ``cfg.data_dir`` when it is there (no
request at all), else a download; ``DatasetUnavailableError`` says how to provide one that can
be neither. Decoded splits are kept by ``decoded`` (a process per Flower message does not
re-decode 50k PNGs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from feddifrc_app import log
from feddifrc_app.config import DatasetConfig
from feddifrc_app.data.decoded import decoded_path, read_decoded, write_decoded
from feddifrc_app.data.images import DatasetUnavailableError, Loaded, Stats
from feddifrc_app.data.tiny_imagenet_names import TINY_IMAGENET_WORDS
from feddifrc_app.data.transforms import fit_rgb, resize_square

# Per-channel (mean, std) of the training pixels in [0, 1], as commonly published.
CIFAR10_STATS: Stats = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
CIFAR100_STATS: Stats = ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))
TINY_IMAGENET_STATS: Stats = ((0.4802, 0.4481, 0.3975), (0.2770, 0.2691, 0.2821))


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


def _cached_split(spec: _HubSpec, hub_split: str, data_dir: Path):
    """The split from the ``datasets`` cache under ``data_dir``, or None when it is not cached.

    ``datasets`` has no per-call offline switch (``HF_HUB_OFFLINE`` is read once, at import), so
    this builds what ``load_dataset`` itself builds in offline mode: its ``Cache`` builder over the
    latest cached copy of ``spec.repo``, which reads local Arrow files and makes no request.
    """
    from datasets.packaged_modules.cache.cache import Cache

    try:
        builder = Cache(
            cache_dir=str(data_dir),
            dataset_name=spec.repo.split("/")[-1],
            repo_id=spec.repo,
            version="auto",
            hash="auto",
        )
    except ValueError as e:
        if not str(e).startswith("Couldn't find cache"):
            raise  # e.g. several cached configurations: datasets' own message says which
        return None
    return builder.as_dataset(split=hub_split)


def _open_hub_split(spec: _HubSpec, hub_split: str, name: str, data_dir: Path):
    """A ``datasets.Dataset``: the local cache first (instant, no network), else a download."""
    import datasets

    from feddifrc_app.hub import hub_offline

    cached = _cached_split(spec, hub_split, data_dir)
    if cached is not None:
        return cached
    why = "offline mode is set (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE)"
    if not hub_offline():
        log.info("downloading %s (%s) into %s", spec.repo, hub_split, data_dir)
        try:
            return datasets.load_dataset(spec.repo, split=hub_split, cache_dir=str(data_dir))
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
            out[start + k] = fit_rgb(im, size)
    return torch.from_numpy(out).permute(0, 3, 1, 2).contiguous(), labels


def load_hub_dataset(cfg: DatasetConfig, split: str) -> Loaded:
    name, data_dir, spec = cfg.name, Path(cfg.data_dir), _HUB[cfg.name]
    tv = _tv_cifar(name)
    if tv is not None and not (data_dir / tv.base_folder).is_dir():
        tv = None
    source = f"torchvision:{tv.base_folder}" if tv else f"hub:{spec.repo}:{spec.splits[split]}"
    key: dict[str, object] = {"v": 1, "name": name, "split": split, "size": cfg.image_size, "source": source}
    path = decoded_path(data_dir, name, split, cfg.image_size, source)
    cached = read_decoded(path, key)
    if cached is not None:
        return (*cached, spec.stats)
    if tv:
        images, labels, raw = _load_torchvision_cifar(tv, data_dir, split)
        images = resize_square(images, cfg.image_size)
    else:
        ds = _open_hub_split(spec, spec.splits[split], name, data_dir)
        raw = list(ds.features[spec.label_col].names)
        images, labels = _decode_hub(ds, spec, cfg.image_size)
    names = _hub_class_names(name, raw)
    write_decoded(path, key, images, labels, names)
    return images, labels, names, spec.stats
