"""PixArt-alpha / PixArt-Sigma (``PixArtAlphaPipeline`` / ``PixArtSigmaPipeline``):
PixArtTransformer2DModel (a DiT with cross-attention) on a T5 encoder's masked hidden
states; DDPM noise (its scheduler's betas). Features: the token outputs of
``transformer.transformer_blocks[i]``, reshaped to the latent patch grid and pooled there
(``family.pool_map``); no mid-block. ``diffusion.dit-features`` reads them through the next
block's ``ada_norm_single`` modulation (``modulation``, ``dit_features.py``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from feddifrc_app.diffusion import sd, sdxl
from feddifrc_app.diffusion.family import Conditioning, pool_tokens

PIPELINES = ("PixArtAlphaPipeline", "PixArtSigmaPipeline")
LOAD_KWARGS: dict[str, Any] = {}
DENOISER, LAYER_COUNT_KEY = "transformer", "num_layers"
LAYER_ATTR = "transformer_blocks"
LAYER_NAME = "transformer.transformer_blocks"
MID_ATTR = None  # a DiT has no mid-block
TEXT_PARTS = ("text_encoder",)
# PixArt's pipelines run the VAE (SD's) in the pipeline dtype
AUTO_BF16 = False
VAE_FORCE_UPCAST = False
SHORTCUTS = False  # speed.py's shortcuts are the UNet's
DIT_COND_ATTR = "adaln_single"  # its output: (the blocks' 6 D timestep vector, the output layer's D one)
MAX_TOKENS = {"PixArtAlphaPipeline": 120, "PixArtSigmaPipeline": 300}  # the pipelines' defaults
noise_coeffs = sd.noise_coeffs
parts = sdxl.parts


def default_layers(n: int) -> tuple[int, ...]:
    """Three blocks over the second half of the DiT: ``round(n k / 4) - 1`` for k = 2, 3, 4
    (PixArt-XL-2's 28 blocks: 13, 20, 27)."""
    return tuple(sorted({max(0, round(n * k / 4) - 1) for k in (2, 3, 4)}))


def layer_widths(denoiser) -> tuple[int, ...]:
    inner = int(denoiser.config.num_attention_heads * denoiser.config.attention_head_dim)
    return (inner,) * len(denoiser.transformer_blocks)


def token_width(pipe, denoiser) -> int:
    return int(denoiser.config.caption_channels)


def encode_prompts(teacher, prompts: tuple[str, ...], resolution: int) -> Conditioning:
    """The pipeline's own ``encode_prompt`` (no guidance, no caption cleaning): T5 states and mask."""
    pipe = teacher.parts["pipe"]
    tokens, mask, _, _ = pipe.encode_prompt(
        list(prompts),
        do_classifier_free_guidance=False,
        device=teacher.device,
        clean_caption=False,
        max_sequence_length=MAX_TOKENS.get(type(pipe).__name__, 120),
    )
    return Conditioning(tokens.to(teacher.dtype), {"encoder_attention_mask": mask})


def denoise(teacher, sample: Tensor, step: Tensor, cond: Conditioning) -> None:
    rows, size = int(sample.shape[0]), teacher.vae_scale_factor * int(sample.shape[-1])
    extra = {  # used by the 1024 px models (use_additional_conditions), ignored otherwise
        "resolution": torch.tensor([[size, size]], dtype=teacher.dtype, device=teacher.device).repeat(
            rows, 1
        ),
        "aspect_ratio": torch.ones((rows, 1), dtype=teacher.dtype, device=teacher.device),
    }
    teacher.unet(
        sample,
        encoder_hidden_states=cond.tokens,
        encoder_attention_mask=cond.extras["encoder_attention_mask"],
        timestep=step.expand(rows),
        added_cond_kwargs=extra,
    )


def pool(output, grid: tuple[int, int], cells: int = 0) -> Tensor:
    return pool_tokens(output, grid, cells)


def image_tokens(output) -> Tensor:
    return output


def modulation(denoiser, b: int, cond: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, float]:
    """``(shift, scale, eps)`` with which the network normalises block b's output: block b + 1's
    ``scale_shift_table[:2] + t`` (diffusers' ``BasicTransformerBlock``, ``ada_norm_single``:
    shift_msa, scale_msa), or for the last block the output layer's ``scale_shift_table +
    embedded_timestep`` (``PixArtTransformer2DModel``: shift, scale before ``proj_out``)."""
    t, embedded = cond
    blocks = denoiser.transformer_blocks
    if b + 1 < len(blocks):
        nxt = blocks[b + 1]
        mod = nxt.scale_shift_table[None] + t.reshape(int(t.shape[0]), 6, -1)
        return mod[:, 0], mod[:, 1], float(nxt.norm1.eps)
    mod = denoiser.scale_shift_table[None] + embedded[:, None]
    return mod[:, 0], mod[:, 1], float(denoiser.norm_out.eps)
