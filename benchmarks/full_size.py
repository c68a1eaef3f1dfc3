"""The four teacher families at full size, built from their published configs with RANDOM weights.

No download: speed and memory of a random-weight model are those of the real one, its numerics
are not. ``benchmarks/gpu_check.py`` measures these on a GPU; ``small=True`` builds the same
architectures with a few channels and layers (``Family.small``) for a dry run on a CPU.

The configs are diffusers 0.42 / transformers 5 kwargs. Their parameter counts (``PARAMS``,
counted on the meta device) match the published totals: SD-2.1 UNet 865.9 M, SDXL UNet 2.567 B,
PixArt-XL-2 0.611 B, SD3-medium 2.028 B, T5-XXL encoder 4.762 B, OpenCLIP bigG text 694.7 M.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from sd21_random import SD21_TEXT, SD21_UNET, SD21_VAE  # the sibling benchmark: benchmarks/ is on sys.path

from feddifrc_app.diffusion.family import Conditioning, family_module
from feddifrc_app.diffusion.pipeline import Teacher

SDXL_UNET = dict(
    sample_size=128,
    in_channels=4,
    out_channels=4,
    layers_per_block=2,
    block_out_channels=(320, 640, 1280),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    transformer_layers_per_block=(1, 2, 10),
    attention_head_dim=(5, 10, 20),
    cross_attention_dim=2048,
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816,  # pooled bigG text (1280) + 6 time ids x 256
    norm_num_groups=32,
)
SDXL_VAE = dict(SD21_VAE, sample_size=1024, scaling_factor=0.13025, force_upcast=True)
PIXART_XL2_512 = dict(
    num_attention_heads=16,
    attention_head_dim=72,
    in_channels=4,
    out_channels=8,
    num_layers=28,
    cross_attention_dim=1152,
    attention_bias=True,
    sample_size=64,
    patch_size=2,
    activation_fn="gelu-approximate",
    num_embeds_ada_norm=1000,
    norm_type="ada_norm_single",
    norm_elementwise_affine=False,
    norm_eps=1e-6,
    caption_channels=4096,
)
SD3_MEDIUM = dict(
    sample_size=128,
    patch_size=2,
    in_channels=16,
    num_layers=24,
    attention_head_dim=64,
    num_attention_heads=24,
    joint_attention_dim=4096,
    caption_projection_dim=1536,
    pooled_projection_dim=2048,
    out_channels=16,
    pos_embed_max_size=192,
)
SD3_VAE = dict(
    SD21_VAE,
    latent_channels=16,
    use_quant_conv=False,
    use_post_quant_conv=False,
    scaling_factor=1.5305,
    shift_factor=0.0609,
    sample_size=1024,
    force_upcast=True,
)
CLIP_H = dict(SD21_TEXT, vocab_size=49408)  # SD-2.x's OpenCLIP-H text tower (penultimate layer: 23)
CLIP_L = dict(
    vocab_size=49408,
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    projection_dim=768,
    hidden_act="quick_gelu",
)
CLIP_BIGG = dict(
    vocab_size=49408,
    hidden_size=1280,
    intermediate_size=5120,
    num_hidden_layers=32,
    num_attention_heads=20,
    projection_dim=1280,
    hidden_act="gelu",
)
T5_XXL = dict(
    vocab_size=32128,
    d_model=4096,
    d_ff=10240,
    d_kv=64,
    num_heads=64,
    num_layers=24,
    feed_forward_proj="gated-gelu",
    is_encoder_decoder=False,
)

# text encoder -> (transformers class, full-size config, dry-run overrides)
_SMALL_CLIP = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, projection_dim=32
)
TEXT_ENCODERS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "clip-h": ("CLIPTextModel", CLIP_H, _SMALL_CLIP),
    "clip-l": ("CLIPTextModelWithProjection", CLIP_L, _SMALL_CLIP),
    "clip-bigg": ("CLIPTextModelWithProjection", CLIP_BIGG, _SMALL_CLIP),
    "t5-xxl": ("T5EncoderModel", T5_XXL, dict(d_model=32, d_ff=64, d_kv=16, num_heads=2, num_layers=1)),
}
# The VAEs of the dry run keep four levels (factor 8) and their latent channels, shift and scale.
_SMALL_VAE = dict(block_out_channels=(32, 32, 32, 32), layers_per_block=1)


@dataclass(frozen=True)
class Family:
    name: str  # a family in diffusion/family.ADAPTERS
    label: str
    denoiser: str  # diffusers class
    config: dict[str, Any]
    vae: dict[str, Any]
    small: dict[str, Any]  # overrides of ``config`` for the dry run (widths, depths)
    texts: tuple[str, ...]  # the TEXT_ENCODERS an actor of this family holds
    tokens: int  # prompt tokens the denoiser reads: CLIP 77, PixArt-alpha's T5 120, SD3 77 + 256
    gflop: float  # estimated GFLOP per image at 224 px with 11 prompts, default layers (fast path)


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "sd",
            "SD-2.1",
            "UNet2DConditionModel",
            SD21_UNET,
            SD21_VAE,
            dict(
                block_out_channels=(32, 32, 64, 64),
                attention_head_dim=(1, 1, 2, 2),
                cross_attention_dim=32,
                layers_per_block=1,
            ),
            ("clip-h",),
            77,
            1671.0,
        ),
        Family(
            "sdxl",
            "SDXL",
            "UNet2DConditionModel",
            SDXL_UNET,
            SDXL_VAE,
            dict(
                block_out_channels=(32, 64, 64),
                transformer_layers_per_block=(1, 1, 2),
                attention_head_dim=(1, 2, 2),
                cross_attention_dim=32,
                layers_per_block=1,
                addition_time_embed_dim=8,
                projection_class_embeddings_input_dim=32 + 6 * 8,
            ),
            ("clip-l", "clip-bigg"),
            77,
            3435.0,
        ),
        Family(
            "pixart",
            "PixArt-XL-2-512",
            "PixArtTransformer2DModel",
            PIXART_XL2_512,
            SD21_VAE,
            dict(
                num_attention_heads=2,
                attention_head_dim=16,
                num_layers=4,
                cross_attention_dim=32,
                caption_channels=32,
            ),
            ("t5-xxl",),
            120,
            2752.0,
        ),
        Family(
            "sd3",
            "SD3-medium",
            "SD3Transformer2DModel",
            SD3_MEDIUM,
            SD3_VAE,
            dict(
                num_layers=4,
                num_attention_heads=2,
                attention_head_dim=16,
                joint_attention_dim=32,
                caption_projection_dim=32,
                pooled_projection_dim=32,
            ),
            ("clip-l", "clip-bigg", "t5-xxl"),
            77 + 256,
            8476.0,
        ),
    )
}

# Parameter counts of the full-size configs (what ``count_params`` gives on the meta device).
PARAMS: dict[str, int] = {
    "sd": 865_910_724,
    "sdxl": 2_567_463_684,
    "pixart": 610_856_096,
    "sd3": 2_028_328_000,
    "clip-bigg": 694_659_840,
    "t5-xxl": 4_762_310_656,
}


def denoiser(family: str, device: torch.device | str, *, small: bool = False, seed: int = 0):
    """The family's denoiser, built ON ``device`` (float32, random, frozen, eval)."""
    import diffusers

    f = FAMILIES[family]
    cfg = dict(f.config, **f.small) if small else f.config
    torch.manual_seed(seed)
    with torch.device(device):
        m = getattr(diffusers, f.denoiser)(**cfg)
    return m.to(device).requires_grad_(False).eval()  # .to: any buffer made from numpy sits on the CPU


def vae_encoder(family: str, device: torch.device | str, *, small: bool = False, seed: int = 0):
    """The family's VAE with its decoder half dropped, as ``load_teacher`` keeps it."""
    from diffusers import AutoencoderKL

    f = FAMILIES[family]
    cfg = dict(f.vae, **_SMALL_VAE) if small else f.vae
    torch.manual_seed(seed + 1)
    with torch.device(device):
        vae = AutoencoderKL(**cfg)
    vae.decoder = None
    vae.post_quant_conv = None
    return vae.to(device).requires_grad_(False).eval()


def text_encoder(name: str, device: torch.device | str, dtype: torch.dtype, *, small: bool = False):
    """A text encoder of ``TEXT_ENCODERS`` on ``device`` in ``dtype``; T5's ``wo`` stays float32 as
    ``from_pretrained`` keeps it (``_keep_in_fp32_modules``)."""
    import transformers

    cls_name, cfg, shrink = TEXT_ENCODERS[name]
    cls = getattr(transformers, cls_name)
    config_cls = transformers.T5Config if cls_name.startswith("T5") else transformers.CLIPTextConfig
    with torch.device(device):
        m = cls(config_cls(**(dict(cfg, **shrink) if small else cfg)))
    m = m.requires_grad_(False).eval().to(dtype)
    for name_ in getattr(cls, "_keep_in_fp32_modules", None) or ():
        for mod_name, mod in m.named_modules():
            if mod_name.endswith(f".{name_}"):
                mod.float()
    return m


def count_params(part: str) -> int:
    """Parameters of a family's denoiser or a text encoder at full size, built on the meta device."""
    if part in FAMILIES:
        return sum(p.numel() for p in denoiser(part, "meta").parameters())
    return sum(p.numel() for p in text_encoder(part, "meta", torch.float32).parameters())


def teacher(
    family: str,
    device: torch.device,
    dtype: torch.dtype,
    *,
    small: bool = False,
    seed: int = 0,
    vae_dtype: torch.dtype | None = None,
) -> Teacher:
    """A random-weight ``Teacher`` of ``family``: denoiser and VAE encoder built on ``device`` (the
    VAE in ``vae_dtype``, default ``dtype``: the app's is ``family.vae_dtype``), no text encoder
    (prompts come from ``stand_in``), SD's DDPM schedule or SD3's flow-matching grid."""
    import diffusers.utils.logging as dlog
    from diffusers import FlowMatchEulerDiscreteScheduler, PNDMScheduler

    from feddifrc_app.diffusion.tiny import SD_SCHEDULER

    dlog.set_verbosity_error()  # no "cast with to()" notes for random weights
    den = denoiser(family, device, small=small, seed=seed).to(dtype)
    vae = vae_encoder(family, device, small=small, seed=seed).to(vae_dtype or dtype)
    parts: dict[str, Any] = {}
    alphas = torch.empty(0)
    if family == "sd3":
        from feddifrc_app.diffusion.sd3 import flow_sigmas

        sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
        parts["sigmas"], parts["timesteps"] = flow_sigmas(sched)
    else:
        alphas = PNDMScheduler(**SD_SCHEDULER).alphas_cumprod.to("cpu", torch.float32)
    return Teacher(
        unet=den,
        vae=vae,
        text_encoder=None,
        tokenizer=None,
        alphas_cumprod=alphas,
        model_id=f"{family}-random{'-small' if small else ''}-seed{seed}",
        weights_hash="random",
        random_weights=True,
        device=device,
        dtype=dtype,
        text_width=token_width(family, den),
        block_channels=family_module(family).layer_widths(den),
        family=family,
        parts=parts,
    )


def recast(t: Teacher, dtype: torch.dtype, vae_dtype: torch.dtype | None = None) -> Teacher:
    """The same teacher in another dtype, its VAE in ``vae_dtype`` (default ``dtype``); the
    modules are cast in place: ``t`` is then stale."""
    t.unet.to(dtype)
    t.vae.to(vae_dtype or dtype)
    return dataclasses.replace(t, dtype=dtype)


def token_width(family: str, den) -> int:
    """Width of the prompt-token embeddings the denoiser reads (``Teacher.text_width``)."""
    c = den.config
    if family in ("sd", "sdxl"):
        return int(c.cross_attention_dim)
    return int(c.caption_channels if family == "pixart" else c.joint_attention_dim)


def stand_in(t: Teacher, n_prompts: int, *, seed: int = 0) -> Conditioning:
    """Random prompt embeddings of the shapes the family's encoders give (``P`` prompts), in the
    teacher's dtype: what ``encode_prompts`` would return, without any text encoder."""
    f, c = FAMILIES[t.family], t.unet.config
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g).to(t.device, t.dtype)

    P = int(n_prompts)
    tokens = rnd(P, f.tokens, t.text_width)
    if t.family == "sd":
        return Conditioning(tokens)
    if t.family == "sdxl":
        pooled = int(c.projection_class_embeddings_input_dim) - 6 * int(c.addition_time_embed_dim)
        time_ids = torch.tensor([224.0, 224.0, 0.0, 0.0, 224.0, 224.0]).to(t.device, t.dtype).repeat(P, 1)
        return Conditioning(tokens, {"text_embeds": rnd(P, pooled), "time_ids": time_ids})
    if t.family == "pixart":
        mask = torch.zeros(P, f.tokens, dtype=torch.long)
        mask[:, :8] = 1  # a short prompt: about 8 T5 tokens of PixArt's 120
        return Conditioning(tokens, {"encoder_attention_mask": mask.to(t.device)})
    return Conditioning(tokens, {"pooled_projections": rnd(P, int(c.pooled_projection_dim))})
