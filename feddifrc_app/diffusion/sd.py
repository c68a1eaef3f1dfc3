"""Stable Diffusion 1.x / 2.x (``StableDiffusionPipeline``): UNet2DConditionModel, one CLIP text
encoder, DDPM noise. Features: the decoder blocks ``unet.up_blocks[i]`` and the mid-block
(``family.MID_BLOCK``), mean-pooled or grid-pooled (``family.pool_map``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from feddifrc_app.diffusion.family import Conditioning, ddpm_coeffs, pool_map

PIPELINES = ("StableDiffusionPipeline",)
LOAD_KWARGS = {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False}
DENOISER, LAYER_COUNT_KEY = "unet", "up_block_types"
LAYER_ATTR = "up_blocks"
LAYER_NAME = "unet.up_blocks"
MID_ATTR = "mid_block"
TEXT_PARTS = ("text_encoder",)
# StableDiffusionPipeline never reads the VAE's force_upcast (SD 2.1's config sets it)
AUTO_BF16 = False
VAE_FORCE_UPCAST = False
SHORTCUTS = True  # a UNet: the shortcuts in speed.py are checked on it


def default_layers(n: int) -> tuple[int, ...]:
    """The paper's decoder blocks 2, 3, 4 (diffusers ``up_blocks[1, 2, 3]``) of SD's four."""
    return tuple(range(1, n))[-3:]


def layer_widths(denoiser) -> tuple[int, ...]:
    return tuple(int(b.resnets[-1].out_channels) for b in denoiser.up_blocks)


def mid_width(denoiser) -> int:
    return int(denoiser.mid_block.resnets[-1].out_channels)


def token_width(pipe, denoiser) -> int:
    return int(pipe.text_encoder.config.hidden_size)


def parts(pipe) -> dict[str, Any]:
    """Nothing of the pipeline: SD encodes its prompts with the CLIP encoder itself (``encode_clip``)."""
    return {}


def encode_clip(tokenizer, text_encoder, prompts: tuple[str, ...]) -> Tensor:
    """``(P, L, D)`` last hidden states, prompts padded to the tokenizer's max length as SD does."""
    device = next(text_encoder.parameters()).device
    ids = tokenizer(
        list(prompts),
        padding="max_length",
        max_length=tokenizer.model_max_length,
        truncation=True,
        return_tensors="pt",
    ).input_ids.to(device)
    return text_encoder(ids)[0]


def encode_prompts(teacher, prompts: tuple[str, ...], resolution: int) -> Conditioning:
    return Conditioning(encode_clip(teacher.tokenizer, teacher.text_encoder, prompts).to(teacher.dtype))


def noise_coeffs(teacher, timestep: int) -> tuple[float, float, Tensor]:
    a, b = ddpm_coeffs(teacher.alphas_cumprod, timestep)
    return a, b, torch.tensor(int(timestep), dtype=torch.long, device=teacher.device)


def denoise(teacher, sample: Tensor, step: Tensor, cond: Conditioning) -> None:
    teacher.unet(sample, step, encoder_hidden_states=cond.tokens)


def pool(output, grid: tuple[int, int], cells: int = 0) -> Tensor:
    h = output[0] if isinstance(output, tuple) else output
    return pool_map(h, cells)
