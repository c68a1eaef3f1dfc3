"""``feddifrc pretrain-teacher``: train the tiny teacher of ``pretrain_recipe.py`` and write it as a
diffusers pipeline folder, atomically, with a ``feddifrc.json`` (the recipe, the losses, every
file's sha256: the loader verifies them) and a model card. The output folder is checked before
training and again at the swap, so no one's files are replaced by accident.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from feddifrc_app.diffusion.digests import folder_digests
from feddifrc_app.diffusion.pipeline import PRETRAINED_KIND
from feddifrc_app.diffusion.tiny import MARKER, quiet, save_tiny_pipeline
from feddifrc_app.files import atomic_folder, stale_siblings
from feddifrc_app.tools.pretrain_numbers import FAMILIES, PretrainRecipe
from feddifrc_app.tools.pretrain_recipe import train_teacher

__all__ = ["FAMILIES", "OutFolderError", "PretrainRecipe", "check_out_folder", "pretrain_teacher"]
__all__ += ["remove_stale_temp", "untrained"]

log = logging.getLogger("flwr.feddifrc")
DEFAULT_RECIPE = PretrainRecipe()  # every field at its default


# --------------------------------------------------------------------------- the output folder

TEMP_TAG = "pretrain-"  # .<out>.pretrain-tmp-<pid>-<hex>: how this command finds its own leftovers


class OutFolderError(ValueError):
    """``out`` is not a folder pretrain-teacher may replace (one line, naming it and the fix)."""


def _foreign_files(folder: Path) -> list[str]:
    """Files in ``folder`` that no pretrain-teacher wrote: all of them unless its ``feddifrc.json``
    says pretrain made the folder, else those its checksum list and card do not cover."""
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if not p.is_dir())
    try:
        marker = json.loads((folder / MARKER).read_text())
        ours = set(marker["files"]) if marker.get("kind") == PRETRAINED_KIND else set()
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        ours = set()
    if not ours:
        return files
    return [f for f in files if f not in ours and f not in (MARKER, "README.md")]


def _protected(extra: Sequence[Path]) -> list[tuple[Path, str]]:
    """Folders whose loss would be someone else's work: --out may be none of them nor hold one."""
    from feddifrc_app.diffusion.pipeline import _installed_package_dir

    return [
        (Path.cwd().resolve(), "the current working directory"),
        (Path.home().resolve(), "the home folder"),
        (Path(__file__).resolve().parents[1], "the feddifrc_app package"),
        (_installed_package_dir(), "the installed feddifrc_app package"),
        *((Path(p).expanduser().resolve(), "the app folder") for p in extra),
    ]


def check_out_folder(out: Path, force: bool = False, protected: Sequence[Path] = ()) -> None:
    """Refuse an ``out`` that pretrain-teacher must not replace (it swaps the whole folder in).

    Allowed: a missing or empty folder, or one this command wrote (its ``feddifrc.json`` lists
    every file there); any other folder only with ``force``. Never, even with ``force``: a file,
    the working directory, the home folder, or a folder holding the app or the package.
    """
    out = Path(out).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise OutFolderError(
            f"output folder {out} is a file, not a folder; pass a missing or empty folder path"
        )
    above = next((p for p in out.parents if p.exists()), None)
    if above is not None and not above.is_dir():  # found now, not after the training
        raise OutFolderError(f"output folder {out} is under {above}, a file; pass a folder path")
    for p, what in _protected(protected):
        if out == p or out in p.parents:
            raise OutFolderError(
                f"output folder {out} {'is' if out == p else 'holds'} {what} ({p}); pretrain-teacher "
                f"replaces the whole folder: pass a new subfolder, e.g. {out / 'tiny-teacher'}"
            )
    if not out.is_dir() or force:
        return
    foreign = _foreign_files(out)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise OutFolderError(
            f"output folder {out} holds files pretrain-teacher did not write ({shown}) and would be "
            "replaced as a whole; pass a missing or empty folder, or --force to replace it"
        )


def remove_stale_temp(out: Path) -> None:
    """Remove the temp folders a killed pretraining into ``out`` left (named by :data:`TEMP_TAG`).

    A moved-aside previous teacher is put back when ``out`` is missing (killed mid-swap),
    else removed: the swap that moved it had finished."""
    out = Path(out).expanduser().resolve()
    tmps, olds = stale_siblings(out, TEMP_TAG)
    for p in tmps:
        log.warning("removing %s, left by a killed pretrain-teacher", p)
        shutil.rmtree(p, ignore_errors=True)
    for p in olds:
        if not out.exists():
            log.warning("restoring %s to %s (a killed pretrain-teacher had moved it aside)", p, out)
            os.replace(p, out)
        else:
            log.warning("removing %s, the replaced teacher a killed pretrain-teacher left", p)
            shutil.rmtree(p, ignore_errors=True)


def pretrain_teacher(
    images: torch.Tensor,
    labels: np.ndarray,
    class_prompts: Sequence[str],
    out: Path,
    recipe: PretrainRecipe = DEFAULT_RECIPE,
    *,
    name: str = "tiny-teacher",
    data_note: str = "",
    progress: bool = True,
    force: bool = False,
    protected: Sequence[Path] = (),
) -> Path:
    """Train the tiny teacher on ``images`` (uint8 (N, 3, H, W)) labelled ``labels`` (0..K-1)
    under ``class_prompts`` (K, label order) and write it to ``out`` atomically.

    The folder is built next to ``out`` and swapped in whole, so a killed run leaves no
    partial teacher and an existing ``out`` is replaced only once the new one is complete.
    ``out`` must pass :func:`check_out_folder` (before training and again at the swap);
    leftovers of a killed earlier pretraining into ``out`` are removed first.
    ``feddifrc.json`` records the recipe, the training losses and a sha256 of every file
    (the loader checks them); ``README.md`` is the model card.
    """
    labels_t = _check_data(images, labels, class_prompts)
    out = Path(out).expanduser().resolve()
    check_out_folder(out, force, protected)
    remove_stale_temp(out)
    t_start = time.perf_counter()
    pipe, training = train_teacher(images, labels_t, class_prompts, recipe, progress)
    # The folder may have changed during training: check again at the swap.
    recheck = lambda p: check_out_folder(p, force, protected)  # noqa: E731
    with atomic_folder(out, TEMP_TAG, recheck) as tmp:
        if recipe.family == "sd":
            save_tiny_pipeline(pipe, tmp)  # + the vocab.json/merges.txt pair of SD folders
        else:
            with quiet():
                pipe.save_pretrained(tmp, safe_serialization=True)
        data = {
            "images": int(len(images)),
            "per_class": np.bincount(labels_t.numpy(), minlength=len(class_prompts)).tolist(),
            "note": data_note,
        }
        training["seconds"] = round(time.perf_counter() - t_start, 1)
        marker = _marker(tmp, name, recipe, class_prompts, data, training)
        (tmp / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
        (tmp / "README.md").write_text(_card(marker))
    return out


def _check_data(images: torch.Tensor, labels: np.ndarray, class_prompts: Sequence[str]) -> torch.Tensor:
    """``labels`` as int64, once images, labels and prompts fit together (else a ValueError)."""
    labels_t = torch.as_tensor(np.asarray(labels), dtype=torch.int64)
    k = len(class_prompts)
    if images.dtype != torch.uint8 or images.ndim != 4 or len(images) != len(labels_t) or len(images) == 0:
        raise ValueError(
            f"images must be uint8 (N, 3, H, W) with N = len(labels) > 0, got {images.dtype} "
            f"{tuple(images.shape)} and {len(labels_t)} labels"
        )
    if k < 1 or int(labels_t.min()) < 0 or int(labels_t.max()) >= k:
        raise ValueError(f"labels must lie in 0..{k - 1} (one prompt per class)")
    if "" in class_prompts:
        raise ValueError("a class prompt is empty: the empty prompt is the unconditional one")
    return labels_t


def untrained(recipe: PretrainRecipe) -> bool:
    """A denoiser whose learning rate never left its warm-up (``unet_steps <= unet_warmup``; 0 steps
    is the untrained initialisation) is labelled random weights: a control, never evidence."""
    return recipe.unet_steps <= recipe.unet_warmup


def _marker(
    folder: Path,
    name: str,
    recipe: PretrainRecipe,
    class_prompts: Sequence[str],
    data: dict[str, Any],
    training: dict[str, Any],
) -> dict[str, Any]:
    """``feddifrc.json``: what the loader checks (kind, files' sha256) and how it was made."""
    return {
        "kind": PRETRAINED_KIND,
        "model_id": name,
        "random_weights": untrained(recipe),
        "resolution": recipe.resolution,
        "recipe": asdict(recipe),
        "prompts": [*class_prompts, ""],
        "data": data,
        "training": training,
        "files": folder_digests(folder),
    }


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def _card(m: dict[str, Any]) -> str:
    r, tr = m["recipe"], m["training"]
    sd = r.get("family", "sd") == "sd"
    cls = "StableDiffusionPipeline" if sd else "PixArtAlphaPipeline"
    net = (
        "UNet2DConditionModel (32, 64, 64, 64)"
        if sd
        else "PixArtTransformer2DModel (8 blocks x 128, patch 1)"
    )
    text = (
        "a frozen, seeded random tiny CLIP text encoder; byte-level BPE tokenizer"
        if sd
        else "a frozen, seeded random tiny T5 encoder (2 layers, 64 wide); unigram tokenizer"
    )
    kind = (
        "trained"
        if not m["random_weights"]
        else "UNTRAINED (random weights: a control, never evidence that FedDifRC helps)"
    )
    return f"""# {m["model_id"]}: a tiny latent text-to-image teacher, {kind}

A diffusers `{cls}` folder written by `feddifrc pretrain-teacher`
(`feddifrc_app/tools/pretrain.py`). Load it with `diffusion.model = "<this folder>"`.

## Data
{m["data"]["images"]} images, per class {m["data"]["per_class"]}. {m["data"]["note"]}
Prompts (label order, then the empty prompt used for {r["empty_prompt_rate"]:.0%} of samples):
{", ".join(repr(p) for p in m["prompts"])}

## Recipe (seed {r["seed"]})
- Input {r["resolution"]}x{r["resolution"]} in [-1, 1]; VAE AutoencoderKL 16/32/32, x4 -> 8x8x4 latent:
  {r["vae_steps"]} steps of {r["batch_size"]}, MSE + {r["kl_weight"]:g} KL, AdamW {r["vae_lr"]:g} \
cosine to {r["vae_lr_end"]:g}.
- Latents: posterior mean x scaling_factor = 1/std = {tr["scaling_factor"]:.4f}.
- {net}, v-prediction: {r["unet_steps"]} steps of {r["batch_size"]},
  AdamW {r["unet_lr"]:g} (wd {r["weight_decay"]:g}), {r["unet_warmup"]} warm-up steps, \
cosine to {r["unet_lr_end"]:g},
  grad clip 1, EMA {r["ema_decay"]} (the saved weights).
- Text: {text}.
- Scheduler: DDIM, SD's scaled_linear betas (0.00085-0.012, 1000 steps), v_prediction.

## Training
VAE loss (mean of the last 50 steps) {_fmt(tr["vae_loss_last50"])}; denoiser v-loss, mean of the first 50
steps {_fmt(tr["unet_loss_first50"])}, of the last 50 {_fmt(tr["unet_loss_last50"])}; \
{tr["seconds"]} s (torch {tr["torch"]}).

## Integrity
`feddifrc.json` holds the sha256 of every file; the app refuses a folder whose files do not match.
"""
