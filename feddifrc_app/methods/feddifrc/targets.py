"""The frozen diffusion targets one client trains against: what they are, how a node gets them
(numbered steps) and where they are kept.

    pooled per-block teacher features  {block: (n, P, C_b)}   <- feature cache (extract on a miss)
    shared basis (federated PCA from the server / local PCA / random)
    fused = fuse(pooled, basis)        (n, P, D)    D = the classifier embedding width
    TDCL reps = fused[:, :K]           (n, K, D)    the image under each class prompt
    NDCR target = fused[:, -1]         (n, D)       the image under the NDCR prompt

Prompts: the K class prompts in LABEL order, then the NDCR prompt (self-supervised: the positive
prompt, the negatives, then the NDCR prompt). The node resolves its ``Plan`` once, at the
message's edge (``node.py``; kept for the process), and there, with the message's basis, the
targets' key; ``node_targets`` then runs the steps:

    1. the key: everything the targets depend on (``targets_key``, resolved at the edge);
    2. this process's memory (``PREPARED``, least recently used first out);
    3. the node's disk (none in the per-batch mode, which keeps pooled rows);
    4. else prepared: pooled features (``teacher.py``: the teacher loads only on a feature-cache
       miss) -> basis -> fusion, kept in memory and on disk;
    5. the message's own: the server's anchors (``loss.tdcl-targets = "anchors"``) in place of the
       TDCL targets, or (``diffusion.condition = "global-model"``) conditioned on the received
       model, every round (``teacher.conditioned_reps``).

On disk, so that a new process (a deployment starts one per message) loads one small file
instead of re-reading and re-fusing every shard: ``<cache_dir>/targets/<key>.npz``, a verified
archive (``files.write_verified``, as the feature shards): ``header`` (format, version, key, n,
``members`` {name: [dtype, shape]}, sha256 over every other member in name order), ``ids``
(int64, in order), ``prompt_reps`` float32 (n, K, D) and/or ``ndcr`` float32 (n, D), and the
basis (``basis.*``, ``Basis.to_arrays``). A file that fails any check is logged, never used, and
rewritten.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path

import numpy as np
import torch

from feddifrc_app import log
from feddifrc_app.config import Config
from feddifrc_app.data.images import ImageData
from feddifrc_app.device import EXTRACTION_THREADS, torch_threads
from feddifrc_app.diffusion.cache import CacheStats
from feddifrc_app.files import (
    ArchiveKind,
    CorruptFile,
    array_digest,
    evict,
    read_verified,
    write_verified,
)
from feddifrc_app.methods.feddifrc.projection import (
    Basis,
    client_basis,
    client_stats,
    clip_widths,
    fuse,
    fuse_per_batch,
    prompt_sums,
    stats_to_arrays,
)
from feddifrc_app.methods.feddifrc.rules import self_supervised
from feddifrc_app.methods.feddifrc.teacher import (
    FeatureSet,
    TeacherSpec,
    conditioned_reps,
    feature_set,
    pooled_features,
    teacher_prompts,
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
            if t is not None and t.dim() == 3 and t.stride(0) == 0:  # anchored: one (K, D) block moves
                return t[0].to(device).expand_as(t)
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

    def anchored(self, anchors: torch.Tensor) -> TeacherTargets:
        """These targets with every image's TDCL representations replaced by the ``(K, D)``
        anchors (a broadcast view: no per-image copy); the NDCR target stays the image's own."""
        reps = self.prompt_reps
        if reps is None or self.per_batch is not None:
            raise ValueError("loss.tdcl-targets = 'anchors' needs static TDCL targets under a shared basis")
        if anchors.shape != reps.shape[1:]:
            raise ValueError(
                f"the server's anchors have shape {tuple(anchors.shape)}, this node's TDCL targets "
                f"(K, D) = {tuple(reps.shape[1:])}: the nodes run different prompts or widths"
            )
        view = anchors.to(reps.device, reps.dtype).expand(reps.shape[0], -1, -1)
        return TeacherTargets(rows=self.rows, prompt_reps=view, ndcr=self.ndcr)


def target_rows(ids: np.ndarray) -> torch.Tensor:
    """``TeacherTargets.rows``: dataset index -> row in the client's arrays (-1: not this client's)."""
    rows = torch.full((int(ids.max()) + 1,), -1, dtype=torch.int64)
    rows[torch.as_tensor(ids)] = torch.arange(len(ids))
    return rows


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True, eq=False)
class Plan:
    """One node's teacher targets, resolved once per process: the run config, the teacher's
    features of this node's data (spec, prompts, cache key), its image ids and how many prompts
    TDCL contrasts."""

    cfg: Config
    features: FeatureSet
    ids: np.ndarray  # int64 dataset indices
    num_prompts_tdcl: int

    def key(self, server_basis: Basis | None) -> str:
        """The key of this node's targets under ``server_basis`` (``targets_key``)."""
        return targets_key(self.cfg, self.features.key, self.ids, server_basis, self.num_prompts_tdcl)


# A simulation actor serves many nodes' messages of one run: each node's plan is resolved once.
_PLANS: OrderedDict[tuple, Plan] = OrderedDict()
_PLANS_KEPT = 8192


def plan(cfg: Config, spec: TeacherSpec, data: ImageData, ids: np.ndarray) -> Plan:
    """The node's ``Plan`` under ``spec`` (no teacher work: the feature-cache key only), kept for
    the process by the run config, the spec, the data's fingerprint and the ids."""
    ids = np.asarray(ids, dtype=np.int64)
    key = (cfg, spec, data.fingerprint, hashlib.sha256(ids.tobytes()).digest())
    if (hit := _PLANS.get(key)) is None:
        prompts = teacher_prompts(cfg, data.class_names)
        k = num_prompts_tdcl(cfg, data.num_classes, prompts)
        hit = _PLANS[key] = Plan(cfg, feature_set(spec, data, prompts), ids, k)
        while len(_PLANS) > _PLANS_KEPT:
            _PLANS.popitem(last=False)
    return hit


def num_prompts_tdcl(cfg: Config, num_classes: int, prompts: tuple[str, ...]) -> int:
    """How many of ``prompts`` TDCL contrasts (the rest: the NDCR prompt, last): every class
    prompt, or (self-supervised) the positive prompt and the negatives."""
    return len(prompts) - 1 if self_supervised(cfg) else num_classes


# --------------------------------------------------------------------------- the steps


def node_targets(
    p: Plan,
    key: str,
    server_basis: Basis | None,
    anchors: torch.Tensor | None,
    model: torch.nn.Module,
    device: torch.device,
) -> tuple[TeacherTargets, dict[str, float]]:
    """This node's targets under ``key`` (``targets_key``) in a train message (``client_targets``),
    then step 5, this message's own (never stored): with the server's ``anchors`` in place of the
    TDCL targets (``TeacherTargets.anchored``), or conditioned on the received ``model`` when
    ``diffusion.condition = "global-model"`` (the rules allow one of them at most); and their cost
    as reply metrics (``teacher-seconds``, ``teacher-cache-misses``, ``condition-seconds``)."""
    t0 = time.perf_counter()
    targets, basis, stats = client_targets(p, key, server_basis)
    metrics: dict[str, float] = {}
    if anchors is not None:
        targets = targets.anchored(anchors)
    if p.cfg.diffusion.condition == "global-model":
        t1 = time.perf_counter()  # not cacheable: it changes every round
        if targets.prompt_reps is not None:
            reps = conditioned_reps(p.features, p.ids, targets.prompt_reps, basis, model, device)
            targets = TeacherTargets(rows=targets.rows, prompt_reps=reps, ndcr=targets.ndcr)
        metrics["condition-seconds"] = time.perf_counter() - t1
    metrics["teacher-seconds"] = time.perf_counter() - t0
    metrics["teacher-cache-misses"] = float(stats.misses)
    return targets, metrics


def client_targets(
    p: Plan, key: str, server_basis: Basis | None
) -> tuple[TeacherTargets, Basis | None, CacheStats]:
    """A client's static targets under ``key`` (step 1, ``targets_key``), the basis they were
    fused with and their feature-cache cost (every image a hit unless prepared here): steps 2 to 4."""
    kept = p.cfg.diffusion.projection != "per-batch"  # per-batch: pooled rows, fused every batch
    path = p.features.spec.cache_dir / "targets" / f"{key}.npz" if kept else None
    hits = CacheStats(hits=int(np.unique(p.ids).size))
    # 2. this process's memory
    if (hit := PREPARED.get(key)) is not None:
        return *hit, hits
    # 3. the node's disk
    if path is not None and (stored := load_stored(path, key, p.ids)) is not None:
        PREPARED.put(key, stored)
        return *stored, hits
    # 4. prepared from the feature cache (the teacher only on a miss), kept in both
    pooled, stats = pooled_features(p.features, p.ids)
    with torch_threads(EXTRACTION_THREADS):  # stored targets serve runs of any train.threads
        targets, basis = build_targets(p, pooled, server_basis)
    PREPARED.put(key, (targets, basis))
    if path is not None and basis is not None:
        keep(path, key, p.ids, targets, basis)
    return targets, basis, stats


def build_targets(
    p: Plan, pooled: dict[int, np.ndarray], server_basis: Basis | None
) -> tuple[TeacherTargets, Basis | None]:
    """The client's basis (``projection.client_basis``) and its targets fused once with it (or
    pooled rows kept for the per-batch comparison mode, which has no basis)."""
    cfg, k = p.cfg, p.num_prompts_tdcl
    rows = target_rows(p.ids)
    basis = client_basis(cfg, pooled, server_basis)
    if cfg.diffusion.projection == "per-batch":
        widths = clip_widths(cfg.diffusion.channels, [pooled[b].shape[-1] for b in cfg.diffusion.blocks])
        per_batch = ({b: pooled[b] for b in cfg.diffusion.blocks}, widths, k)
        return TeacherTargets(rows=rows, prompt_reps=None, ndcr=None, per_batch=per_batch), basis
    fused = torch.from_numpy(fuse(pooled, basis))  # (n, P, D)
    reps = fused[:, :k].contiguous() if cfg.loss.tdcl_weight > 0 else None
    ndcr = fused[:, -1].contiguous() if cfg.loss.ndcr_weight > 0 else None
    return TeacherTargets(rows=rows, prompt_reps=reps, ndcr=ndcr), basis


def node_stats(p: Plan) -> tuple[dict[str, np.ndarray], CacheStats]:
    """What a node sends once for the federated basis: the sufficient statistics of its pooled
    teacher features (``projection.stats_to_arrays``; no raw feature leaves it; with the anchors,
    ``projection.prompt_sums`` too), and their cost."""
    pooled, stats = pooled_features(p.features, p.ids)
    arrays = stats_to_arrays(client_stats(pooled))
    if p.cfg.loss.tdcl_targets == "anchors":  # and the per-prompt sums of its class prompts
        arrays |= prompt_sums(pooled, p.num_prompts_tdcl)
    return arrays, stats


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


# --------------------------------------------------------------------------- memory and disk


class _Prepared:
    """A client's static targets, kept per process and keyed by everything they are computed from.

    A simulation actor serves the same partitions round after round; without this it re-read
    the client's cached features (at CIFAR-10 scale ~2.5 GB of shards) and fused them every
    round. Least recently used entries go first once ``budget`` bytes are held. A new process
    finds them on disk instead (``client_targets``, step 3).
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


def _digest(members: Mapping[str, np.ndarray]) -> str:
    return array_digest((f"|{k}|", members[k]) for k in sorted(members))


# the header lists every member as {name: [dtype str, shape]}
TARGETS = ArchiveKind(TARGETS_FORMAT, TARGETS_VERSION, members=itemgetter("members"), digest=_digest)


def save_prepared(path: Path, key: str, ids: np.ndarray, targets: TeacherTargets, basis: Basis) -> None:
    """Write a client's prepared targets to ``path`` atomically (readers see the old file or this one)."""
    members = _members(targets, ids, basis)
    listed = {k: [a.dtype.str, list(a.shape)] for k, a in sorted(members.items())}
    write_verified(path, TARGETS, key, members, {"n": int(len(ids)), "members": listed})


def load_prepared(path: Path, key: str, ids: np.ndarray) -> tuple[TeacherTargets, Basis]:
    """The targets ``save_prepared`` wrote for ``key`` and ``ids``; ``CorruptFile`` (the reason)
    unless every check holds, ``FileNotFoundError`` if there is none."""
    rows = target_rows(ids)
    header, members = read_verified(path, TARGETS, key)
    n = len(ids)
    if header.get("n") != n or not np.array_equal(members.get("ids"), ids):
        raise CorruptFile(f"prepared for other images (n = {header.get('n')}, this client has {n})")
    reps, ndcr = members.get("prompt_reps"), members.get("ndcr")
    if (reps is None and ndcr is None) or any(a is not None and a.shape[0] != n for a in (reps, ndcr)):
        raise CorruptFile("no targets, or not one row per image")
    try:
        basis = Basis.from_arrays(members)
    except ValueError as e:
        raise CorruptFile(f"basis: {e}") from None
    reps, ndcr = (None if a is None else torch.from_numpy(a) for a in (reps, ndcr))
    return TeacherTargets(rows=rows, prompt_reps=reps, ndcr=ndcr), basis


def keep(path: Path, key: str, ids: np.ndarray, targets: TeacherTargets, basis: Basis) -> None:
    """Step 4's disk copy: written, then the folder held to its budget; a failure is logged (the
    run does not need the file: the next process prepares them again)."""
    try:
        save_prepared(path, key, ids, targets, basis)
        evict(path.parent, path, TARGETS_DISK_BUDGET, "prepared targets")
    except OSError as e:
        log.warning(
            "prepared targets: could not write %s (%s); a new process will prepare them again", path, e
        )


def load_stored(path: Path, key: str, ids: np.ndarray) -> tuple[TeacherTargets, Basis] | None:
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


# --------------------------------------------------------------------------- conditioning


# What a VAE latent depends on -> {image id: latent (C, h, w)}: ~12 KB per image at 224 px.
