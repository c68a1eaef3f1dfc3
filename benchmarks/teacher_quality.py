"""What does a diffusion teacher know? The trained tiny-mnist teacher beside its random-weight control.

    python benchmarks/teacher_quality.py [--out DIR] [--run-config ...] [--folds 5]
        [--pixart DIR [--pixart-blocks 3,5,7]]
    python benchmarks/teacher_quality.py --options [--split train|val|test] [--run-config ...]

``--options`` scores the configured teacher's NDCR-target options instead (``diffusion.pooling``,
``diffusion.pool-grid``, ``diffusion.blocks`` with the mid-block -1; ``OPTIONS``) in NDCR's
geometry, beside the raw pixels, on ``--split`` (default ``train``: NDCR's default is picked
there or on ``val``, never on ``test``; mnist-5k's ``val`` is the public split the packaged
teacher was trained on, so ``train`` is the one it never saw). Only the NDCR prompt's rows are
extracted (a tenth of the UNet rows: the options take minutes). Per option: 5-fold
nearest-class-centroid accuracy of (a) the NDCR target fused as a run fuses it, with a PCA
basis to the option's ``diffusion.channels`` fitted on these NDCR rows (a run fits it on every
prompt's rows; "n/a" where the block widths cannot reach the embedding width)
and (b) the option's NDCR-prompt features in the teacher's own space (each block
unit-normalised, concatenated, centred). Sized by ``dataset.train-limit`` /
``dataset.eval-limit``.

``--pixart DIR`` (a ``feddifrc pretrain-teacher --family pixart --out DIR`` folder) adds the
tiny transformer teacher and its own untrained control (``--family pixart --vae-steps 0
--unet-steps 0``, built once) as two more rows: UNet vs DiT on the same data, prompts,
recipe and measurements, each at its own layers (the DiT's ``--pixart-blocks``, its
default 3,5,7 of 8 blocks, 128 wide each, fused to the same PCA widths).

Both teachers have the same architecture, text encoder, prompts and noise; the control is
`feddifrc pretrain-teacher --vae-steps 0 --unet-steps 0` (untrained weights, its VAE scaling
factor measured on the same public split). Everything is measured on mnist-5k's federated
TEST split (1,000 images), which neither teacher saw, at the run config's timestep,
resolution and blocks, with the app's own code: the feature cache, the prompt list of a
run (the K class prompts in label order, then the NDCR prompt), a PCA basis to the
configured widths (fitted label-free on these features) and the paper's TDCL loss.

- **probe**: 5-fold linear-probe accuracy (StandardScaler + logistic regression) of the
  fused NDCR-prompt features (the NDCR targets). Chance is 0.10.
- **prompt effect**: mean over images and class-prompt pairs of 1 - cos(F^c, F^c') of one
  image's teacher features (pooled blocks, each L2-normalised, concatenated) under two
  class prompts (0 = the prompt changes nothing).
- **student TDCL**: the lowest held-out TDCL loss (tau = 0.04, positive = the true-class
  prompt) that a linear student on the pixels reaches, 5-fold, in the teacher's own space
  and in the fused (PCA) space that the app's TDCL uses. ln 10 = 2.30 is chance.

- **NDCR geometry**: NDCR compares unit vectors of centred (PCA) targets, so what its targets
  teach is read in that geometry, without rescaling features: 5-fold nearest-class-centroid
  (cosine) accuracy and an unscaled logistic-regression probe of the unit NDCR targets, beside
  the same numbers for the centred raw pixels (what the student sees anyway) and the TDCL
  positives (the image under its true-class prompt: label leakage, for scale). Variants of the
  target: the basis fitted on the NDCR prompt's rows only (not on all prompts' rows), and the
  teacher's own space (pooled blocks, each unit-normalised, concatenated, centred).
- **view match**: mean cosine, in NDCR's geometry, between the target of an image and the
  target of the same image shifted as the student's augmentation shifts it (pad 4, random
  crop): what NDCR aligns to when the student sees the augmented view (``loss.ndcr-view =
  "augmented"``); the clean view (the default) aligns to the target of the image it embeds (1).

Targets: probe >= 0.85 for the trained teacher and <= 0.5 for the control; prompt effect
>= 0.1 and <= 0.01. The script prints a table and writes teacher_quality.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

from feddifrc_app.data.images import PUBLIC_SPLIT
from feddifrc_app.data.registry import load_dataset
from feddifrc_app.files import write_json
from feddifrc_app.methods.feddifrc.projection import (
    client_stats,
    clip_widths,
    fit_basis,
    fit_federated_basis,
    fuse,
)
from feddifrc_app.methods.feddifrc.teacher import feature_set, pooled_features, teacher_prompts, teacher_spec
from feddifrc_app.tools.cmd_common import one_line_errors
from feddifrc_app.tools.run_config import load_app_config
from feddifrc_app.tools.teacher_probe import ndcr_geometry, prompt_effect, student_tdcl, unit

ROOT = Path(__file__).resolve().parents[1]

TARGETS = {"probe": (0.85, 0.5), "prompt-effect": (0.1, 0.01)}


def control_teacher(cfg, folder: Path, family: str = "sd") -> Path:
    """The untrained control: same architecture and recipe at 0 steps (built once)."""
    from feddifrc_app.tools.pretrain import PretrainRecipe, pretrain_teacher

    marker = folder / "feddifrc.json"
    recipe = json.loads(marker.read_text())["recipe"] if marker.is_file() else {}
    if (recipe.get("resolution"), recipe.get("family", "sd")) != (cfg.diffusion.resolution, family):
        data = load_dataset(cfg.dataset, PUBLIC_SPLIT)
        prompts = teacher_prompts(cfg, data.class_names)[: data.num_classes]
        pretrain_teacher(
            data.images,
            data.labels,
            prompts,
            folder,
            PretrainRecipe(family=family, resolution=cfg.diffusion.resolution, vae_steps=0, unet_steps=0),
            name="tiny-mnist-untrained" if family == "sd" else f"tiny-mnist-{family}-untrained",
            data_note="untrained control",
            progress=False,
        )
    return folder


def teacher_features(cfg, cache_dir: Path, data) -> tuple[np.ndarray, np.ndarray, int]:
    """(raw (N, P, sum C_b), fused (N, P, D), K) for every image under the run's prompts.

    raw: the teacher's own pooled features, each block L2-normalised, concatenated.
    fused: what the app trains against, a PCA basis (label-free) to the configured widths.
    """
    features = feature_set(teacher_spec(cfg, cache_dir), data, teacher_prompts(cfg, data.class_names))
    pooled, _ = pooled_features(features, np.arange(len(data)), progress=True)
    blocks = cfg.diffusion.blocks
    raw = np.concatenate(
        [pooled[b] / np.linalg.norm(pooled[b], axis=-1, keepdims=True).clip(1e-12) for b in blocks], axis=-1
    )
    basis, _ = fit_federated_basis([client_stats(pooled)], cfg.diffusion.channels, blocks, cfg.embedding_dim)
    return raw, fuse(pooled, basis), data.num_classes


def probe_accuracy(x: np.ndarray, y: np.ndarray, folds: int) -> float:
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold, cross_val_score
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    clf = make_pipeline(StandardScaler(), LogisticRegression(C=1.0, max_iter=2000))
    cv = StratifiedKFold(folds, shuffle=True, random_state=0)
    return float(cross_val_score(clf, x, y, cv=cv).mean())


def shifted(test, seed: int = 0):
    """The split with each image shifted as ``train_transform`` does (pad 4, random crop; no flip)."""
    import torchvision.transforms.v2.functional as TF

    from feddifrc_app.data.images import ImageData, fingerprint_of
    from feddifrc_app.data.transforms import CROP_PADDING

    g, p, size = torch.Generator().manual_seed(seed), CROP_PADDING, test.image_size
    imgs = torch.stack(
        [
            TF.crop(im, *[v - p for v in torch.randint(0, 2 * p + 1, (2,), generator=g).tolist()], size, size)
            for im in test.images
        ]
    )
    split = f"{test.split}-shifted{seed}"
    fp = fingerprint_of(test.name, split, test.class_names, test.labels, imgs)
    return ImageData(test.name, split, imgs, test.labels, test.class_names, fp, test.mean, test.std)


def measure(cfg, cache_dir: Path, test, folds: int) -> dict[str, float]:
    raw, fused, k = teacher_features(cfg, cache_dir, test)
    y = test.labels
    pixels = test.images[:, 0].reshape(len(test), -1).numpy()
    tau = cfg.loss.temperature
    spec = teacher_spec(cfg, cache_dir)
    prompts = teacher_prompts(cfg, test.class_names)
    pooled, _ = pooled_features(feature_set(spec, test, prompts), np.arange(len(test)))
    blocks = cfg.diffusion.blocks
    widths = clip_widths(cfg.diffusion.channels, [pooled[b].shape[-1] for b in blocks])
    own = fit_basis(
        client_stats({b: pooled[b][:, -1:] for b in blocks}), widths, blocks, mode="federated-pca"
    )
    basis, _ = fit_federated_basis([client_stats(pooled)], cfg.diffusion.channels, blocks, cfg.embedding_dim)
    moved = shifted(test)
    # The NDCR prompt alone for the shifted images (a tenth of the UNet rows).
    pooled_moved, _ = pooled_features(feature_set(spec, moved, prompts[-1:]), np.arange(len(test)))
    ndcr, ndcr_moved = fuse(pooled, basis)[:, -1], fuse(pooled_moved, basis)[:, 0]
    teacher_space = raw[:, -1] - raw[:, -1].mean(0)
    out = {
        "probe": probe_accuracy(fused[:, -1], y, folds),
        "prompt-effect": prompt_effect(raw[:, :k]),
        "student-tdcl-raw": student_tdcl(pixels, raw[:, :k], y, folds, tau),
        "student-tdcl-fused": student_tdcl(pixels, fused[:, :k], y, folds, tau),
        "view-match-cos": float((unit(ndcr) * unit(ndcr_moved)).sum(-1).mean()),
        # mean squared cosine of a unit target to the targets' mean direction: energy all share
        "ndcr-shared-direction": float(((unit(ndcr) @ unit(unit(ndcr).mean(0))) ** 2).mean()),
    }
    variants = {
        "ndcr": ndcr,
        "ndcr-own-basis": fuse({b: pooled[b][:, -1:] for b in blocks}, own)[:, 0],
        "ndcr-teacher-space": teacher_space,
        "tdcl-positive": fused[np.arange(len(y)), y],
        "pixels": pixels - pixels.mean(0),
    }
    for name, x in variants.items():
        out[f"{name}-ncc"], out[f"{name}-linear"] = ndcr_geometry(x, y, folds)
    return out


# (label, diffusion.blocks, diffusion.channels, pool-grid: 0 = mean) of every option --options scores
OPTIONS = (
    ("mean, up 1,2,3 (today)", (1, 2, 3), (64, 32, 32), 0),
    ("grid 2, up 1,2,3", (1, 2, 3), (64, 32, 32), 2),
    ("grid 4, up 1,2,3", (1, 2, 3), (64, 32, 32), 4),
    ("mean, up 3", (3,), (128,), 0),
    ("grid 2, up 3", (3,), (128,), 2),
    ("grid 8, up 3 (unpooled)", (3,), (128,), 8),
    ("mean, mid", (-1,), (128,), 0),
    ("mean, mid + up 1,2,3", (-1, 1, 2, 3), (32, 32, 32, 32), 0),
)


def option_scores(cfg, cache_dir: Path, data, folds: int) -> dict[str, float | None]:
    """Nearest-class-centroid accuracy of one option's NDCR target: fused (a PCA basis fitted on the
    NDCR rows; None where its widths cannot reach the embedding) and in the teacher's own space."""
    from sklearn.model_selection import StratifiedKFold, cross_val_score
    from sklearn.neighbors import NearestCentroid

    spec = teacher_spec(cfg, cache_dir)
    ndcr_prompt = teacher_prompts(cfg, data.class_names)[-1:]
    pooled, _ = pooled_features(feature_set(spec, data, ndcr_prompt), np.arange(len(data)))
    blocks, y = cfg.diffusion.blocks, data.labels
    cv = StratifiedKFold(folds, shuffle=True, random_state=0)
    ncc = lambda x: float(cross_val_score(NearestCentroid(), unit(x), y, cv=cv).mean())  # noqa: E731
    own = np.concatenate([unit(pooled[b][:, -1].astype(np.float32)) for b in blocks], axis=-1)
    try:
        basis, _ = fit_federated_basis(
            [client_stats(pooled)], cfg.diffusion.channels, blocks, cfg.embedding_dim
        )
    except ValueError:  # the blocks' widths sum below the embedding width: no run can use it
        fused = None
    else:
        fused = ncc(fuse(pooled, basis)[:, -1])
    width = sum(int(pooled[b].shape[-1]) for b in blocks)
    return {"fused-ncc": fused, "teacher-space-ncc": ncc(own - own.mean(0)), "width": width}


def options_table(cfg, cache_dir: Path, data, folds: int) -> dict[str, dict]:
    """Every ``OPTIONS`` row on ``data`` (a grid a block's map cannot hold is skipped, said why)."""
    rows: dict[str, dict] = {}
    for label, blocks, channels, grid in OPTIONS:
        d = dataclasses.replace(
            cfg.diffusion,
            blocks=blocks,
            channels=channels,
            pooling="grid" if grid else "mean",
            pool_grid=grid or 2,
        )
        try:
            rows[label] = option_scores(cfg.replace(diffusion=d), cache_dir, data, folds)
        except ValueError as e:
            rows[label] = {"skipped": str(e)}
    pixels = data.images[:, 0].reshape(len(data), -1).numpy().astype(np.float32)
    rows["raw pixels (centred)"] = {
        "teacher-space-ncc": ndcr_geometry(pixels - pixels.mean(0), data.labels, folds)[0]
    }
    return rows


def print_options(rows: dict[str, dict], d, data, folds: int) -> None:
    print(
        f"\nNDCR target options, {d.model}, mnist-5k {data.split} split ({len(data)} images), "
        f"t = {d.timestep}, {d.resolution} px, NDCR prompt {d.ndcr_prompt!r}: "
        f"{folds}-fold nearest-class-centroid accuracy of centred unit vectors (chance 0.10)\n"
    )
    print(
        "| option | pooled width | NDCR target as a run fuses it (PCA) | "
        "teacher space (blocks unit, centred) |"
    )
    print("| --- | --- | --- | --- |")
    f = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    for label, m in rows.items():
        if "skipped" in m:
            print(f"| {label} | - | skipped: {m['skipped']} | |")
        else:
            print(
                f"| {label} | {m.get('width', '-')} | {f(m.get('fused-ncc'))} | {f(m['teacher-space-ncc'])} |"
            )


def print_table(rows: dict[str, dict[str, float]], d, n_images: int, folds: int) -> None:
    print(
        f"\nmnist-5k federated test split ({n_images} images), t = {d.timestep}, {d.resolution} px, "
        f"blocks {','.join(map(str, d.blocks))} -> PCA {','.join(map(str, d.channels))}, "
        f"NDCR prompt {d.ndcr_prompt!r}, {folds}-fold\n"
    )
    print(
        "| teacher | linear probe of NDCR features (chance 0.10) | prompt effect | "
        f"student TDCL, teacher space | student TDCL, fused space (chance ln 10 = {math.log(10):.2f}) |"
    )
    print("| --- | --- | --- | --- | --- |")
    for label, m in rows.items():
        print(
            f"| {label} (blocks {m['blocks']}) | {m['probe']:.3f} | {m['prompt-effect']:.4f} | "
            f"{m['student-tdcl-raw']:.3f} | "
            f"{m['student-tdcl-fused']:.3f} |"
        )
    print(
        "\nNDCR geometry (unit vectors, no rescaling; 5-fold nearest-class-centroid / unscaled "
        "linear probe)\n"
    )
    print(
        "| teacher | NDCR targets | same, basis fitted on NDCR rows only | same, teacher space | "
        "TDCL positives (label leak) | centred pixels | view match: cos(target, target of the "
        "shifted view) | share of a target on the mean direction |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, m in rows.items():
        cells = [
            f"{m[f'{v}-ncc']:.3f} / {m[f'{v}-linear']:.3f}"
            for v in ("ndcr", "ndcr-own-basis", "ndcr-teacher-space", "tdcl-positive", "pixels")
        ]
        tail = f"{m['view-match-cos']:.3f} | {m['ndcr-shared-direction']:.3f}"
        print(f"| {label} | {' | '.join(cells)} | {tail} |")


def teachers(cfg, args, out: Path) -> list[tuple[str, str, tuple[int, ...]]]:
    """(row label, diffusion.model, diffusion.blocks) of every teacher measured."""
    blocks = cfg.diffusion.blocks
    rows = [
        (cfg.diffusion.model, cfg.diffusion.model, blocks),
        ("untrained control", str(control_teacher(cfg, out / "tiny-mnist-untrained")), blocks),
    ]
    if args.pixart:
        dit = tuple(int(b) for b in args.pixart_blocks.split(","))
        ctrl = control_teacher(cfg, out / "tiny-mnist-pixart-untrained", family="pixart")
        pixart = str(Path(args.pixart).resolve())
        rows += [("pixart (DiT) teacher", pixart, dit), ("pixart untrained control", str(ctrl), dit)]
    return rows


def verdicts(rows: dict[str, dict], trained_label: str, pixart: bool) -> dict[str, bool]:
    """Each teacher's probe and prompt effect against ``TARGETS``, and its untrained control's."""
    trained, ctrl = rows[trained_label], rows["untrained control"]
    checks = {
        "trained probe >= 0.85": trained["probe"] >= TARGETS["probe"][0],
        "control probe <= 0.5": ctrl["probe"] <= TARGETS["probe"][1],
        "trained prompt effect >= 0.1": trained["prompt-effect"] >= TARGETS["prompt-effect"][0],
        "control prompt effect <= 0.01": ctrl["prompt-effect"] <= TARGETS["prompt-effect"][1],
    }
    if pixart:
        dit, dctrl = rows["pixart (DiT) teacher"], rows["pixart untrained control"]
        checks["pixart probe >= 0.85"] = dit["probe"] >= TARGETS["probe"][0]
        checks["pixart control probe <= 0.5"] = dctrl["probe"] <= TARGETS["probe"][1]
        checks["pixart prompt effect >= 0.1"] = dit["prompt-effect"] >= TARGETS["prompt-effect"][0]
        checks["pixart control prompt effect <= 0.01"] = dctrl["prompt-effect"] <= TARGETS["prompt-effect"][1]
    return checks


@one_line_errors("benchmarks/teacher_quality.py")
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "teacher_quality"))
    ap.add_argument("--run-config", action="append", default=None, help="overrides as for flwr run")
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--pixart", default="", help="a `pretrain-teacher --family pixart` folder to compare")
    ap.add_argument("--pixart-blocks", default="3,5,7", help="its transformer_blocks (default of 8)")
    ap.add_argument("--options", action="store_true", help="score the NDCR-target options (OPTIONS) instead")
    ap.add_argument("--split", default="train", choices=("train", "val", "test"), help="--options: the split")
    args = ap.parse_args()
    torch.set_num_threads(2)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_app_config(ROOT, args.run_config)
    if cfg.dataset.name != "mnist-5k":
        raise SystemExit("teacher_quality: needs dataset.name = 'mnist-5k' (the teacher's public split)")

    if args.options:
        data = load_dataset(cfg.dataset, args.split, seed=cfg.seed)
        rows = options_table(cfg, out / "cache", data, args.folds)
        print_options(rows, cfg.diffusion, data, args.folds)
        write_json(
            out / f"teacher_options_{args.split}.json",
            {"split": args.split, "images": len(data), "rows": rows},
        )
        return 0
    test = load_dataset(cfg.dataset, "test")
    rows = {}
    for label, model, blocks in teachers(cfg, args, out):
        c = cfg.replace(diffusion=dataclasses.replace(cfg.diffusion, model=model, blocks=blocks))
        rows[label] = {**measure(c, out / "cache", test, args.folds), "blocks": ",".join(map(str, blocks))}
    d = cfg.diffusion
    print_table(rows, d, len(test), args.folds)
    checks = verdicts(rows, cfg.diffusion.model, bool(args.pixart))
    print("\n" + "\n".join(f"{'PASS' if ok else 'MISS'}  {name}" for name, ok in checks.items()))
    summary = {
        "rows": rows,
        "checks": checks,
        "timestep": d.timestep,
        "resolution": d.resolution,
        "blocks": list(d.blocks),
        "channels": list(d.channels),
        "images": len(test),
    }
    write_json(out / "teacher_quality.json", summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
