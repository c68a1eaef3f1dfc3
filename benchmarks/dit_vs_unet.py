"""UNet vs DiT tiny teachers at equal CPU time: each at its probed layers and timestep, the DiT
with and without reading its blocks the way the network reads them, over teacher-training seeds,
beside both untrained controls.

    feddifrc pretrain-teacher --family sd --seed S --out DIR                      # S = 1, 2 (0: tiny-mnist)
    feddifrc pretrain-teacher --family pixart --seed S --unet-steps 617 --out DIR # S = 0, 1, 2
    python benchmarks/dit_vs_unet.py --unet tiny-mnist,DIR1,DIR2 --dit DIR0,DIR1,DIR2 [--out DIR]

617 DiT steps cost about the CPU time of the UNet's 1,200 (docs/evidence.md). Steps:

1. **Probe** (train split, ``--probe-images``; never test): each family's FIRST teacher through
   ``feddifrc probe-teacher``'s code (``teacher_probe.probe``, mean pooling, ``--timesteps``), for
   the UNet once and for the DiT once per mode in ``--dit-modes`` (``raw``: the block outputs,
   today's default; ``adaln``: DiTF's reading). Its rule picks 3 layers and the timestep. The
   setting is chosen on one seed and applied to every seed of the family and to its control.
2. **Massive channels**: per DiT block, the largest ratio of a channel's median ``|h|`` over
   tokens to the row's typical channel (``dit_features.massive_channels``; massive above 100),
   from the unpooled raw tokens of ``--probe-images`` train images. ``adaln-drop`` and
   ``adaln-rescale`` equal ``adaln`` where no channel is massive, so they are measured only
   where one is.
3. **Measure** (test split, ``--test-images``): ``teacher_quality.measure`` (linear probe of the
   fused NDCR targets, prompt effect, student TDCL, NDCR geometry) for every teacher at its
   family's (mode's) probed setting, and the family's untrained control (``pretrain-teacher
   --vae-steps 0 --unet-steps 0``, seed 0) at the same setting. Mean ± SD over seeds. The same
   is measured first at the app's defaults with raw DiT blocks (``--- , defaults``): the
   comparison without the fix (UNet ``diffusion.blocks``; DiT ``round(n k / 4) - 1``; t = 100).

Every step is kept in ``--out`` (``probe_*.json``, ``rows/*.json``): a rerun skips what is done.
Writes ``dit_vs_unet.json`` and prints the tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import torch

from feddifrc_app.data.registry import load_dataset
from feddifrc_app.diffusion.dit_features import MASSIVE_RATIO, massive_channels
from feddifrc_app.diffusion.family import family_module
from feddifrc_app.files import write_json
from feddifrc_app.methods.feddifrc.teacher import feature_set, pooled_features, teacher_prompts, teacher_spec
from feddifrc_app.tools.cmd_common import one_line_errors
from feddifrc_app.tools.run_config import load_app_config
from feddifrc_app.tools.teacher_probe import (
    candidate_blocks,
    probe,
    recommend,
    with_diffusion,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from teacher_quality import control_teacher, measure  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
N_BLOCKS = 3  # as many layers as the defaults read
METRICS = (
    ("probe", "linear probe of NDCR features"),
    ("prompt-effect", "prompt effect"),
    ("student-tdcl-fused", "student TDCL, fused"),
    ("ndcr-ncc", "NDCR nearest centroid"),
    ("ndcr-linear", "NDCR linear"),
    ("ndcr-shared-direction", "share on the mean direction"),
)


def channels_for(widths: list[int], channels: tuple[int, ...]) -> tuple[int, ...]:
    """The configured PCA widths given to the layers, the largest to the widest layer (each
    layer holds at most its width); a ValueError if these layers cannot hold them."""
    order = sorted(range(len(widths)), key=lambda i: -widths[i])
    out = [0] * len(widths)
    for i, c in zip(order, sorted(channels, reverse=True), strict=True):
        if c > widths[i]:
            raise ValueError(f"layers of widths {widths} cannot hold PCA widths {channels}")
        out[i] = c
    return tuple(out)


def probed_setting(cfg, cache_dir: Path, train, timesteps, out: Path, name: str) -> dict:
    """The probe's recommendation for ``cfg``'s teacher (kept in ``out / probe_{name}.json``)."""
    path = out / f"probe_{name}.json"
    if path.is_file():
        return json.loads(path.read_text())
    cells = probe(cfg, cache_dir, train, timesteps, ("mean",), folds=5)
    pooling, t, blocks, score = recommend(cells, N_BLOCKS)
    rec = {
        "timestep": int(t),
        "blocks": [int(b) for b in blocks],
        "mean_ndcr_ncc": score,
        "cells": [dataclasses.asdict(c) for c in cells],
    }
    write_json(path, rec)
    return rec


def massive_ratios(cfg, cache_dir: Path, data, timestep: int, n: int = 50) -> list[float]:
    """Per DiT block: the largest (median |h| over tokens) / (row's typical channel) over the
    first ``n`` images, from raw unpooled tokens (a grid as fine as the token grid) under the NDCR
    prompt."""
    blocks = candidate_blocks(cfg, cache_dir)
    side = cfg.diffusion.resolution // 4  # the x4 VAE's latent, one token per latent pixel
    c = with_diffusion(
        cfg, blocks=blocks, timestep=timestep, pooling="grid", pool_grid=side, dit_features="raw"
    )
    spec = teacher_spec(c, cache_dir)
    ndcr_prompt = teacher_prompts(c, data.class_names)[-1:]
    pooled, _ = pooled_features(feature_set(spec, data, ndcr_prompt), np.arange(n))
    ratios = []
    for b in blocks:
        x = torch.from_numpy(pooled[b][:, 0])  # (n, C * side * side), channel-major
        tokens = x.reshape(n, -1, side * side).transpose(1, 2)  # (n, tokens, C)
        _, med, typical = massive_channels(tokens)
        ratios.append(float((med / typical.clamp_min(1e-30)).max()))
    return ratios


def measured_row(cfg, cache_dir: Path, test, out: Path, name: str) -> dict:
    """``teacher_quality.measure`` for one teacher at one setting (kept in ``out / rows``)."""
    path = out / "rows" / f"{name}.json"
    if path.is_file():
        return json.loads(path.read_text())
    row = measure(cfg, cache_dir, test, folds=5)
    write_json(path, row)
    return row


def summary(rows: list[dict]) -> dict[str, tuple[float, float]]:
    """(mean, sample SD; 0 for one row) of every metric over ``rows``."""
    out = {}
    for key, _ in METRICS:
        v = np.array([r[key] for r in rows], dtype=np.float64)
        out[key] = (float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0)
    return out


def family_setting(cfg, args, train, out: Path, family: str, mode: str) -> dict:
    """Probe the family's first teacher (in ``mode``) and fit its PCA widths to the chosen layers."""
    first = (args.unet if family == "sd" else args.dit)[0]
    c = with_diffusion(cfg, model=first, dit_features=mode)
    rec = probed_setting(c, out / "cache", train, args.timesteps, out, f"{family}-{mode}")
    blocks = tuple(rec["blocks"])
    width = {(x["block"], x["timestep"]): x["width"] for x in rec["cells"]}
    widths = [width[(b, rec["timestep"])] for b in blocks]
    rec["channels"] = list(channels_for(widths, cfg.diffusion.channels))
    return rec


def default_setting(cfg, args, out: Path, family: str) -> dict:
    """The app's defaults, as a user without the probe runs: the configured blocks for the UNet,
    the transformer families' documented rule (``default_layers``) for the DiT, the configured
    timestep and PCA widths."""
    if family == "sd":
        blocks = tuple(cfg.diffusion.blocks)
    else:
        n = len(candidate_blocks(with_diffusion(cfg, model=args.dit[0]), out / "cache"))
        blocks = family_module(family).default_layers(n)
    d = cfg.diffusion
    return {"blocks": list(blocks), "timestep": d.timestep, "channels": list(d.channels)}


def arm(cfg, args, data, out: Path, family: str, mode: str, *, probed: bool = True) -> dict:
    """Every seed of one family (one DiT mode) and its control, at the family's probed setting
    (``probed``) or at the app's defaults."""
    train, test = data
    if probed:
        rec = family_setting(cfg, args, train, out, family, mode)
    else:
        rec = default_setting(cfg, args, out, family)
    setting = dict(blocks=tuple(rec["blocks"]), timestep=rec["timestep"], channels=tuple(rec["channels"]))
    folders = args.unet if family == "sd" else args.dit
    tag = f"{family}-{mode}" if probed else f"{family}-{mode}-defaults"
    seeds = []
    for i, model in enumerate(folders):
        c = with_diffusion(cfg, model=model, dit_features=mode, **setting)
        seeds.append(measured_row(c, out / "cache", test, out, f"{tag}-{i}"))
    ctrl_dir = control_teacher(cfg, out / f"{family}-untrained", family=family)
    c = with_diffusion(cfg, model=str(ctrl_dir), dit_features=mode, **setting)
    control = measured_row(c, out / "cache", test, out, f"{tag}-control")
    return {
        "family": family, "mode": mode, "probed": probed, "setting": rec, "seeds": seeds, "control": control,
    }  # fmt: skip


def print_tables(arms: list[dict], massive: dict) -> None:
    head = " | ".join(label for _, label in METRICS)
    print(f"\n| teacher | setting | {head} |\n|{' --- |' * (len(METRICS) + 2)}")
    for a in arms:
        s, name = a["setting"], f"{a['family']} {a['mode']}"
        name += "" if a.get("probed", True) else ", defaults"
        where = f"blocks {','.join(map(str, s['blocks']))}, t = {s['timestep']}"
        stats = summary(a["seeds"])
        cells = " | ".join(f"{m:.3f} ± {sd:.3f}" for m, sd in (stats[k] for k, _ in METRICS))
        print(f"| {name}, {len(a['seeds'])} seeds | {where} | {cells} |")
        ctrl = " | ".join(f"{a['control'][k]:.3f}" for k, _ in METRICS)
        print(f"| {name}, untrained control | {where} | {ctrl} |")
    print(f"\nlargest channel / typical channel per DiT block (massive above {MASSIVE_RATIO:.0f}):")
    for name, ratios in massive.items():
        print(f"  {name}: {', '.join(f'{r:.1f}' for r in ratios)}")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--unet", required=True, help="comma-separated UNet teachers (tiny-mnist or folders)")
    ap.add_argument("--dit", required=True, help="comma-separated `--family pixart` teacher folders")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "dit_vs_unet"))
    ap.add_argument("--run-config", action="append", default=None, help="overrides as for flwr run")
    ap.add_argument("--timesteps", default="25,100,300", help="probed timesteps")
    ap.add_argument("--dit-modes", default="raw,adaln", help="diffusion.dit-features modes of the DiT")
    ap.add_argument("--probe-images", type=int, default=300, help="train images the probe reads")
    ap.add_argument("--test-images", type=int, default=1000, help="test images measured (1000: all)")
    args = ap.parse_args()
    args.unet, args.dit = args.unet.split(","), [str(Path(p).resolve()) for p in args.dit.split(",")]
    args.unet = [m if m == "tiny-mnist" else str(Path(m).resolve()) for m in args.unet]
    args.timesteps = [int(t) for t in args.timesteps.split(",")]
    args.dit_modes = args.dit_modes.split(",")
    return args


@one_line_errors("benchmarks/dit_vs_unet.py")
def main() -> int:
    args = parse_args()
    torch.set_num_threads(2)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_app_config(ROOT, args.run_config)
    cfg = dataclasses.replace(cfg, method="feddifrc")
    ds = dataclasses.replace(cfg.dataset, train_limit=args.probe_images, eval_limit=args.test_images)
    cfg = dataclasses.replace(cfg, dataset=ds)
    if cfg.dataset.name != "mnist-5k":
        raise SystemExit("dit_vs_unet: needs dataset.name = 'mnist-5k' (the teachers' public split)")
    train, test = load_dataset(cfg.dataset, "train", seed=cfg.seed), load_dataset(cfg.dataset, "test")
    massive = {}
    for i, model in enumerate(args.dit):
        massive[f"DiT seed {i}"] = massive_ratios(with_diffusion(cfg, model=model), out / "cache", train, 100)
    ctrl = control_teacher(cfg, out / "pixart-untrained", family="pixart")
    massive["DiT untrained control"] = massive_ratios(
        with_diffusion(cfg, model=str(ctrl)), out / "cache", train, 100
    )
    modes = list(args.dit_modes)
    if not any(r > MASSIVE_RATIO for rs in massive.values() for r in rs):
        modes = [m for m in modes if m not in ("adaln-drop", "adaln-rescale")]
    # Without the fix (the app's defaults, raw DiT blocks), then each family at its probed setting.
    arms = [arm(cfg, args, (train, test), out, f, "raw", probed=False) for f in ("sd", "pixart")]
    arms += [arm(cfg, args, (train, test), out, "sd", "raw")]
    arms += [arm(cfg, args, (train, test), out, "pixart", m) for m in modes]
    print_tables(arms, massive)
    write_json(out / "dit_vs_unet.json", {"arms": arms, "massive": massive, "args": vars(args)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
