"""The one door to the frozen teacher's features: its specification, resolved once, and the
cached pooled features of a dataset under a prompt list.

``teacher_spec(cfg, cache_dir)`` reads the run config once per process: the weights' identity
(no network is built for it), the device and dtype the teacher computes in, and every ``diffusion.*`` key a
feature depends on. Everything below takes the spec, never the run config::

    spec = teacher_spec(cfg, cache_dir)            # TeacherSpec: frozen, hashable
    prompts = teacher_prompts(cfg, class_names)    # their order is part of the feature-cache key
    features = feature_set(spec, data, prompts)    # FeatureSet: + the feature-cache key
    pooled, stats = pooled_features(features, ids) # {block: (n, P, C_b)} from the cache
    reps = conditioned_reps(features, ids, ...)    # (n, k, D): TDCL's, with the received model

The teacher itself is built only when some id misses the cache (``featurizer(spec)``, once
per process per spec): a warm cache never loads Stable Diffusion. Its text encoders are
released as soon as the prompt list is encoded (``Featurizer.encode_then_release``): only the
denoiser and the VAE stay resident during the extraction. After a cold extraction the teacher
is released (its GPU memory returned) unless ``diffusion.condition = "global-model"``, which
needs it every round (``TeacherSpec.resident``, ``conditioned_reps``).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from feddifrc_app import log
from feddifrc_app.config import Config
from feddifrc_app.data.images import ImageData
from feddifrc_app.data.transforms import eval_transform
from feddifrc_app.device import EXTRACTION_THREADS, resolve_device, resolve_dtype, torch_threads
from feddifrc_app.diffusion.cache import CacheStats, LazyExtractor, cached_pooled_features
from feddifrc_app.diffusion.dit_features import check_mode
from feddifrc_app.diffusion.family import (
    check_maps,
    family_module,
    has_mid_block,
    layer_count,
    vae_dtype,
)
from feddifrc_app.diffusion.featurizer import Featurizer, check_layers
from feddifrc_app.diffusion.pipeline import (
    TeacherIdentity,
    load_teacher,
    release_teacher,
    teacher_identity,
    teacher_resolution,
)
from feddifrc_app.diffusion.shards import FeatureStore, key_fields, key_from_fields
from feddifrc_app.methods.feddifrc.projection import Basis, fuse
from feddifrc_app.methods.feddifrc.rules import DiffusionConfig, self_supervised


@dataclass(frozen=True)
class TeacherSpec:
    """Which teacher, where it runs, and how its features are taken (``diffusion.*``, ``seed``)."""

    model: str  # diffusion.model as configured
    cache_dir: Path  # the node's teacher cache folder (features, tiny models, digests)
    identity: TeacherIdentity  # the weights' sha256, resolved without building a network
    device: torch.device
    dtype: torch.dtype  # the denoiser's; "auto" resolved per family
    resolution: int
    timestep: int
    blocks: tuple[int, ...]
    ensemble: int
    seed: int  # of the noise draws: diffusion.noise-seed, or the run seed where that is -1
    batch_size: int  # images per UNet call (every call padded to it): the speed, and the features' last bits
    resident: bool = False  # keep the teacher loaded after a cold extraction (condition = "global-model")
    pool_grid: int = 0  # diffusion.pooling: 0 = the mean over each map, g = a g x g grid of means
    dit_features: str = "raw"  # diffusion.dit-features (dit_features.py)

    @functools.cached_property
    def vae_dtype(self) -> torch.dtype:
        """The VAE's dtype: float32 for SDXL under float16 (``family.vae_dtype``), else ``dtype``
        (read from the folder once per spec)."""
        return vae_dtype(self.identity.folder, self.identity.family, self.dtype)

    @property
    def where(self) -> str:
        """``"cuda float16"``: the device type and the dtype(s) in the feature key."""
        name = lambda d: str(d).removeprefix("torch.")  # noqa: E731
        vae = "" if self.vae_dtype == self.dtype else f" (vae {name(self.vae_dtype)})"
        return f"{self.device.type} {name(self.dtype)}{vae}"


def teacher_spec(cfg: Config, cache_dir: Path) -> TeacherSpec:
    """The run's teacher. A missing device fails before the weights are looked up (or
    downloaded), and a ``diffusion.blocks`` index the model does not have fails before any
    network is built (``family.FamilyError``, naming the valid range). The weights' identity is
    looked up on every call (``pipeline.teacher_identity`` keeps it per process and looks again
    when the folder was rebuilt); the rest, which reads the model's config files, is resolved
    once per process per (``diffusion.*``, noise seed, cache folder, identity): a simulation actor or
    a long-lived node handles many messages. A failure is not kept."""
    d = cfg.diffusion
    device = resolve_device(d.device, "diffusion.device")
    resolve_dtype(d.dtype, device, "diffusion.dtype")  # a refused dtype fails before the weights are found
    identity = teacher_identity(d.model, cache_dir)
    noise_seed = cfg.seed if d.noise_seed < 0 else d.noise_seed  # diffusion.noise-seed = -1: the run's
    return _resolved(d, noise_seed, Path(cache_dir), Path(cache_dir).resolve(), identity, device)


@functools.lru_cache(maxsize=16)
def _resolved(
    d: DiffusionConfig,
    seed: int,
    cache_dir: Path,
    where: Path,
    identity: TeacherIdentity,
    device: torch.device,
) -> TeacherSpec:
    """``teacher_spec`` past the identity; ``where`` (the resolved cache folder) only keys the memo."""
    family = identity.family
    check_folder(d, identity)
    dtype = resolve_dtype(d.dtype, device, "diffusion.dtype", prefer_bf16=family_module(family).AUTO_BF16)
    return TeacherSpec(
        model=d.model,
        cache_dir=Path(cache_dir),
        identity=identity,
        device=device,
        dtype=dtype,
        resolution=d.resolution,
        timestep=d.timestep,
        blocks=d.blocks,
        ensemble=d.ensemble,
        seed=seed,
        batch_size=d.batch_size,
        resident=d.condition == "global-model",
        pool_grid=d.pool_grid if d.pooling == "grid" else 0,
        dit_features=d.dit_features,
    )


def check_folder(d: DiffusionConfig, identity: TeacherIdentity) -> None:
    """The ``diffusion.*`` keys the teacher's folder decides, from its config files alone (no
    network, no device): the layers (``diffusion.blocks``), the reading (``diffusion.dit-features``),
    the input size and grid (``diffusion.resolution``, ``diffusion.pool-grid``): a FamilyError
    naming the key. ``teacher_spec`` and ``feddifrc fetch`` run it."""
    folder, family = identity.folder, identity.family
    mid = has_mid_block(folder, family)
    check_layers(d.blocks, layer_count(folder, family), family, family_module(family), mid=mid)
    check_mode(d.dit_features, family, family_module(family))
    check_maps(folder, family, d.blocks, d.resolution, d.pool_grid if d.pooling == "grid" else 0)


def teacher_prompts(
    cfg: Config, class_names: Sequence[str], negative_pool: Sequence[str] | None = None
) -> tuple[str, ...]:
    """The prompt list of the run's method; the NDCR prompt is always LAST.

    - ``feddifrc`` (and ``fedavg``): ``prompt_template.format(name)`` for every class in LABEL
      order (prompt y is the TDCL positive of a sample with label y, the others its
      negatives), then ``diffusion.ndcr_prompt`` ("" = unconditional).
    - ``feddifrc-ssl`` (``self_supervised(cfg)``): ``ssl.positive_prompt``, then the template
      over ``ssl.negatives`` or, when that is empty, over ``ssl.num_negatives`` names drawn
      without replacement by ``numpy.random.default_rng(cfg.seed)`` from ``negative_pool`` (default: the 200
      Tiny-ImageNet class names) and kept in pool order, then ``ssl.ndcr_prompt``.
    """
    d = cfg.diffusion
    if self_supervised(cfg):
        negatives = tuple(cfg.ssl.negatives)
        if not negatives:
            if negative_pool is None:
                from feddifrc_app.data.tiny_imagenet_names import TINY_IMAGENET_CLASS_NAMES as negative_pool
            pool = tuple(negative_pool)
            if not pool:
                raise ValueError("teacher_prompts: empty negative_pool for method 'feddifrc-ssl'")
            rng = np.random.default_rng(int(cfg.seed))
            pick = rng.choice(len(pool), size=min(int(cfg.ssl.num_negatives), len(pool)), replace=False)
            negatives = tuple(pool[i] for i in sorted(pick))
        return (
            cfg.ssl.positive_prompt,
            *(d.prompt_template.format(n) for n in negatives),
            cfg.ssl.ndcr_prompt,
        )
    if not class_names:
        raise ValueError("teacher_prompts: no class names")
    return (*(d.prompt_template.format(c) for c in class_names), d.ndcr_prompt)


@dataclass(frozen=True, eq=False)
class FeatureSet:
    """The teacher's features of one dataset under one prompt list, and their cache key."""

    spec: TeacherSpec
    data: ImageData
    prompts: tuple[str, ...]
    key: str  # sha256 of ``fields``: names the folder under <cache_dir>/features
    fields: dict[str, Any]  # everything that changes the numbers (weights, dtype, prompts, data, ...)


def feature_set(spec: TeacherSpec, data: ImageData, prompts: tuple[str, ...]) -> FeatureSet:
    """``data`` under ``prompts`` with its feature-cache key, WITHOUT loading the teacher."""
    fields = key_fields(
        weights_hash=spec.identity.weights_hash,
        resolution=spec.resolution,
        timestep=spec.timestep,
        blocks=spec.blocks,
        prompts=prompts,
        seed=spec.seed,
        ensemble=spec.ensemble,
        dataset_fingerprint=data.fingerprint,
        dtype=str(spec.dtype),
        vae_dtype=str(spec.vae_dtype),
        family=spec.identity.family,
        pool_grid=spec.pool_grid,
        dit_features=spec.dit_features,
        batch_size=spec.batch_size,
    )
    return FeatureSet(spec, data, tuple(prompts), key_from_fields(fields), fields)


_FEATURIZERS: dict[TeacherSpec, Featurizer] = {}


def _featurizer(spec: TeacherSpec) -> Featurizer:
    trained_at = teacher_resolution(spec.model, spec.cache_dir)  # from the folder's marker
    t0 = time.perf_counter()
    teacher = load_teacher(spec.model, spec.cache_dir, spec.device, spec.dtype)
    log.info(
        "loaded diffusion teacher %s on %s in %.1fs%s",
        teacher.model_id,
        spec.device,
        time.perf_counter() - t0,
        " (RANDOM weights)" if teacher.random_weights else "",
    )
    if trained_at is not None and trained_at != spec.resolution:
        log.warning(
            "diffusion teacher %s was trained at %d px but diffusion.resolution = %d: its features at "
            "this size are out of its training distribution",
            teacher.model_id,
            trained_at,
            spec.resolution,
        )
    return Featurizer(
        teacher,
        resolution=spec.resolution,
        timestep=spec.timestep,
        blocks=spec.blocks,
        ensemble=spec.ensemble,
        seed=spec.seed,
        pool_grid=spec.pool_grid,
        dit_features=spec.dit_features,
    )


def featurizer(spec: TeacherSpec) -> Featurizer:
    """The frozen teacher + featurizer of ``spec``, loaded once per process until ``release``
    (the batch size and residency, which change no feature, do not make another one)."""
    key = _one_per_teacher(spec)
    if (hit := _FEATURIZERS.get(key)) is None:
        hit = _FEATURIZERS[key] = _featurizer(key)
        _BUILT[0] += 1
    return hit


def release(spec: TeacherSpec) -> None:
    """Drop this process's featurizer and teacher of ``spec``: once nothing else holds them, their
    (GPU) memory is free; a later ``featurizer(spec)`` loads them again."""
    _FEATURIZERS.pop(_one_per_teacher(spec), None)
    release_teacher(spec.model, spec.cache_dir, spec.device, spec.dtype)


def loaded() -> int:
    """How many featurizers (teachers) this process holds now (for logs and tests)."""
    return len(_FEATURIZERS)


def built() -> int:
    """How many featurizers (teacher loads) this process has built so far (for logs and tests)."""
    return _BUILT[0]


_BUILT = [0]


def _one_per_teacher(spec: TeacherSpec) -> TeacherSpec:
    return replace(spec, batch_size=0, resident=False)


@contextlib.contextmanager
def _lent(features: FeatureSet) -> Iterator[Callable[[], Callable[..., Any]]]:
    """The teacher for one extraction, whole: ``make()`` builds it on the first miss (its text
    encoders go once the fixed prompts are encoded, ``pipeline.py``); after a cold extraction it is
    released (as ``release``) unless ``spec.resident``, and torch's allocator cache emptied."""
    spec, made = features.spec, []

    def make():
        f = featurizer(spec)
        f.encode_then_release(features.prompts)
        made.append(f)
        return lambda images, sub, p: f(images, torch.as_tensor(sub, dtype=torch.int64), p)

    yield make
    cold = bool(made)
    made.clear()  # the memo must be the featurizer's only holder when it is released
    if cold and not spec.resident:  # the rounds read the cache; only global-model conditioning needs it
        _FEATURIZERS.pop(replace(spec, batch_size=0, resident=False), None)
        release_teacher(spec.model, spec.cache_dir, spec.device, spec.dtype)
    if cold and torch.cuda.is_available():
        # The extraction's activations (B x P UNet rows at 224 px) stay in torch's allocator cache otherwise.
        torch.cuda.empty_cache()


def pooled_features(
    features: FeatureSet,
    ids: np.ndarray,
    *,
    keep: bool = True,
    progress: bool = False,
    chunk: int = 256,
) -> tuple[dict[int, np.ndarray], CacheStats]:
    """Pooled per-block features ``{block: (len(ids), P, C_b)}`` from the cache, extracting on a miss.

    The teacher is built only when some id misses (``LazyExtractor``): a warm cache never loads SD.
    After such a cold extraction it is released unless ``spec.resident`` (``_lent``): a later miss
    (another node this process serves) loads it again. ``keep=False`` only fills the cache
    (``feddifrc extract``).
    """
    spec, data = features.spec, features.data
    with _lent(features) as make:
        store = FeatureStore(spec.cache_dir / "features")
        store.describe(features.key, features.fields)
        extractor = LazyExtractor(
            make, lambda sub: data.images[torch.as_tensor(sub)], features.prompts, spec.batch_size
        )
        # At a fixed thread count, whatever the process's: a cache filled by any run (or `feddifrc
        # extract`) holds the bits a cold run of any layout computes and trains on.
        with torch_threads(EXTRACTION_THREADS):
            out = cached_pooled_features(
                store,
                features.key,
                np.asarray(ids),
                extractor,
                keep=keep,
                progress=progress,
                chunk=chunk,
                desc=f"{data.name}/{data.split} teacher features",
            )
        del extractor  # it holds the featurizer too
    return out


# --------------------------------------------------------------------------- conditioned on the model

# The images are the same every round: their VAE latents are encoded once per process.
_LATENTS: dict[tuple, dict[int, torch.Tensor]] = {}


def _latent_key(spec: TeacherSpec, data: ImageData) -> tuple:
    return (spec.identity.weights_hash, str(spec.device), str(spec.dtype), spec.resolution, data.fingerprint)


def conditioned_reps(
    features: FeatureSet,
    ids: np.ndarray,
    prompt_reps: torch.Tensor,
    basis: Basis | None,
    model: torch.nn.Module,
    device: torch.device,
) -> torch.Tensor:
    """``diffusion.condition = "global-model"``: our reading of FedDifRC's model-conditioned
    c_i = h(x_i). The TDCL representations ``prompt_reps`` (n, k, D) of the images ``ids``,
    recomputed with the received ``model``: each image's (un-augmented) embedding, mapped to the
    text width by a FIXED seeded Gaussian projection and rescaled to the mean norm of the prompt
    token embeddings, is added to every token of its k class prompts; fused with ``basis``.
    """
    k, dim = int(prompt_reps.shape[1]), int(prompt_reps.shape[-1])
    if k == 0:
        return prompt_reps
    spec, data = features.spec, features.data
    memo = _LATENTS.setdefault(_latent_key(spec, data), {})
    feat, class_prompts = featurizer(spec), features.prompts[:k]
    feat.encode_then_release(class_prompts)  # the rounds need no text encoder after this
    gen = torch.Generator().manual_seed(spec.seed + 0xC0D1)
    proj = torch.randn(dim, feat.teacher.text_width, generator=gen) / dim**0.5  # (D, D_text)
    token_norm = float(feat.prompt_embeddings(class_prompts).float().norm(dim=-1).mean())
    model.to(device).eval()
    reps, tf = [], eval_transform(data)
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
    return torch.from_numpy(np.concatenate(reps))
