"""data.sources.digits: sklearn's digits (bilinear, fixed 80/20) and mnist-5k (fixed public/train/test)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from data_helpers import dcfg, digits, mnist_cfg

from feddifrc_app.data.registry import load_dataset
from feddifrc_app.data.sources.digits import DIGIT_NAMES
from feddifrc_app.data.transforms import train_transform


def test_digits_shapes_dtypes_labels_names() -> None:
    digits_train, digits_test = digits("train"), digits("test")
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


def test_digits_split_is_fixed_disjoint_and_stratified() -> None:
    digits_train, digits_test = digits("train"), digits("test")
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


def test_mnist5k_splits_are_fixed_disjoint_stratified_and_cover_all_5000() -> None:
    from feddifrc_app.data.images import PUBLIC_SPLIT
    from feddifrc_app.data.sources.digits import MNIST5K_SIZES, _mnist5k_arrays

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


def test_mnist5k_pool_clients_pool_and_test_are_disjoint_by_image_id() -> None:
    """mnist-5k-pool: test unchanged; 500 client digits from mnist-5k's train; the pool = the other
    3,500 (public + the rest of train); val = 500 of the pool. Ids are positions in the 5,000."""
    from feddifrc_app.data.images import PUBLIC_SPLIT
    from feddifrc_app.data.sources.digits import mnist5k_positions

    data_dir = Path(mnist_cfg().data_dir)
    labels, base = mnist5k_positions("mnist-5k", data_dir)
    _, pool = mnist5k_positions("mnist-5k-pool", data_dir)
    clients, teacher, test, val = pool["train"], pool[PUBLIC_SPLIT], pool["test"], pool["val"]
    assert [len(clients), len(teacher), len(test), len(val)] == [500, 3500, 1000, 500]
    assert np.array_equal(test, base["test"])  # the endpoint's 1,000 digits, unchanged
    assert set(clients) <= set(base["train"])
    assert not set(clients) & set(teacher) and not set(test) & (set(teacher) | set(clients))
    assert sorted([*clients, *teacher, *test]) == list(range(5000))
    assert set(teacher) == set(base[PUBLIC_SPLIT]) | (set(base["train"]) - set(clients))
    assert set(val) <= set(teacher)
    for ids, per_class in ((clients, 50), (val, 50), (teacher, 350)):
        assert np.bincount(labels[ids]).tolist() == [per_class] * 10
    # The loaded splits are exactly those rows.
    cfg = mnist_cfg(name="mnist-5k-pool")
    images = load_dataset(mnist_cfg(), "test").images  # any split: compare through the 5,000 below
    assert images.shape[0] == 1000
    for split, ids in (("train", clients), ("val", val), (PUBLIC_SPLIT, teacher), ("test", test)):
        d = load_dataset(cfg, split)
        assert np.array_equal(d.labels, labels[ids]) and len(d) == len(ids), split
    train, val_d = load_dataset(cfg, "train"), load_dataset(cfg, "val")
    pool_d = load_dataset(cfg, PUBLIC_SPLIT)
    as_set = lambda d: {im.tobytes() for im in d.images.numpy()}  # noqa: E731
    assert not as_set(train) & as_set(pool_d) and as_set(val_d) <= as_set(pool_d)
    px = train.images[:, 0].double() / 255  # normalised by the clients' 500
    assert train.mean[0] == pytest.approx(float(px.mean()))
