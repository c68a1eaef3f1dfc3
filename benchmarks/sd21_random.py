"""SD-2.1's architecture with RANDOM weights, built in memory: the cost of an SD-2.1-sized teacher
on a machine with no weights (``benchmarks/featurizer.py --model sd21-random``; its component
configs are also ``full_size``'s SD-2.1)."""

from __future__ import annotations

from pathlib import Path

import torch

from feddifrc_app.diffusion.pipeline import Teacher, load_teacher

# The published SD-2.1 (768-v) component configs, for --model sd21-random.
SD21_UNET = dict(
    sample_size=96,
    in_channels=4,
    out_channels=4,
    layers_per_block=2,
    block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=1024,
    attention_head_dim=(5, 10, 20, 20),
    use_linear_projection=True,
    upcast_attention=True,
    norm_num_groups=32,
)
SD21_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=4,
    layers_per_block=2,
    norm_num_groups=32,
    sample_size=768,
    block_out_channels=(128, 256, 512, 512),
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
)
SD21_TEXT = dict(
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=23,
    num_attention_heads=16,
    max_position_embeddings=77,
    projection_dim=512,
    hidden_act="gelu",
)


def sd21_random_teacher(cache_dir: Path, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Teacher:
    """A RANDOM-weight teacher with SD-2.1's architecture, built in memory (timing only).

    The tokenizer is the tiny model's (the vocabulary size does not change the cost).
    """
    import diffusers.utils.logging as dlog
    from diffusers import AutoencoderKL, PNDMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from feddifrc_app.diffusion.tiny import SD_SCHEDULER

    tok = load_teacher("tiny", cache_dir, torch.device("cpu"), torch.float32).tokenizer
    dlog.set_verbosity_error()  # no "cast with to()" notes for random weights
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        unet = UNet2DConditionModel(**SD21_UNET)
        vae = AutoencoderKL(**SD21_VAE)
        text = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=len(tok),
                bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
                **SD21_TEXT,
            )
        )
    vae.decoder = None
    vae.post_quant_conv = None
    for m in (unet, vae, text):
        m.requires_grad_(False)
        m.eval()
        m.to(device, dtype)
    alphas = PNDMScheduler(**SD_SCHEDULER).alphas_cumprod.to("cpu", torch.float32)
    return Teacher(
        unet=unet,
        vae=vae,
        text_encoder=text,
        tokenizer=tok,
        alphas_cumprod=alphas,
        model_id=f"sd21-random-seed{seed}",
        weights_hash="random",
        random_weights=True,
        device=device,
        dtype=dtype,
        text_width=SD21_TEXT["hidden_size"],
        block_channels=tuple(int(b.resnets[-1].out_channels) for b in unet.up_blocks),
    )
