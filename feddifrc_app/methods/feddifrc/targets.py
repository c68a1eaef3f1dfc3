"""The frozen diffusion targets one client trains against.

Pipeline for a client's images ``ids`` (dataset indices)::

    pooled per-block teacher features  {block: (n, P, C_b)}   <- feature cache (extract on a miss)
    shared basis (federated PCA from the server / local PCA / random)
    fused = fuse(pooled, basis)        (n, P, D)    D = the classifier embedding width
    TDCL reps = fused[:, :K]           (n, K, D)    the image under each class prompt
    NDCR target = fused[:, -1]         (n, D)       the image under the NDCR prompt

Prompts are ordered: the K class prompts in LABEL order, then the NDCR prompt
(self-supervised: the positive prompt, the negatives, then the NDCR prompt).
The pooled features come through ``teacher.py`` (the teacher is loaded lazily, only when the
cache misses, so a warm cache means no Stable Diffusion load at all). A ClientApp makes one
call here per train message: ``node_targets``.

A client's fused targets are prepared once (``client_targets``) and kept twice: in this
process (``PREPARED``) and on disk beside the feature cache, so that a new process (a
deployment starts one per message) loads one small verified file instead of re-reading and
re-fusing every shard::

    <cache_dir>/targets/<key>.npz     key = sha256 of everything the targets depend on

A verified array file (``files.write_archive``): ``header`` (format, version, key, n,
``members`` {name: [dtype, shape]}, sha256), ``ids`` (int64, the client's dataset ids in
order), ``prompt_reps`` float32 (n, K, D) and/or ``ndcr`` float32 (n, D), and the basis they
were fused with (``basis.*``, ``Basis.to_arrays``). ``sha256`` covers every member but the
header, in name order. A file that fails any check is logged, never used, and rewritten.
The per-batch comparison mode keeps pooled rows (the shards themselves): nothing is stored.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from feddifrc_app import log
from feddifrc_app.config import Config
from feddifrc_app.data.dataset import ImageData, eval_transform
from feddifrc_app.diffusion.cache import CacheStats
from feddifrc_app.diffusion.featurizer import Featurizer
from feddifrc_app.files import CorruptFile, array_digest, dead_temp_files, read_archive, write_archive
from feddifrc_app.methods.feddifrc.projection import (
    Basis,
    client_stats,
    clip_widths,
    fuse,
    fuse_per_batch,
    fused_widths,
    local_pca_basis,
    random_basis,
    stats_to_arrays,
)
from feddifrc_app.methods.feddifrc.prompts import teacher_prompts
from feddifrc_app.methods.feddifrc.teacher import (
    FeatureSet,
    TeacherSpec,
    feature_set,
    featurizer,
    pooled_features,
    teacher_spec,
)


@dataclass
class TeacherTargets:
    """Frozen diffusion targets for one client's training images.

    ``rows[i]`` is the row of dataset index ``i`` (-1 = not in this client's set).
    Supervised: ``prompt_reps`` (n, K, D) = the image under each class prompt, ``ndcr`` (n, D).
    Self-supervised: ``prompt_reps`` (n, 1 + K_neg, D) = positive prompt first, then negatives.
    ``per_batch`` is the public code's behaviour: pooled per-block features are kept and the
    PCA is refit on every batch by ``fuse_batch`` (comparison only).
    """

    rows: torch.Tensor  # int64 (max_index + 1,)
    prompt_reps: torch.Tensor | None  # float32 (n, K, D)
    ndcr: torch.Tensor | None  # float32 (n, D)
    # per-batch mode: ({block: pooled (n, P, C_b)}, widths, K) -> PCA refit on each batch
    per_batch: tuple[dict[int, np.ndarray], tuple[int, ...], int] | None = None

    @property
    def nbytes(self) -> int:
        parts = [self.rows, self.prompt_reps, self.ndcr]
        size = sum(t.numel() * t.element_size() for t in parts if t is not None)
        return size + (sum(a.nbytes for a in self.per_batch[0].values()) if self.per_batch else 0)

    def on(self, device: torch.device, ids: np.ndarray) -> TeacherTargets:
        """These targets on ``device`` for training on dataset indices ``ids`` (moved once per round,
        gathered there every step). Every id must have a row (KeyError otherwise): checked here, once,
        so that ``take`` on a GPU gathers with device-resident indices and no host sync per step."""
        self._require(torch.as_tensor(np.asarray(ids, dtype=np.int64)))
        if self.per_batch is not None:  # fused on the CPU every batch: rows stay there
            return self

        def move(t):
            return None if t is None else t.to(device)

        return TeacherTargets(move(self.rows), move(self.prompt_reps), move(self.ndcr), self.per_batch)

    def _require(self, idx: torch.Tensor) -> None:
        rows = self.rows.cpu()
        if bool((idx >= len(rows)).any()) or bool((rows[idx.clamp(max=len(rows) - 1)] < 0).any()):
            raise KeyError("a training image has no teacher target (targets built for other indices)")

    def take(self, idx: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(TDCL representations (B, K, D), NDCR targets (B, D)) of dataset indices ``idx`` (B,),
        on the targets' device. On the CPU ``idx`` is checked here (free); on a GPU it must be among
        the ids given to ``on``, which checked them."""
        if self.rows.device.type == "cpu":
            self._require(idx.cpu())
        r = self.rows[idx.to(self.rows.device, non_blocking=True)]
        if self.per_batch is not None:
            pooled, widths, k = self.per_batch
            fused = torch.from_numpy(fuse_per_batch({b: x[r.numpy()] for b, x in pooled.items()}, widths))
            return fused[:, :k], fused[:, -1]
        reps = None if self.prompt_reps is None else self.prompt_reps[r]
        ndcr = None if self.ndcr is None else self.ndcr[r]
        return reps, ndcr


def client_basis(cfg: Config, pooled: dict[int, np.ndarray], server_basis: Basis | None) -> Basis | None:
    """The basis this client projects with; None for the public code's per-batch refit."""
    d = cfg.diffusion
    chans = [pooled[b].shape[-1] for b in d.blocks]
    widths = fused_widths(d.channels, chans, cfg.embedding_dim)
    if d.projection == "federated-pca":
        if server_basis is None:
            raise ValueError("diffusion.projection = 'federated-pca' but the server sent no basis")
        return server_basis
    if d.projection == "local-pca":
        return local_pca_basis(pooled, widths, d.blocks)
    if d.projection == "random":
        return random_basis(chans, widths, d.blocks, seed=cfg.seed)
    return None  # per-batch


def _rows(ids: np.ndarray) -> torch.Tensor:
    """``TeacherTargets.rows``: dataset index -> row in the client's arrays (-1: not this client's)."""
    rows = torch.full((int(ids.max()) + 1,), -1, dtype=torch.int64)
    rows[torch.as_tensor(ids)] = torch.arange(len(ids))
    return rows


def build_targets(
    cfg: Config, pooled: dict[int, np.ndarray], ids: np.ndarray, basis: Basis | None, num_prompts_tdcl: int
) -> TeacherTargets:
    """Fuse once with the shared basis (or keep pooled rows for the per-batch comparison mode)."""
    ids = np.asarray(ids, dtype=np.int64)
    rows = _rows(ids)
    if basis is None:
        widths = clip_widths(cfg.diffusion.channels, [pooled[b].shape[-1] for b in cfg.diffusion.blocks])
        return TeacherTargets(
            rows=rows,
            prompt_reps=None,
            ndcr=None,
            per_batch=({b: pooled[b] for b in cfg.diffusion.blocks}, widths, num_prompts_tdcl),
        )
    fused = torch.from_numpy(fuse(pooled, basis))  # (n, P, D)
    reps = fused[:, :num_prompts_tdcl].contiguous() if cfg.loss.tdcl_weight > 0 else None
    ndcr = fused[:, -1].contiguous() if cfg.loss.ndcr_weight > 0 else None
    return TeacherTargets(rows=rows, prompt_reps=reps, ndcr=ndcr)


class _Prepared:
    """A client's static targets, kept per process and keyed by everything they are computed from.

    A simulation actor serves the same partitions round after round; without this it re-read
    the client's cached features (at CIFAR-10 scale ~2.5 GB of shards) and fused them every
    round. Least recently used entries go first once ``budget`` bytes are held. A new process
    finds them on disk instead (``client_targets``).
    """

    def __init__(self, budget: int) -> None:
        self.budget, self.items = budget, OrderedDict[str, tuple[TeacherTargets, Basis | None]]()

    def get(self, key: str) -> tuple[TeacherTargets, Basis | None] | None:
        if key in self.items:
            self.items.move_to_end(key)
        return self.items.get(key)

    def put(self, key: str, value: tuple[TeacherTargets, Basis | None]) -> None:
        self.items[key] = value
        while len(self.items) > 1 and sum(t.nbytes for t, _ in self.items.values()) > self.budget:
            self.items.popitem(last=False)


PREPARED = _Prepared(budget=2 << 30)

TARGETS_FORMAT = "feddifrc-targets"
TARGETS_VERSION = 1  # bump when fusion or this layout changes: old files then stop matching any key
# Bytes of prepared-target files kept per cache folder (a paper-scale CIFAR-10 client: ~110 MB);
# the least recently used go first, the one just written always stays.
TARGETS_DISK_BUDGET = 4 << 30


def _members(targets: TeacherTargets, ids: np.ndarray, basis: Basis) -> dict[str, np.ndarray]:
    out = {"ids": ids, **basis.to_arrays()}
    if targets.prompt_reps is not None:
        out["prompt_reps"] = targets.prompt_reps.numpy()
    if targets.ndcr is not None:
        out["ndcr"] = targets.ndcr.numpy()
    return out


def _digest(members: dict[str, np.ndarray]) -> str:
    return array_digest((f"|{k}|", members[k]) for k in sorted(members))


def save_prepared(path: Path, key: str, ids: np.ndarray, targets: TeacherTargets, basis: Basis) -> None:
    """Write a client's prepared targets to ``path`` atomically (readers see the old file or this one)."""
    members = _members(targets, ids, basis)
    header = {
        "format": TARGETS_FORMAT,
        "version": TARGETS_VERSION,
        "key": key,
        "n": int(len(ids)),
        "members": {k: [a.dtype.str, list(a.shape)] for k, a in sorted(members.items())},
        "sha256": _digest(members),
    }
    write_archive(path, header, members)


def load_prepared(path: Path, key: str, ids: np.ndarray) -> tuple[TeacherTargets, Basis]:
    """The targets ``save_prepared`` wrote for ``key`` and ``ids``; ``CorruptFile`` (the reason)
    unless every check holds, ``FileNotFoundError`` if there is none."""
    header, members = read_archive(path)
    if header.get("format") != TARGETS_FORMAT or header.get("version") != TARGETS_VERSION:
        raise CorruptFile(f"format {header.get('format')!r} v{header.get('version')!r}")
    if header.get("key") != key:
        raise CorruptFile(f"belongs to key {str(header.get('key'))[:12]}..., not {key[:12]}...")
    listed = header.get("members")
    if not isinstance(listed, dict) or set(listed) != set(members):
        raise CorruptFile(f"members {sorted(members)}, header lists {listed!r}")
    for k, a in members.items():
        if [a.dtype.str, list(a.shape)] != listed[k]:
            raise CorruptFile(f"{k}: {a.dtype.str} {list(a.shape)}, header says {listed[k]}")
    n = len(ids)
    if header.get("n") != n or not np.array_equal(members.get("ids"), ids):
        raise CorruptFile(f"prepared for other images (n = {header.get('n')}, this client has {n})")
    reps, ndcr = members.get("prompt_reps"), members.get("ndcr")
    if (reps is None and ndcr is None) or any(a is not None and a.shape[0] != n for a in (reps, ndcr)):
        raise CorruptFile("no targets, or not one row per image")
    if _digest(members) != header.get("sha256"):
        raise CorruptFile("checksum mismatch")
    try:
        basis = Basis.from_arrays(members)
    except ValueError as e:
        raise CorruptFile(f"basis: {e}") from None
    reps, ndcr = (None if a is None else torch.from_numpy(a) for a in (reps, ndcr))
    return TeacherTargets(rows=_rows(ids), prompt_reps=reps, ndcr=ndcr), basis


def _evict(folder: Path, keep: Path, budget: int) -> None:
    """Remove the least recently used target files beyond ``budget`` bytes (never ``keep``), and the
    temp files of writers killed mid-write."""
    for p in dead_temp_files(folder):
        p.unlink(missing_ok=True)
    files = []
    for p in folder.glob("*.npz"):
        try:
            st = p.stat()
        except FileNotFoundError:  # another process evicted it
            continue
        files.append((p != keep, -st.st_mtime_ns, st.st_size, p))
    total = 0
    for others, _, size, p in sorted(files):  # `keep` first, then newest first
        total += size
        if others and total > budget:
            p.unlink(missing_ok=True)
            log.info("prepared targets: removed %s (least recently used; %d bytes kept at most)", p, budget)


def _stored(path: Path, key: str, ids: np.ndarray) -> tuple[TeacherTargets, Basis] | None:
    """This client's targets from disk, or None when there are none or they do not check (logged)."""
    try:
        t0 = time.perf_counter()
        out = load_prepared(path, key, ids)
    except FileNotFoundError:
        return None
    except CorruptFile as e:
        log.warning(
            "prepared targets: %s is invalid (%s); preparing them again from the feature cache", path, e
        )
        return None
    with contextlib.suppress(OSError):  # a read-only cache: eviction may then pick it sooner, no more
        os.utime(path)  # recently used: eviction keeps it
    log.info(
        "prepared targets: loaded %s (%d images) in %.2fs", path.name, len(ids), time.perf_counter() - t0
    )
    return out


def targets_key(
    cfg: Config, feature_key: str, ids: np.ndarray, server_basis: Basis | None, num_prompts_tdcl: int
) -> str:
    """sha256 of everything a client's prepared targets depend on: the feature key (teacher weights,
    dtype, prompts, dataset, ...), the basis (the server's by fingerprint, else how it is derived),
    the client's ids in order, the terms that are kept, the fused widths and the stored format."""
    d, loss = cfg.diffusion, cfg.loss
    h = hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes())
    basis_id = server_basis.fingerprint() if server_basis is not None else f"{d.projection}|{cfg.seed}"
    h.update(
        f"|{feature_key}|{basis_id}|{num_prompts_tdcl}|{loss.tdcl_weight > 0}|{loss.ndcr_weight > 0}".encode()
    )
    h.update(f"|{d.channels}|{cfg.embedding_dim}|{TARGETS_FORMAT}-v{TARGETS_VERSION}|float32".encode())
    return h.hexdigest()


def client_targets(
    cfg: Config,
    features: FeatureSet,
    ids: np.ndarray,
    server_basis: Basis | None,
    num_prompts_tdcl: int,
) -> tuple[TeacherTargets, Basis | None, CacheStats]:
    """A client's static targets and the basis they were fused with: from this process's memory,
    else from ``<cache_dir>/targets/``, else prepared (cache read, basis, fusion) and stored in both."""
    ids = np.asarray(ids, dtype=np.int64)
    key = targets_key(cfg, features.key, ids, server_basis, num_prompts_tdcl)
    if (hit := PREPARED.get(key)) is not None:
        return *hit, CacheStats(hits=int(np.unique(ids).size))
    path = features.spec.cache_dir / "targets" / f"{key}.npz"
    if cfg.diffusion.projection != "per-batch" and (stored := _stored(path, key, ids)) is not None:
        PREPARED.put(key, stored)
        return *stored, CacheStats(hits=int(np.unique(ids).size))
    pooled, stats = pooled_features(features, ids)
    basis = client_basis(cfg, pooled, server_basis)
    targets = build_targets(cfg, pooled, ids, basis, num_prompts_tdcl)
    PREPARED.put(key, (targets, basis))
    if basis is not None:
        try:
            save_prepared(path, key, ids, targets, basis)
            _evict(path.parent, path, TARGETS_DISK_BUDGET)
        except OSError as e:  # the run does not need the file: the next process prepares them again
            log.warning(
                "prepared targets: could not write %s (%s); a new process will prepare them again", path, e
            )
    return targets, basis, stats


def node_stats(
    cfg: Config, spec: TeacherSpec, data: ImageData, ids: np.ndarray
) -> tuple[dict[str, np.ndarray], CacheStats]:
    """What a node sends once for the federated basis: the sufficient statistics of its pooled
    teacher features (``projection.stats_to_arrays``; no raw feature leaves it), and their cost."""
    pooled, stats = pooled_features(feature_set(spec, data, teacher_prompts(cfg, data.class_names)), ids)
    return stats_to_arrays(client_stats(pooled)), stats


def num_prompts_tdcl(cfg: Config, num_classes: int, prompts: tuple[str, ...]) -> int:
    """How many of ``prompts`` TDCL contrasts (the rest: the NDCR prompt, last): every class
    prompt, or (self-supervised) the positive prompt and the negatives."""
    return len(prompts) - 1 if cfg.self_supervised else num_classes


def node_targets(
    cfg: Config,
    cache_dir: Path,
    data: ImageData,
    ids: np.ndarray,
    server_basis: Basis | None,
    model: torch.nn.Module,
    device: torch.device,
) -> tuple[TeacherTargets, dict[str, float]]:
    """The one call a ClientApp makes for its teacher targets in a train message: this node's
    targets under the server's basis (cached features, no SD call on a hit), conditioned on the
    received ``model`` when ``diffusion.condition = "global-model"``, and their cost as reply
    metrics (``teacher-seconds``, ``teacher-cache-misses``, ``condition-seconds``)."""
    if cfg.diffusion.projection == "federated-pca" and server_basis is None:
        # Fail before touching the teacher: extracting features for nothing would waste minutes.
        raise ValueError("diffusion.projection = 'federated-pca' but the server sent no basis")
    t0 = time.perf_counter()
    prompts = teacher_prompts(cfg, data.class_names)
    features = feature_set(teacher_spec(cfg, cache_dir), data, prompts)
    k = num_prompts_tdcl(cfg, data.num_classes, prompts)
    targets, basis, stats = client_targets(cfg, features, ids, server_basis, k)
    metrics: dict[str, float] = {}
    if cfg.diffusion.condition == "global-model":
        targets, metrics["condition-seconds"] = conditioned_targets(
            features, model, ids, basis, targets, device
        )
    metrics["teacher-seconds"] = time.perf_counter() - t0
    metrics["teacher-cache-misses"] = float(stats.misses)
    return targets, metrics


# What a VAE latent depends on -> {image id: latent (C, h, w)}: ~12 KB per image at 224 px.
_LATENTS: dict[tuple, dict[int, torch.Tensor]] = {}


def _latent_key(feat: Featurizer, data: ImageData) -> tuple:
    t = feat.teacher
    return (t.weights_hash, str(t.device), str(t.dtype), feat.resolution, data.fingerprint)


def conditioned_targets(
    features: FeatureSet,
    model: torch.nn.Module,
    ids: np.ndarray,
    basis: Basis | None,
    targets: TeacherTargets,
    device: torch.device,
) -> tuple[TeacherTargets, float]:
    """``diffusion.condition = "global-model"``: our reading of FedDifRC's model-conditioned c_i = h(x_i).

    Once per round, embed the client's (un-augmented) images with the received global model,
    map each D-d embedding to the text width with a FIXED seeded Gaussian projection,
    rescale it to the mean norm of the prompt token embeddings, add it to every prompt token
    of that image's rows and recompute the TDCL representations (class prompts only; the NDCR
    target stays the static one). Not cacheable: it changes every round. Returns the new
    targets and the seconds it cost.
    """
    t0 = time.perf_counter()
    spec, data = features.spec, features.data
    feat = featurizer(spec)
    k = targets.prompt_reps.shape[1] if targets.prompt_reps is not None else 0
    if k == 0:
        return targets, 0.0
    class_prompts = features.prompts[:k]
    width = feat.teacher.text_width
    gen = torch.Generator().manual_seed(spec.seed + 0xC0D1)
    dim = int(targets.prompt_reps.shape[-1])  # D: the fused width is the student's embedding width
    proj = torch.randn(dim, width, generator=gen) / dim**0.5  # (D, D_text)
    token_norm = float(feat.prompt_embeddings(class_prompts).float().norm(dim=-1).mean())
    model.to(device).eval()
    reps = []
    tf = eval_transform(data)
    bs = spec.batch_size
    # The images are the same every round: their VAE latents are encoded once per process.
    memo = _LATENTS.setdefault(_latent_key(feat, data), {})
    for s in range(0, len(ids), bs):
        chunk = np.asarray(ids[s : s + bs])
        imgs = data.images[torch.as_tensor(chunk)]
        with torch.no_grad():
            z, _ = model(torch.stack([tf(im) for im in imgs]).to(device))
        off = z.float().cpu() @ proj  # (B, D_text)
        off = off / off.norm(dim=-1, keepdim=True).clamp_min(1e-8) * token_norm
        if any(int(i) not in memo for i in chunk):
            memo.update(zip(map(int, chunk), feat.encode(imgs), strict=True))
        latents = torch.stack([memo[int(i)] for i in chunk])
        out = feat(
            imgs, torch.as_tensor(chunk, dtype=torch.int64), class_prompts, token_offsets=off, latents=latents
        )
        reps.append(fuse({b: v.numpy() for b, v in out.items()}, basis))
    new = TeacherTargets(
        rows=targets.rows, prompt_reps=torch.from_numpy(np.concatenate(reps)), ndcr=targets.ndcr
    )
    return new, time.perf_counter() - t0
