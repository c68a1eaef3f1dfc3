"""feddifrc_app.data.partition: exact NID1 regression, coverage, determinism, long tail, NID2."""

from __future__ import annotations

import numpy as np
import pytest

from feddifrc_app.data import partition as P

# Regression target (the paper's published matrix): CIFAR-10 sized (10 classes x 5000), M=10,
# alpha=0.05, seed=7, no long tail. Rows = clients, columns = classes.
PUBLISHED_NID1 = np.array(
    [
        [2247, 2, 74, 0, 100, 652, 684, 952, 0, 289],
        [162, 0, 787, 0, 0, 0, 0, 1515, 2536, 0],
        [0, 0, 1644, 0, 4, 1829, 1523, 0, 0, 0],
        [0, 2472, 0, 2165, 0, 0, 363, 0, 0, 0],
        [1, 1, 5, 381, 2393, 0, 2, 1, 1, 2215],
        [0, 0, 1811, 1975, 0, 1214, 0, 0, 0, 0],
        [35, 1048, 0, 230, 805, 938, 0, 1944, 0, 0],
        [0, 1427, 0, 13, 1625, 366, 1569, 0, 0, 0],
        [2554, 0, 0, 0, 0, 1, 859, 10, 0, 1576],
        [1, 50, 679, 236, 73, 0, 0, 578, 2463, 920],
    ]
)

# Standard CIFAR-10-LT per-class sizes (exp profile), as in LDAM-DRW and the public code.
LT_0_1 = [5000, 3871, 2997, 2320, 1796, 1391, 1077, 834, 645, 500]
LT_0_01 = [5000, 2997, 1796, 1077, 645, 387, 232, 139, 83, 50]

ARGS = {"alpha": 0.5, "classes_per_client": 2, "imb_factor": 1.0}


@pytest.fixture(scope="module")
def cifar_sorted() -> np.ndarray:
    """Labels of 10 classes x 5000, class-contiguous: shape (50000,)."""
    return np.repeat(np.arange(10), 5000)


@pytest.fixture(scope="module")
def cifar_mixed() -> np.ndarray:
    """Same class sizes in a shuffled order, like CIFAR-10's real file order."""
    labels = np.repeat(np.arange(10), 5000)
    np.random.default_rng(123).shuffle(labels)
    return labels


def label_counts(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    """(M, C) int64: row i counts client i's samples per class."""
    return np.stack([np.bincount(labels[p], minlength=num_classes) for p in parts]).astype(np.int64)


def assert_cover(parts: list[np.ndarray], kept: np.ndarray) -> None:
    """Every kept index exactly once; parts sorted int64."""
    for p in parts:
        assert p.dtype == np.int64
        assert np.all(np.diff(p) > 0)
    flat = np.concatenate(parts)
    assert flat.size == kept.size
    np.testing.assert_array_equal(np.sort(flat), np.sort(kept))


# ------------------------------------------------------------------ NID1 regression


def test_published_matrix_direct(cifar_sorted: np.ndarray) -> None:
    parts = P.dirichlet_nid1(np.arange(50000), cifar_sorted, 10, 0.05, 7)
    np.testing.assert_array_equal(label_counts(cifar_sorted, parts, 10), PUBLISHED_NID1)


@pytest.mark.parametrize("order", ["cifar_sorted", "cifar_mixed"])
def test_published_matrix_via_entry_point(order: str, request: pytest.FixtureRequest) -> None:
    # The matrix depends only on the class-by-class (index, label) list, so the
    # dataset's file order and the within-class shuffle must not change it.
    labels = request.getfixturevalue(order)
    parts = P.partition_indices(
        labels, 10, name="dirichlet", alpha=0.05, classes_per_client=2, imb_factor=1.0, seed=7
    )
    np.testing.assert_array_equal(label_counts(labels, parts, 10), PUBLISHED_NID1)
    assert_cover(parts, np.arange(labels.size))


def test_dirichlet_chunk_sizes() -> None:
    labels = np.random.default_rng(0).integers(0, 4, size=1003)
    parts = P.dirichlet_nid1(np.arange(1003), labels, 7, 0.3, 1)
    # 1003 = 7 * 143 + 2: the first two chunks get one more.
    assert [p.size for p in parts] == [144, 144, 143, 143, 143, 143, 143]
    assert_cover(parts, np.arange(1003))


def test_dirichlet_fewer_than_five_partitions() -> None:
    labels = np.repeat(np.arange(3), 40)
    parts = P.dirichlet_nid1(np.arange(120), labels, 3, 0.5, 0)
    assert [p.size for p in parts] == [40, 40, 40]
    assert_cover(parts, np.arange(120))


def test_dirichlet_tiny_group_keeps_every_index() -> None:
    # 8 samples / 5 workers: the public code would drop this group (min size 0).
    labels = np.array([0, 1, 0, 1, 0, 1, 0, 1])
    parts = P.dirichlet_nid1(np.arange(8), labels, 5, 0.5, 3)
    assert [p.size for p in parts] == [2, 2, 2, 1, 1]
    assert_cover(parts, np.arange(8))


def test_dirichlet_retry_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    # 2 classes over 5 workers at alpha 0.01 essentially never fills all five.
    monkeypatch.setattr(P, "_MAX_DIRICHLET_PASSES", 3)
    labels = np.repeat(np.arange(2), 50)
    with pytest.raises(RuntimeError, match="alpha=0.01"):
        P.dirichlet_nid1(np.arange(100), labels, 5, 0.01, 0)


# ------------------------------------------------------------------ all splits


@pytest.mark.parametrize("name", P.PARTITIONS)
@pytest.mark.parametrize("imb", [1.0, 0.1])
def test_coverage_determinism_seed(name: str, imb: float, cifar_mixed: np.ndarray) -> None:
    labels = cifar_mixed[:5000]
    args = {**ARGS, "imb_factor": imb}
    a = P.partition_indices(labels, 10, name=name, seed=7, **args)
    b = P.partition_indices(labels, 10, name=name, seed=7, **args)
    c = P.partition_indices(labels, 10, name=name, seed=8, **args)
    assert len(a) == 10
    assert_cover(a, P.long_tail(labels, imb, seed=7))
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_iid_sizes_and_balance(cifar_sorted: np.ndarray) -> None:
    parts = P.iid(np.arange(50000), 10, 0)
    assert [p.size for p in parts] == [5000] * 10
    counts = label_counts(cifar_sorted, parts, 10)
    # 500 expected per cell; a uniform split stays within a few sigma (~21).
    assert np.abs(counts - 500).max() < 120


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="iid, dirichlet, pathological"):
        P.partition_indices(np.zeros(10, int), 2, name="nid3", seed=0, **ARGS)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_partitions": 0}, "num_partitions=0"),
        ({"num_partitions": 101}, "num_partitions=101"),
        ({"alpha": 0.0}, "alpha=0.0"),
        ({"alpha": -1.0}, "alpha=-1.0"),
        ({"imb_factor": 0.0}, "imb_factor=0.0"),
        ({"imb_factor": 1.5}, "imb_factor=1.5"),
    ],
)
def test_argument_errors(kwargs: dict, match: str) -> None:
    labels = np.repeat(np.arange(4), 25)
    call = {"num_partitions": 5, "name": "dirichlet", "seed": 0, **ARGS, **kwargs}
    n = call.pop("num_partitions")
    with pytest.raises(ValueError, match=match):
        P.partition_indices(labels, n, **call)


def test_label_errors() -> None:
    with pytest.raises(ValueError, match="labels"):
        P.long_tail(np.array([0.0, 1.0]), 1.0)
    with pytest.raises(ValueError, match="labels"):
        P.long_tail(np.array([0, -1]), 1.0)
    with pytest.raises(ValueError, match="duplicates"):
        P.iid(np.array([1, 1, 2]), 2, 0)


# ------------------------------------------------------------------ long tail


@pytest.mark.parametrize(("imb", "expected"), [(0.1, LT_0_1), (0.01, LT_0_01), (1.0, [5000] * 10)])
def test_long_tail_counts(imb: float, expected: list[int], cifar_mixed: np.ndarray) -> None:
    for seed in (None, 7):
        kept = P.long_tail(cifar_mixed, imb, seed=seed)
        assert kept.dtype == np.int64 and np.all(np.diff(kept) > 0)
        assert np.bincount(cifar_mixed[kept], minlength=10).tolist() == expected


def test_long_tail_which_samples(cifar_mixed: np.ndarray) -> None:
    kept = P.long_tail(cifar_mixed, 0.01, seed=None)
    # seed=None: the first 50 of class 9 in index order.
    first_50 = np.flatnonzero(cifar_mixed == 9)[:50]
    np.testing.assert_array_equal(kept[cifar_mixed[kept] == 9], first_50)
    # seed=s: a seeded pick, and the one partition_indices keeps.
    seeded = P.long_tail(cifar_mixed, 0.01, seed=7)
    assert not np.array_equal(seeded, kept)
    parts = P.partition_indices(cifar_mixed, 10, name="iid", seed=7, **{**ARGS, "imb_factor": 0.01})
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), seeded)


def test_long_tail_dirichlet_equal_chunks(cifar_mixed: np.ndarray) -> None:
    parts = P.partition_indices(
        cifar_mixed, 10, name="dirichlet", alpha=0.05, classes_per_client=2, imb_factor=0.1, seed=7
    )
    assert sum(LT_0_1) == 20431  # = 10 * 2043 + 1
    assert [p.size for p in parts] == [2044] + [2043] * 9
    assert_cover(parts, P.long_tail(cifar_mixed, 0.1, seed=7))


# ------------------------------------------------------------------ pathological (assumed NID2)


def test_pathological_exact_classes_divisible(cifar_mixed: np.ndarray) -> None:
    parts = P.pathological(np.arange(50000), cifar_mixed, 10, 2, 0)
    counts = label_counts(cifar_mixed, parts, 10)
    assert ((counts > 0).sum(axis=1) == 2).all()
    # M k / C = 2 holders per class, each gets half of the class's 5000.
    assert ((counts > 0).sum(axis=0) == 2).all()
    assert set(np.unique(counts)) == {0, 2500}
    assert_cover(parts, np.arange(50000))


def test_pathological_exact_classes_not_divisible(cifar_mixed: np.ndarray) -> None:
    labels = cifar_mixed[:3000]
    parts = P.pathological(np.arange(3000), labels, 7, 3, 5)
    counts = label_counts(labels, parts, 10)
    assert ((counts > 0).sum(axis=1) == 3).all()
    # 21 slots over 10 classes: every class held by 2 or 3 clients.
    assert set(((counts > 0).sum(axis=0)).tolist()) <= {2, 3}
    assert_cover(parts, np.arange(3000))


@pytest.mark.parametrize(
    ("m", "k", "match"),
    [
        (10, 11, "classes_per_client=11"),
        (10, 0, "classes_per_client=0"),
        (4, 2, "cannot cover all 10 classes"),
        (60, 10, "class .* has 50 samples but 60 clients"),
    ],
)
def test_pathological_errors(m: int, k: int, match: str) -> None:
    labels = np.repeat(np.arange(10), 50)
    with pytest.raises(ValueError, match=match):
        P.pathological(np.arange(500), labels, m, k, 0)
