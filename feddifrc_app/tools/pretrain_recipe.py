"""The recipe of ``feddifrc pretrain-teacher`` (its numbers and networks) and the training it runs.

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

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from feddifrc_app.diffusion.featurizer import encode_prompts, to_unit_range
from feddifrc_app.diffusion.tiny import SD_SCHEDULER, tiny_text_encoder
from feddifrc_app.diffusion.tiny_zoo import PIXART_BLOCKS, tiny_t5
from feddifrc_app.tools.pretrain_numbers import PretrainRecipe  # torch-free, for --help

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


@dataclass(frozen=True)
class _Denoising:
    """What the denoiser learns from: scaled latents ``(N, 4, h, w)`` and their labels, the prompt
    states ``emb`` (K + 1, L, D), the empty prompt last (PixArt: and their ``mask`` (K + 1, L)),
    and the noise schedule."""

    latents: torch.Tensor
    labels: torch.Tensor
    emb: torch.Tensor
    mask: torch.Tensor | None
    scheduler: object


def _train_unet(unet, d: _Denoising, r: PretrainRecipe, gen: torch.Generator, progress: bool):
    """v-prediction training of the denoiser (UNet, or PixArt's DiT with the prompts' mask);
    returns (EMA model, losses)."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    latents, labels, emb, mask, scheduler = d.latents, d.labels, d.emb, d.mask, d.scheduler
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


def train_teacher(
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
    data = _Denoising(lat * scale, labels, emb, mask, scheduler)
    model, unet_losses = _train_unet(model, data, r, gen, progress)
    pipe.register_modules(**{"unet" if r.family == "sd" else "transformer": model})
    training = {
        "vae_loss_last50": _mean_tail(vae_losses),
        "unet_loss_first50": _mean_tail(unet_losses[:50]),
        "unet_loss_last50": _mean_tail(unet_losses),
        "scaling_factor": scale,
        "torch": torch.__version__,
    }
    return pipe, training
