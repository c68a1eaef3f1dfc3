"""``feddifrc pretrain-teacher``: the tiny text-to-image teacher, trained on the public split
(or a chosen part of it: ``--limit``, ``--exclude-val``)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from feddifrc_app.casting import resolve_path
from feddifrc_app.tools.cmd_common import CLIError, examples
from feddifrc_app.tools.pretrain_numbers import FAMILIES, PretrainRecipe  # torch-free
from feddifrc_app.tools.run_config import load_app_config

if TYPE_CHECKING:  # --help stays torch-free
    import numpy as np

    from feddifrc_app.config import DatasetConfig
    from feddifrc_app.data.images import ImageData


def add_pretrain(p: argparse.ArgumentParser) -> None:
    d = PretrainRecipe()
    p.add_argument(
        "--out",
        required=True,
        help="folder to write the diffusers pipeline to (replaced atomically): missing, empty, or an "
        "earlier pretrain-teacher output",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an --out folder holding other files (never the working directory or the app)",
    )
    p.add_argument("--app", default=".", help="Flower app folder (its pyproject.toml holds the defaults)")
    p.add_argument(
        "--run-config",
        action="append",
        metavar="FILE_OR_PAIRS",
        help="overrides as for `flwr run --run-config` (dataset, prompt template, resolution)",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="weights, batches and noise")
    p.add_argument(
        "--family",
        choices=FAMILIES,
        default=d.family,
        help="sd: UNet + CLIP (tiny-mnist); pixart: a PixArt DiT of the same size + T5, same recipe",
    )
    p.add_argument("--vae-steps", type=int, default=d.vae_steps, help="VAE training steps (phase 1)")
    p.add_argument(
        "--unet-steps",
        type=int,
        default=d.unet_steps,
        help="denoiser (UNet or DiT) steps; 0 with --vae-steps 0: the untrained control",
    )
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="images per step, both phases")
    _add_data_choice(p)
    p.add_argument("--name", default="tiny-mnist", help="model id recorded in the folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    examples(
        p,
        "feddifrc pretrain-teacher --out ~/teachers/tiny-mnist-seed1 --seed 1",
        "feddifrc pretrain-teacher --out ~/teachers/tiny-pixart --family pixart",
        "feddifrc pretrain-teacher --out ~/teachers/t-small --exclude-val --limit 500 "
        "--run-config \"dataset.name='mnist-5k-pool'\"",
    )


def _add_data_choice(p: argparse.ArgumentParser) -> None:
    """Which public-split images the teacher trains on."""
    p.add_argument(
        "--limit",
        type=int,
        default=0,
        help="train on a stratified N of the public split's images (fixed seed 0); 0 = all of them",
    )
    p.add_argument(
        "--exclude-val",
        action="store_true",
        help="leave out the student's validation images (mnist-5k-pool: 500 of its public split) "
        "before --limit, so they stay held out from this teacher",
    )


def cmd_pretrain(args: argparse.Namespace) -> int:
    from feddifrc_app.methods.feddifrc.teacher import teacher_prompts
    from feddifrc_app.tools.pretrain import (
        OutFolderError,
        check_out_folder,
        pretrain_teacher,
    )

    protected, out = [resolve_path(args.app, "--app")], resolve_path(args.out, "--out")
    if args.limit < 0:
        raise CLIError(f"--limit {args.limit}: expected 0 (all images) or a positive count")
    try:  # before anything is loaded or trained
        check_out_folder(out, args.force, protected)
    except OutFolderError as e:
        raise CLIError(str(e)) from None
    cfg = load_app_config(args.app, args.run_config)
    recipe = _recipe(args, cfg.diffusion.resolution)
    data, note = pretrain_data(cfg.dataset, args.limit, args.exclude_val)
    prompts = teacher_prompts(dataclasses.replace(cfg, method="feddifrc"), data.class_names)[
        : data.num_classes
    ]
    try:
        out = pretrain_teacher(
            data.images,
            data.labels,
            prompts,
            out,
            recipe,
            name=args.name,
            data_note=note,
            progress=not args.no_progress,
            force=args.force,
            protected=protected,
        )
    except OutFolderError as e:  # the folder changed while the teacher trained
        raise CLIError(str(e)) from None
    print(out)
    return 0


def pretrain_data(dataset: DatasetConfig, limit: int = 0, exclude_val: bool = False) -> tuple[ImageData, str]:
    """The images a teacher trains on: the public split of ``dataset`` less the validation split
    (``exclude_val``), then a stratified ``limit`` of them (seed 0; 0 = all); and the note that
    says so in the teacher's card (with the images' fingerprint)."""
    import numpy as np
    import torch

    from feddifrc_app.data.holdouts import stratified_subset
    from feddifrc_app.data.images import PUBLIC_SPLIT, ImageData, fingerprint_of
    from feddifrc_app.data.registry import SOURCES, load_dataset

    if not SOURCES[dataset.name].public_val:
        public = ", ".join(repr(n) for n, s in SOURCES.items() if s.public_val)
        raise CLIError(
            f"dataset.name = {dataset.name!r} has no public split to pretrain on: the teacher "
            f"must never see the federated data; use dataset.name = {public}"
        )
    data = load_dataset(dataset, PUBLIC_SPLIT)
    keep = np.arange(len(data))
    if exclude_val:
        if not SOURCES[dataset.name].own_val:
            raise CLIError(
                f"--exclude-val: {dataset.name}'s validation split is its whole public split; "
                "nothing would be left (use dataset.name = 'mnist-5k-pool')"
            )
        keep = np.setdiff1d(keep, _val_positions(dataset))
    if limit > len(keep):
        raise CLIError(f"--limit {limit}: only {len(keep)} images to choose from")
    if limit:
        keep = keep[stratified_subset(data.labels[keep], limit, 0)]
    images, labels = data.images[torch.from_numpy(keep)], data.labels[keep]
    fp = fingerprint_of(data.name, "pretrain", data.class_names, labels, images)
    chosen = ImageData(data.name, "pretrain", images, labels, data.class_names, fp, data.mean, data.std)
    part = "" if len(keep) == len(data) else f"{len(keep)} of "
    note = (
        f"{part}{data.name} '{PUBLIC_SPLIT}' split at {data.image_size} px"
        f"{' (without the validation split)' if exclude_val else ''}: disjoint from the federated "
        f"train and test splits. Images fingerprint {fp}."
    )
    return chosen, note


def _val_positions(dataset: DatasetConfig) -> np.ndarray:
    """Positions, in the public split, of the validation images (mnist-5k-pool: both are sorted
    positions into the same 5,000 digits)."""
    import numpy as np

    from feddifrc_app.data.images import PUBLIC_SPLIT
    from feddifrc_app.data.sources.digits import mnist5k_positions

    _, splits = mnist5k_positions(dataset.name, Path(dataset.data_dir))
    return np.searchsorted(splits[PUBLIC_SPLIT], splits["val"]).astype(np.int64)


def _recipe(args: argparse.Namespace, resolution: int) -> PretrainRecipe:
    try:
        return PretrainRecipe(
            seed=args.seed,
            family=args.family,
            resolution=resolution,
            batch_size=args.batch_size,
            vae_steps=args.vae_steps,
            unet_steps=args.unet_steps,
        )
    except ValueError as e:
        raise CLIError(str(e)) from None
