"""Shared projection basis: federated PCA == pooled PCA, fusion, bases, round trips."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.decomposition import PCA

from feddifrc_app.methods.feddifrc.projection import (
    Basis,
    block_stats,
    client_stats,
    clip_widths,
    fit_basis,
    fit_federated_basis,
    fuse,
    fuse_per_batch,
    local_pca_basis,
    merge_client_stats,
    merge_stats,
    random_basis,
    stats_from_arrays,
    stats_to_arrays,
)

BLOCKS = (1, 2, 3)
CHANNELS = {1: 40, 2: 24, 3: 16}


def _pooled(n: int, p: int, seed: int) -> dict[int, np.ndarray]:
    """Correlated, off-centre features with a decaying spectrum (distinct eigenvalues)."""
    rng = np.random.default_rng(seed)
    out = {}
    for b, c in CHANNELS.items():
        mix = np.random.default_rng(100 + b).standard_normal((c, c)) * (0.8 ** np.arange(c))[:, None]
        x = rng.standard_normal((n, p, c)) @ mix + 3.0 * b
        out[b] = x.astype(np.float32)
    return out


def _clients(k: int = 4) -> list[dict[int, np.ndarray]]:
    return [_pooled(n=7 + 3 * i, p=3, seed=i) for i in range(k)]


def _union(clients, b):
    return np.concatenate([c[b].reshape(-1, c[b].shape[-1]) for c in clients]).astype(np.float64)


def test_the_federated_basis_merges_clips_and_checks_the_embedding_width():
    """The one fit the ServerApp and the benchmarks share: merged statistics, the configured widths
    clipped to the blocks (64 > block 3's 16 channels), one PCA per block."""
    stats = [client_stats(c) for c in _clients()]
    basis, merged = fit_federated_basis(stats, (8, 8, 64), BLOCKS, embedding_dim=32)
    ref = fit_basis(merge_client_stats(stats), (8, 8, 16), BLOCKS)
    assert basis.widths == (8, 8, 16) and basis.fingerprint() == ref.fingerprint()
    assert merged[1].count == sum(7 + 3 * i for i in range(4)) * 3
    with pytest.raises(ValueError, match="ResNet-10 embedding is 40-d"):
        fit_federated_basis(stats, (8, 8, 64), BLOCKS, embedding_dim=40)


def test_block_stats_by_hand():
    x = np.array([[[1.0, 2.0]], [[3.0, 4.0]]])  # (2, 1, 2): two rows
    s = block_stats(x)
    assert s.count == 2
    np.testing.assert_array_equal(s.total, [4.0, 6.0])
    np.testing.assert_array_equal(s.outer, [[10.0, 14.0], [14.0, 20.0]])
    np.testing.assert_allclose(s.covariance(), [[1.0, 1.0], [1.0, 1.0]])
    m = merge_stats([s, s])
    assert m.count == 4 and m.total.tolist() == [8.0, 12.0]


def test_federated_pca_equals_pca_of_pooled_union():
    clients = _clients()
    widths = (8, 6, 5)
    merged = merge_client_stats([client_stats(c) for c in clients])
    basis = fit_basis(merged, widths, BLOCKS)
    assert basis.mode == "federated-pca" and basis.widths == widths
    for i, (b, k) in enumerate(zip(BLOCKS, widths, strict=True)):
        rows = _union(clients, b)
        ref = PCA(n_components=k, svd_solver="full").fit(rows)
        np.testing.assert_allclose(basis.means[i], ref.mean_, rtol=1e-5, atol=1e-4)
        w = basis.components[i].astype(np.float64)  # (C, k)
        # Same directions up to sign: |<w_j, ref_j>| = 1 for every component.
        np.testing.assert_allclose(np.abs(np.sum(w * ref.components_.T, axis=0)), 1.0, atol=1e-4)
        # And the projected coordinates match sklearn's transform up to the same signs.
        signs = np.sign(np.sum(w * ref.components_.T, axis=0))
        np.testing.assert_allclose((rows - basis.means[i]) @ w, ref.transform(rows) * signs, atol=2e-3)


def test_federated_pca_fixes_too_few_local_rows():
    # Each client alone has fewer rows than the width; merged statistics do not.
    clients = [_pooled(n=2, p=2, seed=s) for s in range(10)]  # 4 rows per client, 40 in all
    with pytest.raises(ValueError, match="local-pca: block 1 has 4 feature rows"):
        local_pca_basis(clients[0], (8, 6, 5), BLOCKS)
    basis = fit_basis(merge_client_stats([client_stats(c) for c in clients]), (8, 6, 5), BLOCKS)
    ref = PCA(n_components=8, svd_solver="full").fit(_union(clients, 1))
    np.testing.assert_allclose(
        np.abs(np.sum(basis.components[0] * ref.components_.T, axis=0)), 1.0, atol=1e-4
    )


def test_stats_are_order_independent_and_sequence_form_matches():
    clients = _clients()
    a = fit_basis(merge_client_stats([client_stats(c) for c in clients]), (8, 6, 5), BLOCKS)
    merged = merge_client_stats([client_stats(c) for c in reversed(clients)])
    b = fit_basis([merged[x] for x in BLOCKS], (8, 6, 5), BLOCKS)
    for ca, cb in zip(a.components, b.components, strict=True):
        np.testing.assert_allclose(ca, cb, atol=1e-5)  # deterministic sign convention


def test_components_orthonormal_and_sign_convention():
    basis = fit_basis(merge_client_stats([client_stats(c) for c in _clients()]), (8, 6, 5), BLOCKS)
    for w in basis.components:
        np.testing.assert_allclose(w.T @ w, np.eye(w.shape[1]), atol=1e-5)
        idx = np.argmax(np.abs(w), axis=0)
        assert np.all(w[idx, np.arange(w.shape[1])] > 0)


def test_shared_basis_same_input_same_vector_in_any_batch():
    clients = _clients()
    basis = fit_basis(merge_client_stats([client_stats(c) for c in clients]), (256 // 8, 16, 16), BLOCKS)
    x = clients[0]
    batch_a = {b: x[b][:4] for b in BLOCKS}  # image 0 in a batch of 4
    batch_b = {b: np.concatenate([x[b][:1], clients[1][b][:5]]) for b in BLOCKS}  # with others
    fa, fb = fuse(batch_a, basis), fuse(batch_b, basis)
    np.testing.assert_allclose(fa[0], fb[0], rtol=0, atol=0)
    # The public code's per-batch refit gives the same image different coordinates.
    pa = fuse_per_batch(batch_a, (32, 16, 16))
    pb = fuse_per_batch(batch_b, (32, 16, 16))
    assert pa.shape == fa.shape and pb.shape == fb.shape
    assert not np.allclose(pa[0], pb[0], atol=1e-3)


def test_fuse_is_per_block_affine_map_in_block_order():
    x = {1: np.arange(6, dtype=np.float32).reshape(1, 2, 3), 2: np.ones((1, 2, 2), np.float32)}
    basis = Basis(
        mode="test",
        blocks=(2, 1),
        means=(np.array([1.0, 0.0], np.float32), np.array([0.0, 1.0, 2.0], np.float32)),
        components=(np.array([[1.0], [0.0]], np.float32), np.eye(3, 2, dtype=np.float32)),
    )
    out = fuse(x, basis)
    assert out.shape == (1, 2, 3)
    # block 2 first: (1-1)=0; then block 1: (x - [0,1,2])[:, :2]
    np.testing.assert_array_equal(out[0], [[0.0, 0.0, 0.0], [0.0, 3.0, 3.0]])


def test_fuse_to_512_with_paper_widths():
    rng = np.random.default_rng(0)
    chans = {1: 1280, 2: 640, 3: 320}
    pooled = {b: rng.standard_normal((3, 2, c)).astype(np.float32) for b, c in chans.items()}
    basis = random_basis(chans, (256, 128, 128), BLOCKS, seed=7)
    assert fuse(pooled, basis).shape == (3, 2, 512)
    # Fewer rows than widths: the per-batch refit pads the missing components with zeros.
    per_batch = fuse_per_batch({b: rng.standard_normal((3, 2, c)) for b, c in chans.items()}, (256, 128, 128))
    assert per_batch.shape == (3, 2, 512) and not per_batch[..., 6:256].any()
    with pytest.raises(ValueError, match="channels"):
        fuse({1: pooled[1][..., :10], 2: pooled[2], 3: pooled[3]}, basis)


def test_random_basis_orthonormal_seeded_zero_mean():
    a = random_basis({1: 40, 2: 24, 3: 16}, (8, 6, 5), BLOCKS, seed=3)
    b = random_basis((40, 24, 16), (8, 6, 5), BLOCKS, seed=3)
    c = random_basis((40, 24, 16), (8, 6, 5), BLOCKS, seed=4)
    assert a.mode == "random" and a.fingerprint() == b.fingerprint() != c.fingerprint()
    for w, m in zip(a.components, a.means, strict=True):
        np.testing.assert_allclose(w.T @ w, np.eye(w.shape[1]), atol=1e-5)
        assert not m.any()
    with pytest.raises(ValueError, match="exceeds"):
        random_basis((4, 24, 16), (8, 6, 5), BLOCKS, seed=3)


def test_clip_widths():
    assert clip_widths((256, 128, 128), (1280, 640, 320)) == (256, 128, 128)
    assert clip_widths((256, 128, 128), (64, 128, 32)) == (64, 128, 32)
    assert clip_widths((256, 128, 128), (32, 64, 64, 32), blocks=(1, 2, 3)) == (64, 64, 32)
    assert clip_widths((256, 128), {1: 100, 3: 500}, blocks=(1, 3)) == (100, 128)
    with pytest.raises(ValueError):
        clip_widths((256, 128, 128), (64, 64))


def test_basis_arrays_round_trip_and_fingerprint():
    basis = fit_basis(merge_client_stats([client_stats(c) for c in _clients()]), (8, 6, 5), BLOCKS)
    arrays = basis.to_arrays()
    assert all(isinstance(v, np.ndarray) for v in arrays.values())
    back = Basis.from_arrays({k: v.copy() for k, v in arrays.items()})
    assert back.mode == basis.mode and back.blocks == basis.blocks
    assert back.fingerprint() == basis.fingerprint()
    for x, y in zip(back.components, basis.components, strict=True):
        np.testing.assert_array_equal(x, y)
    other = fit_basis(merge_client_stats([client_stats(c) for c in _clients(3)]), (8, 6, 5), BLOCKS)
    assert other.fingerprint() != basis.fingerprint()
    with pytest.raises(ValueError, match="missing"):
        Basis.from_arrays({k: v for k, v in arrays.items() if not k.endswith("2.mean")})


def test_stats_arrays_round_trip():
    st = client_stats(_clients(1)[0])
    back = stats_from_arrays(stats_to_arrays(st))
    assert sorted(back) == sorted(st)
    for b in st:
        assert back[b].count == st[b].count
        np.testing.assert_array_equal(back[b].outer, st[b].outer)


def test_local_pca_basis_and_errors():
    x = _pooled(n=20, p=2, seed=0)
    basis = local_pca_basis(x, (8, 6, 5), BLOCKS)
    assert basis.mode == "local-pca"
    ref = PCA(n_components=8, svd_solver="full").fit(x[1].reshape(-1, 40).astype(np.float64))
    np.testing.assert_allclose(
        np.abs(np.sum(basis.components[0] * ref.components_.T, axis=0)), 1.0, atol=1e-4
    )
    with pytest.raises(ValueError, match="exceeds"):
        fit_basis(client_stats(x), (41, 6, 5), BLOCKS)
    with pytest.raises(ValueError, match="NaN"):
        block_stats(np.array([[np.nan, 1.0]]))
