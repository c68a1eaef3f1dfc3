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
cache misses, so a warm cache means no Stable Diffusion load at all). FedDifRC's node half
(``node.py``) makes one call here per train message: ``node_targets`` of a ``Plan``.

A client's fused targets are prepared once (``client_targets``) and kept by ``store``.
The per-batch comparison mode keeps pooled rows (the shards themselves): nothing is stored.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from feddifrc_app import log
from feddifrc_app.config import Config
from feddifrc_app.data.images import ImageData
from feddifrc_app.data.transforms import eval_transform
from feddifrc_app.device import EXTRACTION_THREADS, torch_threads
from feddifrc_app.diffusion.cache import CacheStats
from feddifrc_app.diffusion.featurizer import Featurizer
from feddifrc_app.methods.feddifrc.anchors import prompt_sums
from feddifrc_app.methods.feddifrc.fused import TeacherTargets, target_rows
from feddifrc_app.methods.feddifrc.projection import (
    Basis,
    client_stats,
    clip_widths,
    fuse,
    fused_widths,
    local_pca_basis,
    random_basis,
    stats_to_arrays,
)
from feddifrc_app.methods.feddifrc.prompts import teacher_prompts
from feddifrc_app.methods.feddifrc.rules import self_supervised
from feddifrc_app.methods.feddifrc.store import (
    PREPARED,
    TARGETS_DISK_BUDGET,
    evict,
    load_stored,
    save_prepared,
    targets_key,
)
from feddifrc_app.methods.feddifrc.teacher import (
    FeatureSet,
    TeacherSpec,
    feature_set,
    featurizer,
    pooled_features,
)


@dataclass(frozen=True, eq=False)
class Plan:
    """One node's teacher targets, resolved once: the run config, the teacher's features of this
    node's data (spec, prompts, cache key), its image ids and how many prompts TDCL contrasts."""

    cfg: Config
    features: FeatureSet
    ids: np.ndarray  # int64 dataset indices
    num_prompts_tdcl: int


def plan(cfg: Config, spec: TeacherSpec, data: ImageData, ids: np.ndarray) -> Plan:
    """The node's ``Plan`` under ``spec`` (no teacher work: the feature-cache key only)."""
    prompts = teacher_prompts(cfg, data.class_names)
    k = num_prompts_tdcl(cfg, data.num_classes, prompts)
    return Plan(cfg, feature_set(spec, data, prompts), np.asarray(ids, dtype=np.int64), k)


def require_basis(cfg: Config, server_basis: Basis | None) -> None:
    """Under ``federated-pca`` the targets need the server's basis (the train message's)."""
    if cfg.diffusion.projection == "federated-pca" and server_basis is None:
        raise ValueError("diffusion.projection = 'federated-pca' but the server sent no basis")


def client_basis(cfg: Config, pooled: dict[int, np.ndarray], server_basis: Basis | None) -> Basis | None:
    """The basis this client projects with; None for the public code's per-batch refit."""
    d = cfg.diffusion
    chans = [pooled[b].shape[-1] for b in d.blocks]
    widths = fused_widths(d.channels, chans, cfg.embedding_dim)
    require_basis(cfg, server_basis)
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
    if basis is None:
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


def client_targets(p: Plan, server_basis: Basis | None) -> tuple[TeacherTargets, Basis | None, CacheStats]:
    """A client's static targets and the basis they were fused with: from this process's memory,
    else from ``<cache_dir>/targets/``, else prepared (cache read, basis, fusion) and stored in both."""
    cfg, ids = p.cfg, p.ids
    key = targets_key(cfg, p.features.key, ids, server_basis, p.num_prompts_tdcl)
    if (hit := PREPARED.get(key)) is not None:
        return *hit, CacheStats(hits=int(np.unique(ids).size))
    path = p.features.spec.cache_dir / "targets" / f"{key}.npz"
    if cfg.diffusion.projection != "per-batch" and (stored := load_stored(path, key, ids)) is not None:
        PREPARED.put(key, stored)
        return *stored, CacheStats(hits=int(np.unique(ids).size))
    pooled, stats = pooled_features(p.features, ids)
    with torch_threads(EXTRACTION_THREADS):  # stored targets serve runs of any train.threads
        basis = client_basis(cfg, pooled, server_basis)
        targets = build_targets(p, pooled, basis)
    PREPARED.put(key, (targets, basis))
    if basis is not None:
        try:
            save_prepared(path, key, ids, targets, basis)
            evict(path.parent, path, TARGETS_DISK_BUDGET)
        except OSError as e:  # the run does not need the file: the next process prepares them again
            log.warning(
                "prepared targets: could not write %s (%s); a new process will prepare them again", path, e
            )
    return targets, basis, stats


def node_stats(p: Plan) -> tuple[dict[str, np.ndarray], CacheStats]:
    """What a node sends once for the federated basis: the sufficient statistics of its pooled
    teacher features (``projection.stats_to_arrays``; no raw feature leaves it; with the anchors,
    ``anchors.prompt_sums`` too), and their cost."""
    pooled, stats = pooled_features(p.features, p.ids)
    arrays = stats_to_arrays(client_stats(pooled))
    if p.cfg.loss.tdcl_targets == "anchors":  # and the per-prompt sums of its class prompts
        arrays |= prompt_sums(pooled, p.num_prompts_tdcl)
    return arrays, stats


def num_prompts_tdcl(cfg: Config, num_classes: int, prompts: tuple[str, ...]) -> int:
    """How many of ``prompts`` TDCL contrasts (the rest: the NDCR prompt, last): every class
    prompt, or (self-supervised) the positive prompt and the negatives."""
    return len(prompts) - 1 if self_supervised(cfg) else num_classes


def node_targets(
    p: Plan, server_basis: Basis | None, model: torch.nn.Module, device: torch.device
) -> tuple[TeacherTargets, dict[str, float]]:
    """This node's targets in a train message under the server's basis (cached features, no SD
    call on a hit), conditioned on the received ``model`` when ``diffusion.condition =
    "global-model"``, and their cost as reply metrics (``teacher-seconds``,
    ``teacher-cache-misses``, ``condition-seconds``)."""
    t0 = time.perf_counter()
    targets, basis, stats = client_targets(p, server_basis)
    metrics: dict[str, float] = {}
    if p.cfg.diffusion.condition == "global-model":
        targets, metrics["condition-seconds"] = conditioned_targets(p, targets, basis, model, device)
    metrics["teacher-seconds"] = time.perf_counter() - t0
    metrics["teacher-cache-misses"] = float(stats.misses)
    return targets, metrics


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
