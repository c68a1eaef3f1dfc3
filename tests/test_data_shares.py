"""data.shares: a node's partition or own folder, and its seeded federated-evaluation hold-out."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import make_config
from data_helpers import COLOURS, _png

from feddifrc_app.config import load_node_config
from feddifrc_app.data.shares import client_holdout, client_split, evaluation_holdout


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
