"""data.registry: load_dataset (train/eval limits, the validation carve, fingerprints) and
load_validation, on sklearn's digits and mnist-5k (offline)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import make_config
from data_helpers import dcfg, digits, mnist_cfg

from feddifrc_app.config import DATASETS, load_node_config
from feddifrc_app.data.registry import SOURCES, load_dataset, load_validation
from feddifrc_app.data.shares import client_split


def test_fingerprint_stable_and_split_specific() -> None:
    digits_train, digits_test = digits("train"), digits("test")
    again = load_dataset(dcfg(), "train")
    assert again.fingerprint == digits_train.fingerprint
    assert len(digits_train.fingerprint) == 32 and int(digits_train.fingerprint, 16) >= 0
    assert digits_train.fingerprint != digits_test.fingerprint
    assert load_dataset(dcfg(image_size=16), "train").fingerprint != digits_train.fingerprint


def test_train_limit_is_stratified_deterministic_and_train_only() -> None:
    digits_test = digits("test")
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


def test_eval_limit_cuts_val_and_test_alike_for_every_seed_and_never_train() -> None:
    digits_train, digits_test = digits("train"), digits("test")
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


def test_public_split_exists_for_mnist5k_only() -> None:
    with pytest.raises(ValueError, match="'public' exists for mnist-5k, mnist-5k-pool only"):
        load_dataset(dcfg(), "public")


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


def test_every_configurable_dataset_has_a_source() -> None:
    """config.DATASETS (what dataset.name accepts) and the registry name the same datasets."""
    assert sorted(SOURCES) == sorted(DATASETS)
    assert [n for n, s in SOURCES.items() if s.public_val] == ["mnist-5k", "mnist-5k-pool"]
    assert [n for n, s in SOURCES.items() if s.own_val] == ["mnist-5k-pool"]


def _load_colours(cfg, split: str):
    """A source as docs/architecture.md's "Add a dataset" describes one: ``load_x(cfg, split)`` gives
    uint8 images (N x 3 x S x S), int64 labels, the class names and the per-channel (mean, std). Its
    images are one flat colour per class, so a partition's labels can be read off its pixels."""
    import torch

    n = {"train": 150, "test": 30}[split]
    labels = np.arange(n, dtype=np.int64) % 3
    colours = torch.tensor([[255, 0, 0], [0, 255, 0], [0, 0, 255]], dtype=torch.uint8)
    images = colours[torch.from_numpy(labels)][:, :, None, None].expand(n, 3, cfg.image_size, cfg.image_size)
    return images.contiguous(), labels, ["red", "green", "blue"], ((0.3, 0.3, 0.3), (0.4, 0.4, 0.4))


def test_a_dataset_added_as_docs_architecture_says_loads_and_partitions(monkeypatch) -> None:
    """docs/architecture.md, "Add a dataset": its entry in data/registry.SOURCES is all that loading,
    the validation carve and the nodes' partitions look up by ``dataset.name``. (Its name in
    config.DATASETS, what load_config accepts, is test_registry_and_config_name_the_same_datasets.)"""
    from feddifrc_app.data.registry import Source

    monkeypatch.setitem(SOURCES, "colours", Source(_load_colours))
    base = make_config(dataset__val_fraction=0.2)
    cfg = dataclasses.replace(base, dataset=dataclasses.replace(base.dataset, name="colours"))
    train, test, val = (load_dataset(cfg.dataset, split) for split in ("train", "test", "val"))
    assert load_validation(cfg.dataset).fingerprint == val.fingerprint  # the server's validation split
    assert (len(train), len(val), len(test)) == (120, 30, 30)  # 20% of 150 held out, stratified
    assert train.class_names == ["red", "green", "blue"] and train.images.shape[1:] == (3, 16, 16)
    assert np.bincount(val.labels).tolist() == [10, 10, 10]
    for d in (train, val, test):  # each image still shows its label's colour
        assert (d.images[:, :, 0, 0].argmax(dim=1).numpy() == d.labels).all()
    nodes = [load_node_config({"partition-id": p, "num-partitions": 3}) for p in range(3)]
    shares = [client_split(cfg, node)[1] for node in nodes]
    assert sorted(np.concatenate(shares).tolist()) == list(range(120))  # every training image, once
    assert all(len(s) for s in shares)
