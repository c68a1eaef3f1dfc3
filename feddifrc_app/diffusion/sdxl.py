"""SDXL (``StableDiffusionXLPipeline``): UNet2DConditionModel with two CLIP text encoders (their
penultimate hidden states concatenated), the second one's pooled projection and the added
time ids as ``added_cond_kwargs``; DDPM noise. Features: ``unet.up_blocks[i]`` and the mid-block, as SD's."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from feddifrc_app.diffusion import sd
from feddifrc_app.diffusion.family import Conditioning

PIPELINES = ("StableDiffusionXLPipeline",)
LOAD_KWARGS: dict[str, Any] = {}
DENOISER, LAYER_COUNT_KEY = "unet", "up_block_types"
LAYER_ATTR = "up_blocks"
LAYER_NAME = "unet.up_blocks"
MID_ATTR = sd.MID_ATTR
TEXT_PARTS = ("text_encoder", "text_encoder_2")
# bf16 where native: SDXL's activations can leave fp16's range; fp32 VAE under fp16, as diffusers
AUTO_BF16 = True
VAE_FORCE_UPCAST = True
SHORTCUTS = True
noise_coeffs = sd.noise_coeffs
layer_widths = sd.layer_widths
mid_width = sd.mid_width
pool = sd.pool


def default_layers(n: int) -> tuple[int, ...]:
    """All of SDXL's three decoder blocks (1280, 640, 320 channels)."""
    return tuple(range(n))[-3:]


def token_width(pipe, denoiser) -> int:
    return int(denoiser.config.cross_attention_dim)


def parts(pipe) -> dict[str, Any]:
    """The pipeline: prompts are encoded with its own ``encode_prompt``."""
    return {"pipe": pipe}


def encode_prompts(teacher, prompts: tuple[str, ...], resolution: int) -> Conditioning:
    """The pipeline's own ``encode_prompt`` (no guidance) and ``_get_add_time_ids`` for an
    uncropped ``resolution`` x ``resolution`` image."""
    pipe = teacher.parts["pipe"]
    tokens, _, pooled, _ = pipe.encode_prompt(
        list(prompts), device=teacher.device, num_images_per_prompt=1, do_classifier_free_guidance=False
    )
    size = (int(resolution), int(resolution))
    time_ids = pipe._get_add_time_ids(
        size,
        (0, 0),
        size,
        dtype=teacher.dtype,
        text_encoder_projection_dim=int(pipe.text_encoder_2.config.projection_dim),
    )
    P = len(prompts)
    extras = {"text_embeds": pooled.to(teacher.dtype), "time_ids": time_ids.to(teacher.device).repeat(P, 1)}
    return Conditioning(tokens.to(teacher.dtype), extras)


def denoise(teacher, sample: Tensor, step: Tensor, cond: Conditioning) -> None:
    teacher.unet(sample, step, encoder_hidden_states=cond.tokens, added_cond_kwargs=dict(cond.extras))
