"""data.sources.hub: Hub datasets and torchvision's CIFAR folders; offline, on tiny local data.

Hub datasets are exercised through the REAL ``datasets`` cache path: the tests write a few
images in the Hugging Face datasets on-disk cache layout (what a first online run leaves behind)
and load them without any request.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import numpy as np
import pytest
from data_helpers import CIFAR10_NAMES, _solid, _write_hf_cache, _write_torchvision_cifar10, dcfg

from feddifrc_app.data.images import DatasetUnavailableError
from feddifrc_app.data.registry import load_dataset


def test_cifar10_offline_without_cache_fails_fast_with_one_actionable_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import datasets

    def hub_refuses(*args, **kwargs):
        # The cache lookup is datasets' own cache reader (no load_dataset call, no request); a
        # download attempt meets a Hub that refuses at once (the test never downloads, even on a
        # machine with internet).
        raise ConnectionError("Couldn't reach 'uoft-cs/cifar10' on the Hub (ConnectError)")

    monkeypatch.setattr(datasets, "load_dataset", hub_refuses)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    data_dir = tmp_path / "empty"
    data_dir.mkdir()
    with pytest.raises(DatasetUnavailableError) as err:
        load_dataset(dcfg(name="cifar10", data_dir=str(data_dir)), "train")
    msg = str(err.value)
    assert "'cifar10'" in msg and "uoft-cs/cifar10" in msg and str(data_dir) in msg
    assert "internet" in msg and "cifar-10-batches-py" in msg and "unreachable" in msg and "\n" not in msg
    assert list(data_dir.iterdir()) == []  # nothing half-written


def test_offline_env_is_honoured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads HF_HUB_OFFLINE at import: as if it had been set before the process started
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DatasetUnavailableError) as err:
        load_dataset(dcfg(name="tiny-imagenet", data_dir=str(tmp_path)), "test")
    assert "offline mode is set" in str(err.value) and "zh-plus/tiny-imagenet" in str(err.value)


def test_cifar10_from_hf_cache_and_decoded_cache(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import datasets
    from datasets import ClassLabel, Features
    from datasets import Image as HFImage

    def no_hub(*args, **kwargs):
        raise AssertionError("a cached split is read from the cache alone, never through load_dataset")

    monkeypatch.setattr(datasets, "load_dataset", no_hub)

    feats = Features({"img": HFImage(), "label": ClassLabel(names=CIFAR10_NAMES)})
    _write_hf_cache(
        tmp_path,
        "uoft-cs/cifar10",
        feats,
        {
            "train": {"img": [_solid(10 * k) for k in range(6)], "label": [0, 1, 2, 9, 1, 0]},
            "test": {"img": [_solid(3)], "label": [9]},
        },
    )
    cfg = dcfg(name="cifar10", data_dir=str(tmp_path))
    tr = load_dataset(cfg, "train")
    # one image (round(0.1 * 6)) is the validation hold-out: the largest class share, class 0
    assert tr.class_names == CIFAR10_NAMES and tr.labels.tolist() == [0, 1, 2, 9, 1]
    assert load_dataset(cfg, "val").labels.tolist() == [0]
    assert tr.images.shape == (5, 3, 32, 32)
    assert tr.images[4, :, 0, 0].tolist() == [40, 215, 7]  # order and RGB channels kept
    assert tr.mean == (0.4914, 0.4822, 0.4465)
    cached = list((tmp_path / "feddifrc-decoded").glob("cifar10-train-32px-*.npz"))
    assert len(cached) == 1

    # second load comes from the decoded cache: same content
    assert load_dataset(cfg, "train").fingerprint == tr.fingerprint
    # a corrupted cache is detected and rebuilt, not trusted
    cached[0].write_bytes(b"garbage")
    with caplog.at_level(logging.WARNING, logger="flwr.feddifrc"):
        assert load_dataset(cfg, "train").fingerprint == tr.fingerprint
    assert "rebuilding" in caplog.text

    small = load_dataset(dataclasses.replace(cfg, image_size=16), "test")
    assert small.images.shape == (1, 3, 16, 16) and small.images[0, :, 5, 5].tolist() == [3, 252, 7]


def test_cifar100_names_fixed_and_spaced(tmp_path: Path) -> None:
    from datasets import ClassLabel, Features
    from datasets import Image as HFImage

    names = ["apple", "aquarium_fish", "cra", "maple_tree"]
    feats = Features(
        {"img": HFImage(), "fine_label": ClassLabel(names=names), "coarse_label": ClassLabel(num_classes=2)}
    )
    _write_hf_cache(
        tmp_path,
        "uoft-cs/cifar100",
        feats,
        {
            "test": {"img": [_solid(1), _solid(2)], "fine_label": [2, 3], "coarse_label": [1, 0]},
        },
    )
    te = load_dataset(dcfg(name="cifar100", data_dir=str(tmp_path)), "test")
    assert te.class_names == ["apple", "aquarium fish", "crab", "maple tree"]
    assert te.labels.tolist() == [2, 3]  # the fine label


def test_tiny_imagenet_names_follow_label_order_by_wnid(tmp_path: Path) -> None:
    from datasets import ClassLabel, Features
    from datasets import Image as HFImage

    # deliberately NOT sorted: names must be looked up by wnid, not by position
    wnids = ["n02124075", "n01443537", "n07646821"]
    feats = Features({"image": HFImage(), "label": ClassLabel(names=wnids)})
    _write_hf_cache(
        tmp_path,
        "zh-plus/tiny-imagenet",
        feats,
        {
            "valid": {"image": [_solid(50, 64), _solid(9, 64, mode="L")], "label": [0, 2]},
        },
    )
    te = load_dataset(dcfg(name="tiny-imagenet", data_dir=str(tmp_path)), "test")  # "test" = hub "valid"
    assert te.class_names == ["Egyptian cat", "goldfish", "goose"]
    assert te.images.shape == (2, 3, 32, 32)  # 64 -> 32
    assert te.images[1, :, 3, 3].tolist() == [9, 9, 9]  # greyscale -> RGB


def test_cifar10_from_torchvision_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    raw = _write_torchvision_cifar10(tmp_path, monkeypatch)
    cfg = dcfg(name="cifar10", data_dir=str(tmp_path))
    tr, te = load_dataset(cfg, "train"), load_dataset(cfg, "test")
    va = load_dataset(cfg, "val")
    assert (len(tr), len(va), len(te)) == (9, 1, 2) and tr.class_names == CIFAR10_NAMES
    # rows are channel-major 3x32x32, batches in order; the hold-out is one row of them
    rows = [
        next(i for i in range(10) if np.array_equal(raw[i], im)) for im in tr.images.numpy().reshape(9, -1)
    ]
    assert rows == sorted(rows) and len(set(rows)) == 9
    held = (set(range(10)) - set(rows)).pop()
    assert np.array_equal(va.images.numpy().reshape(1, -1)[0], raw[held])
    assert np.array_equal(te.images.numpy().reshape(2, -1), raw[10:])
    os.remove(tmp_path / "cifar-10-batches-py" / "data_batch_3")
    for f in (tmp_path / "feddifrc-decoded").iterdir():
        f.unlink()
    with pytest.raises(DatasetUnavailableError, match="data_batch_3"):
        load_dataset(cfg, "train")
