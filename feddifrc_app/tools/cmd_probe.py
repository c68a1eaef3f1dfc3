"""``feddifrc probe-teacher``: which layers and timestep for this teacher, measured
(``tools/teacher_probe.py``)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from feddifrc_app.casting import resolve_path
from feddifrc_app.tools.cmd_common import CLIError, add_run_config_args, examples, int_list
from feddifrc_app.tools.cmd_node import resolve_teacher
from feddifrc_app.tools.run_config import load_app_config


def add_probe(p: argparse.ArgumentParser) -> None:
    examples(
        p,
        "feddifrc probe-teacher --run-config \"diffusion.model='tiny-mnist' dataset.train-limit=500\"",
        "feddifrc probe-teacher --split val --timesteps 50,200 --poolings mean "
        "--run-config \"diffusion.model='tiny-pixart' diffusion.dit-features='adaln-drop'\"",
    )
    add_run_config_args(p)
    p.add_argument(
        "--split",
        default="train",
        help="labelled images to probe on: train or val (never test, the split a benchmark reports) "
        "(sized by dataset.train-limit / eval-limit)",
    )
    p.add_argument(
        "--timesteps",
        default="25,100,300",
        help="comma-separated diffusion timesteps to probe",
    )
    p.add_argument(
        "--poolings",
        default="mean,grid",
        help="comma-separated poolings: mean, grid (diffusion.pool-grid)",
    )
    p.add_argument("--folds", type=int, default=5, help="cross-validation folds per score")
    p.add_argument(
        "--json", default=None, help="also write every cell and the recommendation to this JSON file"
    )


def cmd_probe(args: argparse.Namespace) -> int:
    from feddifrc_app.data.registry import load_dataset
    from feddifrc_app.methods.feddifrc.rules import resolve_cache_dir
    from feddifrc_app.tools.teacher_probe import PROBE_SPLITS, probe, recommend, table

    poolings, timesteps = _checked(args, PROBE_SPLITS)
    out = json_out(args.json)
    cfg = load_app_config(args.app, args.run_config)
    cache_dir = resolve_cache_dir(cfg, args.cache_dir)
    resolve_teacher(cfg, cache_dir)  # a teacher it cannot have, in one line, before the data
    data = load_dataset(cfg.dataset, args.split, seed=cfg.seed)
    t0 = time.perf_counter()
    try:
        cells = probe(cfg, cache_dir, data, timesteps, poolings, args.folds)
    except ValueError as e:  # a layer, mode or split the teacher cannot take, said in one line
        raise CLIError(str(e)) from None
    wall = time.perf_counter() - t0
    d = cfg.diffusion
    print(
        f"\n{d.model} ({d.dit_features} features), {data.name} {data.split} split ({len(data)} images), "
        f"{d.resolution} px, NDCR prompt {d.ndcr_prompt!r}, {args.folds}-fold, {wall:.0f} s\n"
    )
    print(table(cells, data.num_classes))
    pooling, t, blocks, score = recommend(cells, len(d.blocks))
    keys = f'diffusion.blocks = "{",".join(map(str, blocks))}"  diffusion.timestep = {t}'
    keys += f'  diffusion.pooling = "{pooling.split()[0]}"'
    print(
        f"\nrecommended: {keys}\n(criterion: the pooling and timestep whose best {len(d.blocks)} layers "
        "(as many as diffusion.blocks has) have the highest mean NDCR nearest-centroid accuracy, "
        f"{score:.3f}; diffusion.channels must still sum to 8 x model.width)"
    )
    if out is not None:
        from dataclasses import asdict

        from feddifrc_app.files import write_json

        rec = {"pooling": pooling, "timestep": t, "blocks": list(blocks), "mean_ndcr_ncc": score}
        write_json(out, {"cells": [asdict(c) for c in cells], "recommendation": rec, "seconds": wall})
    return 0


def _checked(args: argparse.Namespace, splits: tuple[str, ...]) -> tuple[list[str], list[int]]:
    """The probe's flags, checked before any work: its poolings and timesteps."""
    if args.split not in splits:
        raise CLIError(
            f"--split {args.split!r}: probe on {' or '.join(splits)}; the test split is what a "
            "benchmark reports, and choosing layers on it would fit the benchmark"
        )
    poolings = [s.strip() for s in args.poolings.split(",") if s.strip()]
    if not poolings or set(poolings) - {"mean", "grid"}:
        raise CLIError(f"--poolings {args.poolings!r}: expected mean, grid or mean,grid")
    timesteps = int_list("--timesteps", args.timesteps) or []
    if not timesteps or any(not 0 <= t <= 999 for t in timesteps):
        raise CLIError(f"--timesteps {args.timesteps!r}: expected comma-separated integers in 0..999")
    if args.folds < 2:
        raise CLIError(f"--folds {args.folds}: at least 2")
    return poolings, timesteps


def json_out(value: str | None) -> Path | None:
    """``--json``'s file, checked before any work: not a folder, in a folder that takes a file."""
    if value is None:
        return None
    path = resolve_path(value, "--json")
    if path.is_dir():
        raise CLIError(f"--json {value}: {path} is a folder; give a file path, e.g. {path / 'probe.json'}")
    try:
        from feddifrc_app.files import ensure_writable_dir  # numpy: not for --help

        ensure_writable_dir(path.parent, "--json's folder")
    except OSError as e:
        raise CLIError(str(e)) from None
    return path
