"""``feddifrc pretrain-teacher``: the tiny text-to-image teacher, trained on the public split."""

from __future__ import annotations

import argparse
import dataclasses

from feddifrc_app.casting import resolve_path
from feddifrc_app.diffusion.recipe_numbers import FAMILIES, PretrainRecipe  # torch-free
from feddifrc_app.tools.cmd_common import CLIError, examples
from feddifrc_app.tools.run_config import load_app_config


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
    p.add_argument("--name", default="tiny-mnist", help="model id recorded in the folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    examples(
        p,
        "feddifrc pretrain-teacher --out ~/teachers/tiny-mnist-seed1 --seed 1",
        "feddifrc pretrain-teacher --out ~/teachers/tiny-pixart --family pixart",
    )


def cmd_pretrain(args: argparse.Namespace) -> int:
    from feddifrc_app.data.images import PUBLIC_SPLIT
    from feddifrc_app.data.registry import load_dataset
    from feddifrc_app.diffusion.pretrain import (
        OutFolderError,
        check_out_folder,
        pretrain_teacher,
    )
    from feddifrc_app.methods.feddifrc.prompts import teacher_prompts

    protected, out = [resolve_path(args.app, "--app")], resolve_path(args.out, "--out")
    try:  # before anything is loaded or trained
        check_out_folder(out, args.force, protected)
    except OutFolderError as e:
        raise CLIError(str(e)) from None
    cfg = load_app_config(args.app, args.run_config)
    if cfg.dataset.name != "mnist-5k":
        raise CLIError(
            f"dataset.name = {cfg.dataset.name!r} has no public split to pretrain on: the teacher "
            "must never see the federated data; use dataset.name = 'mnist-5k'"
        )
    recipe = _recipe(args, cfg.diffusion.resolution)
    data = load_dataset(cfg.dataset, PUBLIC_SPLIT)
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
            data_note=f"{data.name} '{PUBLIC_SPLIT}' split at {data.image_size} px: disjoint from "
            "the federated train and test splits.",
            progress=not args.no_progress,
            force=args.force,
            protected=protected,
        )
    except OutFolderError as e:  # the folder changed while the teacher trained
        raise CLIError(str(e)) from None
    print(out)
    return 0


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
