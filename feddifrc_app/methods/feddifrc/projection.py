"""The shared projection basis: pooled per-block teacher features -> the embedding width.

numpy (plus one torch matmul in :func:`fuse`), so it runs on the server, which never loads
the teacher, as well as on clients. Mean pooling commutes with a linear projection, so the
cache holds pooled features ``{block: (..., C_b)}`` and a basis is applied afterwards:
``fused = concat_b((x_b - mean_b) @ W_b)``, ``W_b`` of shape ``(C_b, k_b)``, ``sum_b k_b = D``
(the ResNet-10 embedding width, 512 in the FedDifRC paper).

Bases (``diffusion.projection``):

- ``federated-pca`` (default): clients send only sufficient statistics of their pooled
  features (:class:`BlockStats`); the server merges them and fits ONE PCA basis for all,
  equal to the PCA of the union of all clients' rows. No raw feature leaves a client.
- ``local-pca``: each client fits PCA on its own rows (an ablation: clients end up in
  different coordinates).
- ``random``: a seeded random orthonormal basis, zero mean (an ablation).
- ``per-batch``: :func:`fuse_per_batch`, the FedDifRC public code's PCA refit on every
  batch (features of different batches land in different coordinates), on pooled rows.

A client picks its basis by the run config: :func:`client_basis`.

The class anchors of the TDCL-anchors control (``loss.tdcl-targets = "anchors"``) are fused
means under the federated basis: :func:`prompt_sums` (a node's share), :func:`class_anchors`.

A pooled array ``(N, P, C)`` (image x prompt) contributes ``N * P`` rows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from feddifrc_app.config import Config

# What travels in FedDifRC's messages (record names)
STATS = "pca-stats"  # node -> server, setup reply: stats_to_arrays (+ prompt_sums with the anchors)
BASIS = "basis"  # server -> node, train message: Basis.to_arrays
ANCHORS = "anchors"  # server -> node, train message: the (K, D) class anchors (float32)
_COUNT = "anchors.count"

# --------------------------------------------------------------------------- statistics


@dataclass
class BlockStats:
    """Sufficient statistics of one block's pooled feature rows (float64)."""

    count: int
    total: np.ndarray  # (C,) sum of rows
    outer: np.ndarray  # (C, C) sum of x x^T over rows

    @property
    def channels(self) -> int:
        return int(self.total.shape[0])

    def mean(self) -> np.ndarray:
        if self.count < 1:
            raise ValueError("BlockStats.mean: no rows")
        return self.total / self.count

    def covariance(self) -> np.ndarray:
        """Population covariance ``outer/n - mu mu^T`` (symmetrised)."""
        mu = self.mean()
        cov = self.outer / self.count - np.outer(mu, mu)
        return 0.5 * (cov + cov.T)


def _rows(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim < 1 or x.shape[-1] < 1:
        raise ValueError(f"expected an array (..., C) with C >= 1, got shape {x.shape}")
    return x.reshape(-1, x.shape[-1]).astype(np.float64, copy=False)


def block_stats(x: np.ndarray) -> BlockStats:
    """Statistics of ``x`` (..., C): every leading index is one row."""
    r = _rows(x)
    if not np.all(np.isfinite(r)):
        raise ValueError("block_stats: features contain NaN or inf")
    return BlockStats(count=int(r.shape[0]), total=r.sum(axis=0), outer=r.T @ r)


def merge_stats(parts: Sequence[BlockStats]) -> BlockStats:
    """Sum of statistics (of the same block, from several clients)."""
    parts = list(parts)
    if not parts:
        raise ValueError("merge_stats: nothing to merge")
    c = parts[0].channels
    for p in parts:
        if p.channels != c or p.outer.shape != (c, c):
            raise ValueError(
                f"merge_stats: channel mismatch ({p.channels} vs {c}); "
                "statistics come from different teachers or blocks"
            )
    return BlockStats(
        count=sum(int(p.count) for p in parts),
        total=np.sum([p.total for p in parts], axis=0, dtype=np.float64),
        outer=np.sum([p.outer for p in parts], axis=0, dtype=np.float64),
    )


def client_stats(pooled: Mapping[int, np.ndarray]) -> dict[int, BlockStats]:
    """``{block: (..., C_b)}`` -> ``{block: BlockStats}`` (what a client sends)."""
    return {int(b): block_stats(x) for b, x in pooled.items()}


def merge_client_stats(clients: Sequence[Mapping[int, BlockStats]]) -> dict[int, BlockStats]:
    """Merge per-client ``{block: BlockStats}`` dicts (server side)."""
    clients = list(clients)
    if not clients:
        raise ValueError("merge_client_stats: no client statistics")
    blocks = sorted(clients[0])
    for c in clients:
        if sorted(c) != blocks:
            raise ValueError(f"merge_client_stats: block sets differ ({sorted(c)} vs {blocks})")
    return {b: merge_stats([c[b] for c in clients]) for b in blocks}


def stats_to_arrays(stats: Mapping[int, BlockStats]) -> dict[str, np.ndarray]:
    """Flat ``{name: ndarray}`` for a Flower ArrayRecord (float64, exact)."""
    out: dict[str, np.ndarray] = {}
    for b, s in stats.items():
        out[f"stats.{int(b)}.count"] = np.array([s.count], dtype=np.int64)
        out[f"stats.{int(b)}.total"] = np.ascontiguousarray(s.total, dtype=np.float64)
        out[f"stats.{int(b)}.outer"] = np.ascontiguousarray(s.outer, dtype=np.float64)
    return out


def stats_from_arrays(d: Mapping[str, np.ndarray]) -> dict[int, BlockStats]:
    """Inverse of :func:`stats_to_arrays`."""
    blocks = sorted({int(k.split(".")[1]) for k in d if k.startswith("stats.")})
    if not blocks:
        raise ValueError("stats_from_arrays: no 'stats.*' arrays")
    out = {}
    for b in blocks:
        try:
            count = int(np.asarray(d[f"stats.{b}.count"]).reshape(-1)[0])
            total = np.asarray(d[f"stats.{b}.total"], dtype=np.float64)
            outer = np.asarray(d[f"stats.{b}.outer"], dtype=np.float64)
        except KeyError as e:
            raise ValueError(f"stats_from_arrays: block {b} lacks {e}") from None
        c = total.shape[0]
        if total.shape != (c,) or outer.shape != (c, c):
            raise ValueError(f"stats_from_arrays: block {b} has shapes {total.shape}, {outer.shape}")
        out[b] = BlockStats(count=count, total=total, outer=outer)
    return out


# --------------------------------------------------------------------------- basis


@dataclass(frozen=True, eq=False)
class Basis:
    """One linear map per block: ``(x_b - means[i]) @ components[i]`` (float32)."""

    mode: str
    blocks: tuple[int, ...]
    means: tuple[np.ndarray, ...]  # (C_b,)
    components: tuple[np.ndarray, ...]  # (C_b, k_b), orthonormal columns

    def __post_init__(self) -> None:
        if not (len(self.blocks) == len(self.means) == len(self.components)):
            raise ValueError("Basis: blocks, means and components must have the same length")
        for b, m, w in zip(self.blocks, self.means, self.components, strict=True):
            if m.ndim != 1 or w.ndim != 2 or w.shape[0] != m.shape[0]:
                raise ValueError(f"Basis: block {b}: mean {m.shape} and components {w.shape} mismatch")

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(int(w.shape[1]) for w in self.components)

    def fingerprint(self) -> str:
        """sha256 over mode, blocks and the exact float32 bytes."""
        h = hashlib.sha256()
        h.update(f"{self.mode}|{','.join(map(str, self.blocks))}".encode())
        for m, w in zip(self.means, self.components, strict=True):
            h.update(f"|{m.shape}|{w.shape}|".encode())
            h.update(np.ascontiguousarray(m, dtype="<f4").tobytes())
            h.update(np.ascontiguousarray(w, dtype="<f4").tobytes())
        return h.hexdigest()

    def to_arrays(self) -> dict[str, np.ndarray]:
        """Flat ``{name: ndarray}`` for a Flower ArrayRecord (the mode as utf-8 bytes)."""
        out = {
            "basis.mode": np.frombuffer(self.mode.encode("utf-8"), dtype=np.uint8).copy(),
            "basis.blocks": np.asarray(self.blocks, dtype=np.int64),
        }
        for b, m, w in zip(self.blocks, self.means, self.components, strict=True):
            out[f"basis.{b}.mean"] = np.ascontiguousarray(m, dtype=np.float32)
            out[f"basis.{b}.components"] = np.ascontiguousarray(w, dtype=np.float32)
        return out

    @classmethod
    def from_arrays(cls, d: Mapping[str, np.ndarray]) -> Basis:
        try:
            mode = bytes(np.asarray(d["basis.mode"], dtype=np.uint8)).decode("utf-8")
            blocks = tuple(int(b) for b in np.asarray(d["basis.blocks"]).reshape(-1))
            means = tuple(np.asarray(d[f"basis.{b}.mean"], dtype=np.float32) for b in blocks)
            comps = tuple(np.asarray(d[f"basis.{b}.components"], dtype=np.float32) for b in blocks)
        except KeyError as e:
            raise ValueError(f"Basis.from_arrays: missing array {e}") from None
        return cls(mode=mode, blocks=blocks, means=means, components=comps)


def _check_widths(widths: Sequence[int], blocks: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    widths = tuple(int(w) for w in widths)
    blocks = tuple(int(b) for b in blocks)
    if len(widths) != len(blocks):
        raise ValueError(f"widths {widths} and blocks {blocks} must have the same length")
    if any(w < 1 for w in widths):
        raise ValueError(f"widths must be positive, got {widths}")
    if len(set(blocks)) != len(blocks):
        raise ValueError(f"blocks must be distinct, got {blocks}")
    return widths, blocks


def clip_widths(
    widths: Sequence[int],
    block_channels: Mapping[int, int] | Sequence[int],
    blocks: Sequence[int] | None = None,
) -> tuple[int, ...]:
    """A width above its block's channel count is clipped to it (small teachers).

    ``block_channels`` is aligned with ``widths``, or (with ``blocks``) a
    mapping/sequence indexed by block id, e.g. ``teacher.block_channels``.
    ``fused_widths`` also checks that the clipped sum is still the embedding width.
    """
    widths = tuple(int(w) for w in widths)
    if blocks is not None:
        chans = tuple(int(block_channels[int(b)]) for b in blocks)
    elif isinstance(block_channels, Mapping):
        raise ValueError("clip_widths: a block->channels mapping needs the blocks argument")
    else:
        chans = tuple(int(c) for c in block_channels)
    if len(widths) != len(chans):
        raise ValueError(f"widths {widths} and block channels {chans} differ in length")
    return tuple(min(w, c) for w, c in zip(widths, chans, strict=True))


def fused_widths(widths: Sequence[int], block_channels: Sequence[int], embedding_dim: int) -> tuple[int, ...]:
    """``clip_widths`` that also checks the fused vector still has the classifier's width."""
    out = clip_widths(widths, block_channels)
    if sum(out) != embedding_dim:
        raise ValueError(
            f"diffusion.channels = {','.join(map(str, widths))} clipped to the teacher's block widths "
            f"{list(block_channels)} gives {sum(out)} dims, but the ResNet-10 embedding is {embedding_dim}-d "
            "(8 x model.width); choose diffusion.blocks/channels that fit this teacher"
        )
    return out


def _sign_fix(vecs: np.ndarray) -> np.ndarray:
    """Deterministic sign: each column's largest-|.| entry (first on ties) is positive."""
    idx = np.argmax(np.abs(vecs), axis=0)
    signs = np.sign(vecs[idx, np.arange(vecs.shape[1])])
    signs[signs == 0] = 1.0
    return vecs * signs


def _pca_from_stats(s: BlockStats, k: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    if s.count < 1:
        raise ValueError(f"block {block}: no feature rows to fit a basis on")
    if k > s.channels:
        raise ValueError(
            f"block {block}: width {k} exceeds the block's {s.channels} channels "
            "(clip the widths with clip_widths first)"
        )
    cov = s.covariance()
    vals, vecs = np.linalg.eigh(cov)  # ascending
    order = np.argsort(-vals, kind="stable")[:k]
    comps = _sign_fix(vecs[:, order])
    return s.mean().astype(np.float32), np.ascontiguousarray(comps, dtype=np.float32)


def fit_basis(
    stats: Mapping[int, BlockStats] | Sequence[BlockStats],
    widths: Sequence[int],
    blocks: Sequence[int],
    mode: str = "federated-pca",
) -> Basis:
    """PCA basis from (merged) sufficient statistics.

    ``stats`` is ``{block: BlockStats}`` or a sequence aligned with ``blocks``.
    Per block: ``cov = outer/n - mu mu^T``, ``eigh``, the top-``k_b``
    eigenvectors, sign-fixed (largest-|.| entry positive). With fewer rows than
    ``k_b`` the trailing components span the null space (zero variance) and
    are still orthonormal; federated statistics normally avoid that.
    """
    widths, blocks = _check_widths(widths, blocks)
    if isinstance(stats, Mapping):
        missing = [b for b in blocks if b not in stats]
        if missing:
            raise ValueError(f"fit_basis: no statistics for block(s) {missing}")
        per_block = [stats[b] for b in blocks]
    else:
        per_block = list(stats)
        if len(per_block) != len(blocks):
            raise ValueError(f"fit_basis: {len(per_block)} statistics for {len(blocks)} blocks")
    means, comps = [], []
    for b, s, k in zip(blocks, per_block, widths, strict=True):
        m, w = _pca_from_stats(s, k, b)
        means.append(m)
        comps.append(w)
    return Basis(mode=mode, blocks=blocks, means=tuple(means), components=tuple(comps))


def fit_federated_basis(
    clients: Sequence[Mapping[int, BlockStats]],
    channels: Sequence[int],
    blocks: Sequence[int],
    embedding_dim: int,
) -> tuple[Basis, dict[int, BlockStats]]:
    """``diffusion.projection = "federated-pca"``: the one basis every client fuses with.

    The clients' ``{block: BlockStats}`` merged (:func:`merge_client_stats`), the configured
    widths ``channels`` clipped to the teacher's blocks and checked to fuse into the
    ``embedding_dim``-d student embedding (:func:`fused_widths`), one PCA per block. The
    ServerApp and the benchmarks both fit it here. Returns (basis, the merged statistics).
    """
    merged = merge_client_stats(clients)
    widths = fused_widths(channels, [merged[int(b)].channels for b in blocks], embedding_dim)
    return fit_basis(merged, widths, blocks, mode="federated-pca"), merged


def local_pca_basis(pooled: Mapping[int, np.ndarray], widths: Sequence[int], blocks: Sequence[int]) -> Basis:
    """PCA on one client's own rows (``local-pca``). Errors when rows < width."""
    widths, blocks = _check_widths(widths, blocks)
    stats = {}
    for b, k in zip(blocks, widths, strict=True):
        if b not in pooled:
            raise ValueError(f"local_pca_basis: no features for block {b}")
        s = block_stats(pooled[b])
        if s.count < k:
            raise ValueError(
                f"local-pca: block {b} has {s.count} feature rows (images x prompts) but width {k} "
                "needs at least as many; use diffusion.projection = 'federated-pca' (statistics "
                "pooled over all clients) or more local data"
            )
        stats[b] = s
    return fit_basis(stats, widths, blocks, mode="local-pca")


def random_basis(
    block_channels: Mapping[int, int] | Sequence[int],
    widths: Sequence[int],
    blocks: Sequence[int],
    seed: int,
) -> Basis:
    """Seeded random orthonormal columns (QR of a Gaussian), zero mean."""
    widths, blocks = _check_widths(widths, blocks)
    if isinstance(block_channels, Mapping):
        chans = [int(block_channels[b]) for b in blocks]
    else:
        chans = [int(c) for c in block_channels]
        if len(chans) != len(blocks):
            raise ValueError(f"random_basis: {len(chans)} channel counts for {len(blocks)} blocks")
    means, comps = [], []
    for b, c, k in zip(blocks, chans, widths, strict=True):
        if k > c:
            raise ValueError(f"block {b}: width {k} exceeds the block's {c} channels (clip_widths)")
        rng = np.random.default_rng([int(seed), int(b), 0x5EED])
        q, r = np.linalg.qr(rng.standard_normal((c, k)))
        d = np.sign(np.diag(r))
        d[d == 0] = 1.0
        means.append(np.zeros(c, dtype=np.float32))
        comps.append(np.ascontiguousarray(q * d, dtype=np.float32))
    return Basis(mode="random", blocks=blocks, means=tuple(means), components=tuple(comps))


def client_basis(cfg: Config, pooled: Mapping[int, np.ndarray], server_basis: Basis | None) -> Basis | None:
    """The basis a client projects with under ``diffusion.projection`` (the server's under
    ``federated-pca``, which the node half requires of the message); None for ``per-batch``."""
    d = cfg.diffusion
    chans = [pooled[b].shape[-1] for b in d.blocks]
    widths = fused_widths(d.channels, chans, cfg.embedding_dim)
    if d.projection == "federated-pca":
        return server_basis
    if d.projection == "local-pca":
        return local_pca_basis(pooled, widths, d.blocks)
    if d.projection == "random":
        return random_basis(chans, widths, d.blocks, seed=cfg.seed)
    return None  # per-batch


# --------------------------------------------------------------------------- fusion


def fuse(pooled: Mapping[int, np.ndarray], basis: Basis) -> np.ndarray:
    """``{block: (..., C_b)}`` -> ``(..., sum k_b)`` float32, concatenated in ``basis.blocks`` order."""
    parts = []
    lead = None
    for b, m, w in zip(basis.blocks, basis.means, basis.components, strict=True):
        if b not in pooled:
            raise ValueError(f"fuse: no features for block {b} (have {sorted(pooled)})")
        x = np.asarray(pooled[b])
        if x.shape[-1] != w.shape[0]:
            raise ValueError(
                f"fuse: block {b} features have {x.shape[-1]} channels, the basis expects {w.shape[0]} "
                "(features and basis come from different teachers)"
            )
        if lead is None:
            lead = x.shape[:-1]
        elif x.shape[:-1] != lead:
            raise ValueError(f"fuse: block {b} has leading shape {x.shape[:-1]}, expected {lead}")
        # The product runs in torch, not numpy: numpy's OpenBLAS pool keeps spinning after a
        # matmul and steals the second core from the training step that follows (measured:
        # FedDifRC/FedAvg round 1.37x -> 1.13x on 2 cores, benchmarks/round_overhead.py).
        xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
        parts.append(((xt - torch.from_numpy(m)) @ torch.from_numpy(w)).numpy())
    return np.concatenate(parts, axis=-1)


def fuse_per_batch(pooled: Mapping[int, np.ndarray], widths: Sequence[int]) -> np.ndarray:
    """The PUBLIC CODE's fusion: PCA refit on THIS batch, per block.

    For comparison only. Blocks in ascending order (as ``pooled`` holds them),
    ``widths`` aligned with that order. Rows are the batch's pooled (image,
    prompt) pairs; when there are fewer rows than a width the missing
    components are zero (the data has no more directions). The same input in a
    different batch gets different coordinates: that is the defect.
    """
    blocks = tuple(sorted(int(b) for b in pooled))
    widths, blocks = _check_widths(widths, blocks)
    parts = []
    for b, k in zip(blocks, widths, strict=True):
        x = np.asarray(pooled[b])
        r = _rows(x)
        if k > r.shape[1]:
            raise ValueError(f"fuse_per_batch: block {b}: width {k} exceeds {r.shape[1]} channels")
        centred = r - r.mean(axis=0)
        _, _, vt = np.linalg.svd(centred, full_matrices=False)
        w = np.zeros((r.shape[1], k))
        n = min(k, vt.shape[0])
        w[:, :n] = _sign_fix(vt[:n].T)
        parts.append((centred @ w).astype(np.float32).reshape(*x.shape[:-1], k))
    return np.concatenate(parts, axis=-1)


# --------------------------------------------------------------------------- class anchors
# TDCL-anchors (``loss.tdcl-targets = "anchors"``): every image's TDCL targets replaced by the
# teacher's class-prompt means of the fused representations, ``anchor_k = mean_i fused[i, k]`` over
# all nodes' training images. Paired against TDCL-only it removes the per-image diffusion content
# and keeps the fixed class anchors.
#
# Exact from sums: ``fuse`` is affine per block (``(x_b - m_b) @ W_b``), so the mean of the fused
# rows is the fused mean of the pooled rows. Each node sends, in its setup reply beside the PCA
# statistics, the per-prompt SUMS of its pooled features over its images and its image count (no
# raw feature leaves it); the server adds them up, divides and fuses the means with the federated
# basis, and ships the ``(K, D)`` anchors in every train message.


def prompt_sums(pooled: Mapping[int, np.ndarray], k: int) -> dict[str, np.ndarray]:
    """A node's share: per block the float64 sum over its images of the first ``k`` (class)
    prompts' pooled rows ``(k, C_b)``, and its image count (``pooled``: ``{block: (n, P, C_b)}``)."""
    counts = {int(x.shape[0]) for x in pooled.values()}
    if len(counts) != 1:
        raise ValueError(f"prompt_sums: blocks hold different numbers of images {sorted(counts)}")
    out = {_COUNT: np.array([counts.pop()], dtype=np.int64)}
    for b, x in pooled.items():
        out[f"anchors.{int(b)}.sum"] = np.asarray(x[:, :k], dtype=np.float64).sum(axis=0)
    return out


def class_anchors(parts: Sequence[Mapping[str, np.ndarray]], basis: Basis) -> np.ndarray:
    """The server's anchors ``(K, D)`` float32 from the nodes' :func:`prompt_sums`: summed,
    divided by the total image count and fused with ``basis`` (affine: = the mean fused row)."""
    parts = list(parts)
    missing = [i for i, p in enumerate(parts) if _COUNT not in p]
    if not parts or missing:
        raise ValueError(
            "loss.tdcl-targets = 'anchors': a setup reply lacks the per-prompt sums "
            "(the node runs an older app or another config)"
        )
    n = sum(int(np.asarray(p[_COUNT]).reshape(-1)[0]) for p in parts)
    if n < 1:
        raise ValueError("loss.tdcl-targets = 'anchors': the nodes hold no training images")
    means = {b: np.sum([p[f"anchors.{b}.sum"] for p in parts], axis=0) / n for b in basis.blocks}
    return fuse(means, basis)
