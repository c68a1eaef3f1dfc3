"""Pretrain a tiny latent text-to-image teacher on a CPU, saved as a diffusers pipeline folder.

The result is a standard diffusers ``StableDiffusionPipeline`` folder (``family = "sd"``, the
packaged ``tiny-mnist``) or ``PixArtAlphaPipeline`` folder (``family = "pixart"``: the same
recipe with a DiT, ``TEACHER_DIT``, in place of the UNet and a frozen random tiny T5 in place of
CLIP) that ``diffusion.model = <folder>`` loads like any checkpoint of its family. The recipe:

1. VAE (``TEACHER_VAE``, 32x32x3 -> 8x8x4): pixel MSE + ``KL_WEIGHT`` x KL, AdamW, cosine
   learning rate, gradient clip 1.
2. Latents: every image's posterior mean; ``scaling_factor`` = 1 / their std (written into
   the VAE config, so t = 300 means the same noise level as for SD).
3. UNet (``TEACHER_UNET``, 2.1 M parameters), v-prediction as in SD-2.x: with the epsilon
   objective a model this small ignores the prompt within a CPU budget (epsilon loss barely
   weighs the high-t errors where the class matters). Class prompts in label order,
   ``EMPTY_PROMPT_RATE`` of the samples on the empty (unconditional) prompt, uniform
   timesteps, warm-up then cosine learning rate, an EMA of the weights (the saved UNet).
4. Text encoder: the embedded tiny model's seeded random CLIP, frozen.

Steps, not wall time, bound each phase, so the same seed and data give the same teacher.
``unet_steps = vae_steps = 0`` writes the untrained initialisation (scaling factor still
measured on the data): the random-weight control that differs from the teacher in its
weights alone.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from feddifrc_app.diffusion.digests import folder_digests
from feddifrc_app.diffusion.featurizer import encode_prompts, to_unit_range
from feddifrc_app.diffusion.pipeline import PRETRAINED_KIND
from feddifrc_app.diffusion.tiny import MARKER, SD_SCHEDULER, quiet, save_tiny_pipeline, tiny_text_encoder
from feddifrc_app.diffusion.tiny_zoo import PIXART_BLOCKS, tiny_t5
from feddifrc_app.files import atomic_folder, stale_siblings

log = logging.getLogger("flwr.feddifrc")

KL_WEIGHT = 1e-7
EMPTY_PROMPT_RATE = 0.1

TEACHER_VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 3,  # two downsamples: factor 4
    up_block_types=("UpDecoderBlock2D",) * 3,
    block_out_channels=(16, 32, 32),
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=16,
    sample_size=32,
)
# up_blocks are block_out_channels reversed: widths 64, 64, 64, 32; the default blocks
# 1, 2, 3 give 64 + 64 + 32 pooled channels.
TEACHER_UNET = dict(
    sample_size=8,
    in_channels=4,
    out_channels=4,
    layers_per_block=1,
    block_out_channels=(32, 64, 64, 64),
    down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
    up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
    cross_attention_dim=32,
    attention_head_dim=8,
    norm_num_groups=16,
)


# A PixArt DiT of about the UNet's size (2.1 M parameters) on the same 8x8x4 latent, one token
# per latent pixel (patch 1: 64 tokens); default blocks 3, 5, 7 -> 128-wide features.
TEACHER_DIT = dict(
    sample_size=8,
    patch_size=1,
    in_channels=4,
    out_channels=4,
    num_layers=8,
    attention_head_dim=32,
    num_attention_heads=4,
    cross_attention_dim=128,
    caption_channels=64,  # tiny_zoo.TINY_T5 d_model
    **PIXART_BLOCKS,
)
FAMILIES = ("sd", "pixart")  # what pretrain-teacher trains (diffusers pipeline families)


@dataclass(frozen=True)
class PretrainRecipe:
    """Every number that shapes the teacher (recorded in the folder's ``feddifrc.json``)."""

    seed: int = 0
    family: str = "sd"  # sd: UNet + CLIP (tiny-mnist); pixart: DiT + T5
    resolution: int = 32
    batch_size: int = 64
    vae_steps: int = 300
    vae_lr: float = 1e-3
    vae_lr_end: float = 2e-4
    unet_steps: int = 1200
    unet_lr: float = 1e-3
    unet_lr_end: float = 1e-4
    unet_warmup: int = 100
    weight_decay: float = 1e-2
    ema_decay: float = 0.995
    empty_prompt_rate: float = EMPTY_PROMPT_RATE
    kl_weight: float = KL_WEIGHT

    def __post_init__(self) -> None:
        if self.resolution < 4 or self.resolution % 4:
            raise ValueError(
                f"resolution={self.resolution}: expected a positive multiple of 4 (the VAE factor)"
            )
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r}: expected one of {', '.join(FAMILIES)}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size}: expected >= 1")
        for name in ("vae_steps", "unet_steps", "unet_warmup", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: expected >= 0")
        if not 0.0 <= self.empty_prompt_rate <= 1.0 or not 0.0 <= self.ema_decay < 1.0:
            raise ValueError("empty_prompt_rate must be in [0, 1] and ema_decay in [0, 1)")


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


def _lr_lambda(steps: int, warmup: int, lr: float, lr_end: float) -> Callable[[int], float]:
    """Linear warm-up, then cosine from ``lr`` to ``lr_end`` (as a factor of ``lr``)."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        p = (step - warmup) / max(1, steps - warmup)
        return (lr_end + 0.5 * (lr - lr_end) * (1 + math.cos(math.pi * min(1.0, p)))) / lr

    return f


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="step", disable=not enabled or total == 0, dynamic_ncols=True)


def _train_vae(vae, x: torch.Tensor, r: PretrainRecipe, gen: torch.Generator, progress: bool) -> list[float]:
    opt = torch.optim.AdamW(vae.parameters(), lr=r.vae_lr, weight_decay=r.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(r.vae_steps, 0, r.vae_lr, r.vae_lr_end))
    losses: list[float] = []
    vae.train()
    with _progress(r.vae_steps, "teacher VAE", progress) as bar:
        for _ in range(r.vae_steps):
            batch = x[torch.randint(0, len(x), (r.batch_size,), generator=gen)]
            post = vae.encode(batch).latent_dist
            z = post.mean + post.std * torch.randn(post.mean.shape, generator=gen)
            recon = vae.decode(z).sample
            kl = post.kl().mean()  # summed over the latent, averaged over the batch
            loss = F.mse_loss(recon, batch) + r.kl_weight * kl
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            bar.update()
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
    vae.eval()
    return losses


@torch.no_grad()
def _latents(vae, x: torch.Tensor, batch: int = 256) -> torch.Tensor:
    return torch.cat([vae.encode(x[i : i + batch]).latent_dist.mean for i in range(0, len(x), batch)])


def _train_unet(
    unet,
    latents: torch.Tensor,
    labels: torch.Tensor,
    emb: torch.Tensor,
    scheduler,
    r: PretrainRecipe,
    gen: torch.Generator,
    progress: bool,
    mask: torch.Tensor | None = None,
):
    """v-prediction training of the denoiser (UNet, or PixArt's DiT with the prompts' ``mask``
    (K + 1, L)); returns (EMA model, losses). ``emb``: (K + 1, L, D), the empty prompt last."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    ema = AveragedModel(unet, multi_avg_fn=get_ema_multi_avg_fn(r.ema_decay), use_buffers=True)
    opt = torch.optim.AdamW(unet.parameters(), lr=r.unet_lr, weight_decay=r.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, _lr_lambda(r.unet_steps, r.unet_warmup, r.unet_lr, r.unet_lr_end)
    )
    empty = emb.shape[0] - 1
    n_t = scheduler.config.num_train_timesteps
    losses: list[float] = []
    unet.train()
    with _progress(r.unet_steps, "teacher UNet", progress) as bar:
        for _ in range(r.unet_steps):
            i = torch.randint(0, len(latents), (r.batch_size,), generator=gen)
            l0, y = latents[i], labels[i]
            drop = torch.rand(r.batch_size, generator=gen) < r.empty_prompt_rate
            which = torch.where(drop, torch.full_like(y, empty), y)
            cond = emb[which]
            t = torch.randint(0, n_t, (r.batch_size,), generator=gen)
            noise = torch.randn(l0.shape, generator=gen)
            noisy = scheduler.add_noise(l0, noise, t)
            target = scheduler.get_velocity(l0, noise, t)
            loss = F.mse_loss(_predict(unet, noisy, t, cond, None if mask is None else mask[which]), target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
            opt.step()
            sched.step()
            ema.update_parameters(unet)
            losses.append(loss.item())
            bar.update()
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
    out = ema.module if r.unet_steps > 0 else unet
    out.eval()
    return out, losses


def _predict(model, noisy: torch.Tensor, t: torch.Tensor, cond: torch.Tensor, mask: torch.Tensor | None):
    if mask is None:  # UNet2DConditionModel
        return model(noisy, t, encoder_hidden_states=cond).sample
    return model(noisy, encoder_hidden_states=cond, encoder_attention_mask=mask, timestep=t).sample


def _mean_tail(xs: Sequence[float], n: int = 50) -> float | None:
    return float(np.mean(xs[-n:])) if xs else None


def _untrained(r: PretrainRecipe):
    """(pipeline of the recipe's family at initialisation, its denoiser, scheduler): seeded."""
    import diffusers

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(r.seed)
        vae = diffusers.AutoencoderKL(**TEACHER_VAE)
        torch.manual_seed(r.seed + 1)
        model = (
            diffusers.UNet2DConditionModel(**TEACHER_UNET)
            if r.family == "sd"
            else diffusers.PixArtTransformer2DModel(**TEACHER_DIT)
        )
    scheduler = diffusers.DDIMScheduler(
        **{k: v for k, v in SD_SCHEDULER.items() if k != "skip_prk_steps"},
        clip_sample=False,
        prediction_type="v_prediction",
    )
    if r.family == "sd":
        # The text side is the embedded tiny model's (seed 2 there): one tokenizer for both tiny teachers.
        tokenizer, text_encoder = tiny_text_encoder(2)
        pipe = diffusers.StableDiffusionPipeline(
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            unet=model,
            scheduler=scheduler,
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
    else:  # the tiny random T5 of tiny-pixart (seed 2 as for CLIP)
        tokenizer, text_encoder = tiny_t5(2)
        pipe = diffusers.PixArtAlphaPipeline(
            tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=model, scheduler=scheduler
        )
    text_encoder.requires_grad_(False).eval()
    return pipe, model, scheduler


def _prompt_states(pipe, family: str, prompts: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(K + 1, L, D) prompt states (and PixArt's mask) exactly as the featurizer encodes them."""
    with torch.no_grad():
        if family == "sd":
            return encode_prompts(pipe.tokenizer, pipe.text_encoder, prompts).float(), None
        emb, mask, _, _ = pipe.encode_prompt(
            list(prompts), do_classifier_free_guidance=False, device=torch.device("cpu"), clean_caption=False
        )
        return emb.float(), mask


def _train(
    images: torch.Tensor,
    labels: torch.Tensor,
    class_prompts: Sequence[str],
    r: PretrainRecipe,
    progress: bool,
):
    """The recipe (module docstring) -> (pipeline of ``r.family``, training record)."""
    gen = torch.Generator().manual_seed(r.seed)
    pipe, model, scheduler = _untrained(r)
    vae = pipe.vae
    x = to_unit_range(images, r.resolution)
    vae_losses = _train_vae(vae, x, r, gen, progress)
    lat = _latents(vae, x)
    scale = 1.0 / float(lat.std())
    vae.register_to_config(scaling_factor=scale)
    emb, mask = _prompt_states(pipe, r.family, (*class_prompts, ""))
    model, unet_losses = _train_unet(model, lat * scale, labels, emb, scheduler, r, gen, progress, mask)
    pipe.register_modules(**{"unet" if r.family == "sd" else "transformer": model})
    training = {
        "vae_loss_last50": _mean_tail(vae_losses),
        "unet_loss_first50": _mean_tail(unet_losses[:50]),
        "unet_loss_last50": _mean_tail(unet_losses),
        "scaling_factor": scale,
        "torch": torch.__version__,
    }
    return pipe, training


def pretrain_teacher(
    images: torch.Tensor,
    labels: np.ndarray,
    class_prompts: Sequence[str],
    out: Path,
    recipe: PretrainRecipe = PretrainRecipe(),
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
    pipe, training = _train(images, labels_t, class_prompts, recipe, progress)
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
(`feddifrc_app/diffusion/pretrain.py`). Load it with `diffusion.model = "<this folder>"`.

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
