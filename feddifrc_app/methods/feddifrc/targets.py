"""The frozen diffusion targets one client trains against, in numbered steps.

Pipeline for a client's images ``ids`` (dataset indices)::

    pooled per-block teacher features  {block: (n, P, C_b)}   <- feature cache (extract on a miss)
    shared basis (federated PCA from the server / local PCA / random)
    fused = fuse(pooled, basis)        (n, P, D)    D = the classifier embedding width
    TDCL reps = fused[:, :K]           (n, K, D)    the image under each class prompt
    NDCR target = fused[:, -1]         (n, D)       the image under the NDCR prompt

Prompts are ordered: the K class prompts in LABEL order, then the NDCR prompt
(self-supervised: the positive prompt, the negatives, then the NDCR prompt).
The pooled features come through ``teacher.py`` (the teacher is loaded lazily, only when the
cache misses, so a warm cache means no Stable Diffusion load at all). FedDifRC's node half
(``node.py``) makes one call here per train message, ``node_targets`` of its ``Plan``, which
reads through ``store`` (this process's memory, the node's disk) before preparing anything.
The per-batch comparison mode keeps pooled rows (the shards themselves): nothing is stored.
Checks on the message (a federated basis present) are done once, at the edge: ``node.py``.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from feddifrc_app.config import Config
from feddifrc_app.data.images import ImageData
from feddifrc_app.data.transforms import eval_transform
from feddifrc_app.device import EXTRACTION_THREADS, torch_threads
from feddifrc_app.diffusion.cache import CacheStats
from feddifrc_app.diffusion.featurizer import Featurizer
from feddifrc_app.methods.feddifrc import store
from feddifrc_app.methods.feddifrc.projection import (
    Basis,
    client_stats,
    clip_widths,
    fuse,
    fused_widths,
    local_pca_basis,
    prompt_sums,
    random_basis,
    stats_to_arrays,
)
from feddifrc_app.methods.feddifrc.rules import self_supervised
from feddifrc_app.methods.feddifrc.store import TeacherTargets, target_rows
from feddifrc_app.methods.feddifrc.teacher import (
    FeatureSet,
    TeacherSpec,
    feature_set,
    featurizer,
    pooled_features,
    teacher_prompts,
)


@dataclass(frozen=True, eq=False)
class Plan:
    """One node's teacher targets, resolved once per process: the run config, the teacher's
    features of this node's data (spec, prompts, cache key), its image ids and how many prompts
    TDCL contrasts."""

    cfg: Config
    features: FeatureSet
    ids: np.ndarray  # int64 dataset indices
    num_prompts_tdcl: int


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


def node_targets(
    p: Plan, server_basis: Basis | None, model: torch.nn.Module, device: torch.device
) -> tuple[TeacherTargets, dict[str, float]]:
    """This node's targets in a train message (``client_targets``, then conditioned on the received
    ``model`` when ``diffusion.condition = "global-model"``: every round, never stored), and their
    cost as reply metrics (``teacher-seconds``, ``teacher-cache-misses``, ``condition-seconds``)."""
    t0 = time.perf_counter()
    targets, basis, stats = client_targets(p, server_basis)
    metrics: dict[str, float] = {}
    if p.cfg.diffusion.condition == "global-model":
        targets, metrics["condition-seconds"] = conditioned_targets(p, targets, basis, model, device)
    metrics["teacher-seconds"] = time.perf_counter() - t0
    metrics["teacher-cache-misses"] = float(stats.misses)
    return targets, metrics


def client_targets(p: Plan, server_basis: Basis | None) -> tuple[TeacherTargets, Basis | None, CacheStats]:
    """A client's static targets, the basis they were fused with and their feature-cache cost:

    1. the key: everything the targets depend on (``store.targets_key``);
    2. read through the store: this process's memory, else the node's disk (none in the
       per-batch mode), else
    3. ``prepare`` them (pooled features, basis, fusion), kept in both.
    """
    key = store.targets_key(p.cfg, p.features.key, p.ids, server_basis, p.num_prompts_tdcl)
    kept = p.cfg.diffusion.projection != "per-batch"  # per-batch: pooled rows, fused every batch
    path = p.features.spec.cache_dir / "targets" / f"{key}.npz" if kept else None
    return store.read_through(key, path, p.ids, lambda: prepare(p, server_basis))


def prepare(p: Plan, server_basis: Basis | None) -> tuple[TeacherTargets, Basis | None, CacheStats]:
    """A client's static targets from the feature cache (the teacher only on a miss): its pooled
    features, the basis it projects with, the fused targets; with the feature-cache cost."""
    pooled, stats = pooled_features(p.features, p.ids)
    with torch_threads(EXTRACTION_THREADS):  # stored targets serve runs of any train.threads
        basis = client_basis(p.cfg, pooled, server_basis)
        return build_targets(p, pooled, basis), basis, stats


def client_basis(cfg: Config, pooled: dict[int, np.ndarray], server_basis: Basis | None) -> Basis | None:
    """The basis this client projects with (the server's under ``federated-pca``, which the node
    half requires of the message); None for the public code's per-batch refit."""
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


def build_targets(p: Plan, pooled: dict[int, np.ndarray], basis: Basis | None) -> TeacherTargets:
    """Fuse once with the shared basis (or keep pooled rows for the per-batch comparison mode)."""
    cfg, k = p.cfg, p.num_prompts_tdcl
    rows = target_rows(p.ids)
    if cfg.diffusion.projection == "per-batch":
        widths = clip_widths(cfg.diffusion.channels, [pooled[b].shape[-1] for b in cfg.diffusion.blocks])
        return TeacherTargets(
            rows=rows,
            prompt_reps=None,
            ndcr=None,
            per_batch=({b: pooled[b] for b in cfg.diffusion.blocks}, widths, k),
        )
    fused = torch.from_numpy(fuse(pooled, basis))  # (n, P, D)
    reps = fused[:, :k].contiguous() if cfg.loss.tdcl_weight > 0 else None
    ndcr = fused[:, -1].contiguous() if cfg.loss.ndcr_weight > 0 else None
    return TeacherTargets(rows=rows, prompt_reps=reps, ndcr=ndcr)


def node_stats(p: Plan) -> tuple[dict[str, np.ndarray], CacheStats]:
    """What a node sends once for the federated basis: the sufficient statistics of its pooled
    teacher features (``projection.stats_to_arrays``; no raw feature leaves it; with the anchors,
    ``projection.prompt_sums`` too), and their cost."""
    pooled, stats = pooled_features(p.features, p.ids)
    arrays = stats_to_arrays(client_stats(pooled))
    if p.cfg.loss.tdcl_targets == "anchors":  # and the per-prompt sums of its class prompts
        arrays |= prompt_sums(pooled, p.num_prompts_tdcl)
    return arrays, stats


def anchored(targets: TeacherTargets, anchors: torch.Tensor) -> TeacherTargets:
    """``targets`` with every image's TDCL representations replaced by the ``(K, D)`` anchors
    (a broadcast view: no per-image copy); the NDCR target stays the image's own."""
    reps = targets.prompt_reps
    if reps is None or targets.per_batch is not None:
        raise ValueError("loss.tdcl-targets = 'anchors' needs static TDCL targets under a shared basis")
    if anchors.shape != reps.shape[1:]:
        raise ValueError(
            f"the server's anchors have shape {tuple(anchors.shape)}, this node's TDCL targets "
            f"(K, D) = {tuple(reps.shape[1:])}: the nodes run different prompts or widths"
        )
    view = anchors.to(reps.device, reps.dtype).expand(reps.shape[0], -1, -1)
    return TeacherTargets(rows=targets.rows, prompt_reps=view, ndcr=targets.ndcr)


# What a VAE latent depends on -> {image id: latent (C, h, w)}: ~12 KB per image at 224 px.
_LATENTS: dict[tuple, dict[int, torch.Tensor]] = {}


def _latent_key(feat: Featurizer, data: ImageData) -> tuple:
    t = feat.teacher
    return (t.weights_hash, str(t.device), str(t.dtype), feat.resolution, data.fingerprint)


def _offset_map(feat: Featurizer, spec: TeacherSpec, dim: int, class_prompts: tuple[str, ...]):
    """(the FIXED seeded Gaussian projection (D, D_text), the mean norm of the prompt tokens)."""
    gen = torch.Generator().manual_seed(spec.seed + 0xC0D1)
    proj = torch.randn(dim, feat.teacher.text_width, generator=gen) / dim**0.5  # (D, D_text)
    token_norm = float(feat.prompt_embeddings(class_prompts).float().norm(dim=-1).mean())
    return proj, token_norm


def conditioned_targets(
    p: Plan, targets: TeacherTargets, basis: Basis | None, model: torch.nn.Module, device: torch.device
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
    spec, data, ids = p.features.spec, p.features.data, p.ids
    feat = featurizer(spec)
    k = targets.prompt_reps.shape[1] if targets.prompt_reps is not None else 0
    if k == 0:
        return targets, 0.0
    class_prompts = p.features.prompts[:k]
    feat.encode_then_release(class_prompts)  # the rounds need no text encoder after this
    # D: the fused width is the student's embedding width
    proj, token_norm = _offset_map(feat, spec, int(targets.prompt_reps.shape[-1]), class_prompts)
    model.to(device).eval()
    reps = []
    tf = eval_transform(data)
    # The images are the same every round: their VAE latents are encoded once per process.
    memo = _LATENTS.setdefault(_latent_key(feat, data), {})
    for s in range(0, len(ids), spec.batch_size):
        chunk = np.asarray(ids[s : s + spec.batch_size])
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
