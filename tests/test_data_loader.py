"""data.loader: dataset positions, seeded order and augmentation, workers, the eval order."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from data_helpers import _batches, digits

from feddifrc_app.data.loader import IndexedDataset, make_loader
from feddifrc_app.data.transforms import eval_transform


def test_indexed_dataset_returns_position_in_data() -> None:
    digits_train = digits("train")
    indices = np.array([7, 3, 100, 1293])
    ds = IndexedDataset(digits_train, indices, eval_transform(digits_train))
    assert len(ds) == 4
    x, y, idx = ds[2]
    assert int(idx) == 100 and idx.dtype == torch.int64
    assert int(y) == digits_train.labels[100] and y.dtype == torch.int64
    assert torch.equal(x, eval_transform(digits_train)(digits_train.images[100]))
    with pytest.raises(IndexError):
        IndexedDataset(digits_train, np.array([len(digits_train)]), eval_transform(digits_train))


def test_loader_is_deterministic_in_its_seed() -> None:
    digits_train = digits("train")
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


def test_eval_loader_is_ordered_and_unaugmented() -> None:
    digits_test = digits("test")
    loader = make_loader(digits_test, np.arange(len(digits_test)), train=False, batch_size=100, seed=0)
    x, y, i = next(iter(loader))
    assert i.tolist() == list(range(100))
    t = eval_transform(digits_test)
    assert torch.equal(x[7], t(digits_test.images[7]))


def test_train_loader_without_augment_is_shuffled_but_clean() -> None:
    digits_test = digits("test")
    loader = make_loader(digits_test, np.arange(50), train=True, batch_size=50, seed=0, augment=False)
    x, _, i = next(iter(loader))
    assert i.tolist() != list(range(50))
    t = eval_transform(digits_test)
    assert all(torch.equal(x[k], t(digits_test.images[int(i[k])])) for k in range(50))


def test_loader_with_workers_is_deterministic() -> None:
    digits_test = digits("test")
    run = [
        _batches(make_loader(digits_test, np.arange(64), train=True, batch_size=16, seed=3, num_workers=2))
        for _ in range(2)
    ]
    for (xa, _, ia), (xb, _, ib) in zip(*run, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ia, ib)


def test_pinned_loader_order_and_augmentation_for_seed_5() -> None:
    digits_train = digits("train")
    batches = _batches(make_loader(digits_train, np.arange(0, 200, 2), train=True, batch_size=32, seed=5))
    assert batches[0][2].tolist() == [
        134, 8, 72, 28, 40, 136, 156, 178, 150, 4, 162, 154, 196, 74, 42, 140,
        198, 68, 186, 104, 38, 180, 96, 36, 86, 158, 82, 44, 128, 146, 70, 48,
    ]  # fmt: skip
    sums = [float(x.double().sum()) for x, _, _ in batches]
    assert sums == pytest.approx(
        [-6215.426171598636, -8792.021453076362, -3818.483646755456, -614.3051615941222]
    )
