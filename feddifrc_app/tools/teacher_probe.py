"""Which layers and timestep for this teacher? (``feddifrc probe-teacher``; no Flower.)

For every candidate layer (the UNet's ``up_blocks`` and its mid-block ``-1``, a DiT's
``transformer_blocks``), each probed timestep and pooling, the teacher's features of labelled
images under the run's prompts (the K class prompts in label order, then the NDCR prompt),
through the app's feature cache, scored one layer at a time in its own space (pooled features,
unit-normalised):

- **NDCR**: what NDCR's targets separate in NDCR's geometry (unit vectors of centred features,
  no rescaling): k-fold nearest-class-centroid accuracy (cosine order) and an unscaled logistic
  probe of the NDCR-prompt features (``ndcr_geometry``);
- **TDCL**: the lowest held-out TDCL loss (the paper's, at ``loss.temperature``) that a linear
  student on the pixels reaches against the class-prompt features (``student_tdcl``; chance
  ln K): how much of TDCL's target structure the images predict;
- **prompt effect**: mean 1 - cos between one image's features under two class prompts
  (``prompt_effect``; 0 = the prompt changes nothing).

Recommendation (``recommend``): the pooling and timestep whose best ``len(diffusion.blocks)``
layers have the highest mean NDCR nearest-centroid accuracy, and those layers. TDCL and the
prompt effect are printed beside it, not used. The split is train or val, never test (the split
a benchmark reports).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from feddifrc_app.config import Config
from feddifrc_app.data.images import ImageData
from feddifrc_app.device import torch_threads
from feddifrc_app.diffusion.family import MID_BLOCK, has_mid_block, layer_count, map_sides
from feddifrc_app.diffusion.pipeline import teacher_identity
from feddifrc_app.methods.feddifrc.losses import tdcl_paper
from feddifrc_app.methods.feddifrc.teacher import (
    feature_set,
    pooled_features,
    release,
    teacher_prompts,
    teacher_spec,
)

PROBE_SPLITS = ("train", "val")  # never test: it is what the benchmarks report


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True).clip(1e-12)


def ndcr_geometry(x: np.ndarray, y: np.ndarray, folds: int) -> tuple[float, float]:
    """(nearest-class-centroid accuracy, unscaled linear-probe accuracy) of unit vectors ``x`` (N, D),
    k-fold: what the cosine geometry NDCR trains in separates, with no per-feature rescaling."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold, cross_val_score
    from sklearn.neighbors import NearestCentroid

    u, cv = unit(x), StratifiedKFold(folds, shuffle=True, random_state=0)
    ncc = cross_val_score(NearestCentroid(metric="euclidean"), u, y, cv=cv).mean()  # unit: cos order
    lin = cross_val_score(LogisticRegression(C=1.0, max_iter=500), u, y, cv=cv).mean()
    return float(ncc), float(lin)


def prompt_effect(reps: np.ndarray) -> float:
    """Mean 1 - cos over ordered pairs of distinct class prompts of the same image. reps: (N, K, D)."""
    u = unit(reps)
    cos = np.einsum("nkd,nld->nkl", u, u)
    off = ~np.eye(reps.shape[1], dtype=bool)
    return float((1.0 - cos[:, off]).mean())


def student_tdcl(
    pixels: np.ndarray, reps: np.ndarray, y: np.ndarray, folds: int, temperature: float, steps: int = 400
) -> float:
    """Held-out TDCL loss of a linear pixel -> D student trained on TDCL alone, mean over folds."""
    from sklearn.model_selection import StratifiedKFold

    x = torch.from_numpy(pixels).float()
    x = (x - x.mean(0)) / x.std(0).clamp_min(1e-6)
    r, labels = torch.from_numpy(reps).float(), torch.from_numpy(y).long()
    out = []
    with torch_threads(1):  # matrices this small: more threads cost more than they save
        for tr, te in StratifiedKFold(folds, shuffle=True, random_state=0).split(pixels, y):
            torch.manual_seed(0)
            lin = torch.nn.Linear(x.shape[1], r.shape[-1])
            opt = torch.optim.Adam(lin.parameters(), lr=1e-2, weight_decay=1e-4)
            for _ in range(steps):
                loss = tdcl_paper(lin(x[tr]), r[tr], labels[tr], temperature=temperature)
                opt.zero_grad()
                loss.backward()
                opt.step()
            with torch.no_grad():
                out.append(float(tdcl_paper(lin(x[te]), r[te], labels[te], temperature=temperature)))
    return float(np.mean(out))


@dataclasses.dataclass(frozen=True)
class Cell:
    """One layer at one timestep and pooling, scored."""

    pooling: str  # "mean" or "grid g"
    timestep: int
    block: int
    width: int
    ndcr_ncc: float
    ndcr_linear: float
    tdcl: float
    prompt_effect: float


def candidate_blocks(cfg: Config, cache_dir: Path) -> tuple[int, ...]:
    """Every hookable layer of the configured teacher (the mid-block first, where it has one)."""
    spec = teacher_spec(cfg, cache_dir)
    folder, family = spec.identity.folder, spec.identity.family
    mid = (MID_BLOCK,) if has_mid_block(folder, family) else ()
    return mid + tuple(range(layer_count(folder, family)))


def with_diffusion(cfg: Config, **diffusion) -> Config:
    """``cfg`` with these ``diffusion.*`` fields replaced."""
    return cfg.replace(diffusion=dataclasses.replace(cfg.diffusion, **diffusion))


def grid_blocks(cfg: Config, cache_dir: Path, blocks: Sequence[int]) -> tuple[int, ...]:
    """The ``blocks`` whose maps hold ``diffusion.pool-grid`` (``family.map_sides``: from the
    teacher folder's config files, no network)."""
    ident, d = teacher_identity(cfg.diffusion.model, cache_dir), cfg.diffusion
    sides = map_sides(ident.folder, ident.family, d.resolution)
    return tuple(int(b) for b in blocks if sides.get(int(b), d.pool_grid) >= d.pool_grid)


def check_split(data: ImageData, folds: int) -> None:
    """The split can be scored ``folds``-fold: two classes or more, each with ``folds`` images
    (stratified k-fold), else a one-line ValueError naming what sizes it (before any teacher work)."""
    counts = np.bincount(np.asarray(data.labels, dtype=np.int64).reshape(-1))
    present = counts[counts > 0]
    sized = "dataset.train-limit" if data.split == "train" else "dataset.val-fraction and dataset.eval-limit"
    if len(present) < 2 or present.min() < folds:
        few = f"{present.min()} in its smallest class" if len(present) else "none"
        raise ValueError(
            f"the {data.split} split has {len(data)} images of {len(present)} class(es) ({few}); the probe "
            f"needs two classes or more with --folds ({folds}) images each: raise {sized} (0 = all) "
            "or lower --folds"
        )


def score_pass(
    cfg: Config, cache_dir: Path, data: ImageData, blocks: Sequence[int], folds: int
) -> list[Cell]:
    """Every block of one (timestep, pooling) pass, from one cached extraction of all of them."""
    prompts = teacher_prompts(cfg, data.class_names)
    spec = teacher_spec(with_diffusion(cfg, blocks=tuple(blocks)), cache_dir)
    spec = dataclasses.replace(spec, resident=True)
    pooled, _ = pooled_features(feature_set(spec, data, prompts), np.arange(len(data)), progress=True)
    d, k, y = cfg.diffusion, data.num_classes, data.labels
    gray = bool((data.images == data.images[:, :1]).all())  # one channel repeated: keep one
    pixels = (data.images[:, :1] if gray else data.images).reshape(len(data), -1).numpy().astype(np.float32)
    name = f"grid {d.pool_grid}" if d.pooling == "grid" else "mean"
    cells = []
    for b in blocks:
        own = unit(pooled[b].astype(np.float32))  # (N, P, C): each prompt's row unit-normalised
        ndcr = own[:, -1] - own[:, -1].mean(0)
        ncc, lin = ndcr_geometry(ndcr, y, folds)
        tdcl = student_tdcl(pixels, own[:, :k], y, folds, cfg.loss.temperature)
        cells.append(Cell(name, d.timestep, int(b), own.shape[-1], ncc, lin, tdcl, prompt_effect(own[:, :k])))
    return cells


def probe(
    cfg: Config,
    cache_dir: Path,
    data: ImageData,
    timesteps: Sequence[int],
    poolings: Sequence[str],
    folds: int,
) -> list[Cell]:
    """Every candidate layer x ``timesteps`` x ``poolings`` (``mean`` / ``grid``: diffusion.pool-grid)."""
    if data.split not in PROBE_SPLITS:
        raise ValueError(f"the teacher probe reads the {'/'.join(PROBE_SPLITS)} split, not {data.split!r}")
    check_split(data, folds)
    cfg = dataclasses.replace(cfg, method="feddifrc")  # the class prompts, whatever the run's method
    blocks = candidate_blocks(cfg, cache_dir)
    layers = {p: grid_blocks(cfg, cache_dir, blocks) if p == "grid" else blocks for p in poolings}
    if not layers.get("grid", blocks):
        d = cfg.diffusion
        raise ValueError(
            f"diffusion.pool-grid = {d.pool_grid} exceeds every layer's map at diffusion.resolution = "
            f"{d.resolution}: lower diffusion.pool-grid, or probe --poolings mean"
        )
    cells: list[Cell] = []
    for pooling, usable in layers.items():
        for t in timesteps:
            c = with_diffusion(cfg, timestep=int(t), pooling=pooling)
            cells += score_pass(c, cache_dir, data, usable, folds)
            release(teacher_spec(with_diffusion(c, blocks=tuple(usable)), cache_dir))
    return cells


def recommend(cells: Sequence[Cell], n_blocks: int) -> tuple[str, int, tuple[int, ...], float]:
    """(pooling, timestep, blocks, their mean NDCR nearest-centroid accuracy): the (pooling,
    timestep) whose best ``n_blocks`` layers score highest on average, and those layers."""
    best: tuple[float, str, int, tuple[int, ...]] | None = None
    for pooling, t in dict.fromkeys((c.pooling, c.timestep) for c in cells):
        top = sorted((c for c in cells if (c.pooling, c.timestep) == (pooling, t)), key=lambda c: -c.ndcr_ncc)
        top = top[:n_blocks]
        mean = float(np.mean([c.ndcr_ncc for c in top]))
        if best is None or mean > best[0]:
            best = (mean, pooling, t, tuple(sorted(c.block for c in top)))
    assert best is not None
    return best[1], best[2], best[3], best[0]


def table(cells: Sequence[Cell], k: int) -> str:
    """The cells as a markdown table."""
    rows = [
        "| pooling | t | block | width | NDCR nearest centroid | NDCR linear | "
        f"TDCL held-out loss (chance ln {k} = {math.log(k):.2f}) | prompt effect |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in cells:
        block = "mid (-1)" if c.block == MID_BLOCK else str(c.block)
        rows.append(
            f"| {c.pooling} | {c.timestep} | {block} | {c.width} | {c.ndcr_ncc:.3f} | {c.ndcr_linear:.3f} | "
            f"{c.tdcl:.3f} | {c.prompt_effect:.4f} |"
        )
    return "\n".join(rows)
