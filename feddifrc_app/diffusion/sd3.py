"""Stable Diffusion 3 / 3.5 (``StableDiffusion3Pipeline``): SD3Transformer2DModel (MMDiT) on
two CLIP encoders and T5 (the pipeline's ``encode_prompt``: joint tokens and pooled
projections); rectified-flow noise as its FlowMatchEulerDiscreteScheduler defines it,
``x_t = (1 - sigma) x0 + sigma eps`` with the model timestep ``sigma * T``. Features: the
image-token outputs of ``transformer.transformer_blocks[i]``, on the patch grid, pooled there;
``diffusion.dit-features`` reads them through the next block's ``norm1`` (``modulation``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from feddifrc_app.diffusion import pixart
from feddifrc_app.diffusion.family import Conditioning, pool_tokens

PIPELINES = ("StableDiffusion3Pipeline",)
LOAD_KWARGS: dict[str, Any] = {}
DENOISER, LAYER_COUNT_KEY = "transformer", "num_layers"
LAYER_ATTR = "transformer_blocks"
LAYER_NAME = "transformer.transformer_blocks"
MID_ATTR = None  # a DiT has no mid-block
TEXT_PARTS = ("text_encoder", "text_encoder_2", "text_encoder_3")
# bf16 where native (as SD3 is commonly run); its pipelines never read force_upcast
AUTO_BF16 = True
VAE_FORCE_UPCAST = False
SHORTCUTS = False
DIT_COND_ATTR = "time_text_embed"  # its output: temb, what every AdaLN of the model reads
MAX_TOKENS = 256  # the pipeline's default T5 length
# the same layer rule and widths as PixArt's DiT (SD3-medium's 24 blocks: 11, 17, 23)
default_layers = pixart.default_layers
layer_widths = pixart.layer_widths


def flow_sigmas(scheduler) -> tuple[Tensor, Tensor]:
    """``(sigmas, timesteps)`` of the scheduler's training grid, ascending: index t is diffusion.timestep
    t (t = 0 the least noise, T - 1 pure noise), with the scheduler's shift applied."""
    sig = scheduler.sigmas[: scheduler.config.num_train_timesteps].flip(0)
    ts = scheduler.timesteps[: scheduler.config.num_train_timesteps].flip(0)
    return sig.to("cpu", torch.float64), ts.to("cpu", torch.float32)


def token_width(pipe, denoiser) -> int:
    return int(denoiser.config.joint_attention_dim)


def parts(pipe) -> dict[str, Any]:
    """The pipeline (its ``encode_prompt``) and the flow-matching grid."""
    sigmas, timesteps = flow_sigmas(pipe.scheduler)
    return {"pipe": pipe, "sigmas": sigmas, "timesteps": timesteps}


def noise_coeffs(teacher, timestep: int) -> tuple[float, float, Tensor]:
    sigmas, steps = teacher.parts["sigmas"], teacher.parts["timesteps"]
    s = float(sigmas[int(timestep)])
    # float32 as the pipeline passes it (sigma * 1000 in fp16 would round to 0.5)
    return 1.0 - s, s, steps[int(timestep)].to(teacher.device)


def encode_prompts(teacher, prompts: tuple[str, ...], resolution: int) -> Conditioning:
    pipe = teacher.parts["pipe"]
    tokens, _, pooled, _ = pipe.encode_prompt(
        list(prompts),
        None,
        None,
        device=teacher.device,
        num_images_per_prompt=1,
        do_classifier_free_guidance=False,
        max_sequence_length=MAX_TOKENS,
    )
    return Conditioning(tokens.to(teacher.dtype), {"pooled_projections": pooled.to(teacher.dtype)})


def denoise(teacher, sample: Tensor, step: Tensor, cond: Conditioning) -> None:
    teacher.unet(
        hidden_states=sample,
        encoder_hidden_states=cond.tokens,
        pooled_projections=cond.extras["pooled_projections"],
        timestep=step.expand(int(sample.shape[0])),
    )


def image_tokens(output) -> Tensor:
    """A joint block returns ``(text tokens, image tokens)`` (the last one ``(None, image tokens)``)."""
    return output[1] if isinstance(output, tuple) else output


def pool(output, grid: tuple[int, int], cells: int = 0) -> Tensor:
    return pool_tokens(image_tokens(output), grid, cells)


def modulation(denoiser, b: int, temb: Tensor) -> tuple[Tensor, Tensor, float]:
    """``(shift, scale, eps)`` with which the network normalises block b's image tokens: block
    b + 1's ``norm1`` (``AdaLayerNormZero``, or SD3.5's ``SD35AdaLayerNormZeroX``: its first two
    chunks, shift_msa and scale_msa), or for the last block ``norm_out``
    (``AdaLayerNormContinuous``: scale, then shift)."""
    blocks = denoiser.transformer_blocks
    if b + 1 < len(blocks):
        norm = blocks[b + 1].norm1
        emb = norm.linear(norm.silu(temb))
        shift, scale = emb.chunk(emb.shape[1] // denoiser.inner_dim, dim=1)[:2]
        return shift, scale, float(norm.norm.eps)
    norm = denoiser.norm_out
    scale, shift = norm.linear(norm.silu(temb)).chunk(2, dim=1)
    return shift, scale, float(norm.norm.eps)
