"""Tiny RANDOM-weight teachers of the other families, built offline like ``tiny``: ``tiny-sdxl``,
``tiny-pixart``, ``tiny-sd3`` (``diffusion.model``, optionally ``-seedN``).

Each is a diffusers pipeline folder of that family's own class (``StableDiffusionXLPipeline``,
``PixArtAlphaPipeline``, ``StableDiffusion3Pipeline``) with a few channels and layers, the tiny
CLIP tokenizer/encoder of ``tiny.py`` and, where the family reads T5, a seeded random
``T5EncoderModel`` with a locally made unigram tokenizer over the same corpus. Built on first
use into ``<cache>/models/tiny-<family>-seedN``, seeded (byte-identical on rebuild), written
to a temporary sibling and swapped into place whole. For tests and smoke runs only: they
carry no pretrained knowledge and say so (``feddifrc.json``, ``README.md``).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from feddifrc_app.diffusion.tiny import (
    _TINY_CORPUS,
    _WORD_RE,
    MARKER,
    SD_SCHEDULER,
    TINY_PREFIX,
    TINY_RESOLUTION,
    TINY_VAE,
    _tiny_bpe,
    quiet,
    tiny_text_encoder,
)
from feddifrc_app.files import atomic_folder

ZOO_FAMILIES = ("sdxl", "pixart", "sd3")
_DIT = dict(
    sample_size=8, patch_size=2, in_channels=4, num_layers=4, attention_head_dim=32, num_attention_heads=2
)
TINY_SDXL_UNET = dict(
    sample_size=8,
    in_channels=4,
    out_channels=4,
    layers_per_block=1,
    block_out_channels=(32, 64, 128),  # up_blocks: 128, 64, 32 (SDXL: 1280, 640, 320)
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    cross_attention_dim=64,  # the two CLIP widths, concatenated
    attention_head_dim=2,
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=8,
    projection_class_embeddings_input_dim=32 + 6 * 8,  # pooled text (projection_dim) + 6 time ids
    norm_num_groups=32,
)
# PixArt-alpha's block design (its released config.json): adaLN-single, biased attention, tanh GELU.
PIXART_BLOCKS = dict(
    norm_type="ada_norm_single",
    num_embeds_ada_norm=1000,
    norm_elementwise_affine=False,
    norm_eps=1e-6,
    attention_bias=True,
    activation_fn="gelu-approximate",
)
TINY_PIXART = dict(
    _DIT,
    **PIXART_BLOCKS,
    out_channels=8,  # learned sigma, as PixArt
    cross_attention_dim=64,
    caption_channels=64,
)
TINY_SD3 = dict(
    _DIT,
    out_channels=4,
    joint_attention_dim=64,
    caption_projection_dim=64,
    pooled_projection_dim=64,
    pos_embed_max_size=16,
)
TINY_T5 = dict(d_model=64, d_kv=16, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8)
PIXART_SCHEDULER = dict(num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02, beta_schedule="linear")
_CARD = """# {name}: tiny {family} pipeline, RANDOM WEIGHTS

Built offline by feddifrc_app.diffusion.tiny_zoo.build_tiny_zoo (seeded, byte-identical on
rebuild), with the structure of a {cls} folder but a few channels and layers, and NO
pretrained knowledge: features from it only test the plumbing. Never report results obtained
with it as FedDifRC.
"""


def zoo_name(family: str, seed: int) -> str:
    return f"{TINY_PREFIX}-{family}-seed{seed}"


def tiny_t5(seed: int):
    """(T5Tokenizer over ``tiny._TINY_CORPUS``, seeded random tiny T5EncoderModel)."""
    from transformers import T5Config, T5EncoderModel, T5Tokenizer

    words = sorted(set(_WORD_RE.findall(_TINY_CORPUS.lower())))
    chars = sorted({c for w in words for c in w})
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -3.0)]
    vocab += [("\u2581" + w, -1.0) for w in words] + [(c, -5.0) for c in chars]
    tokenizer = T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=512)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        config = T5Config(
            vocab_size=len(vocab), pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, **TINY_T5
        )
        encoder = T5EncoderModel(config)
    return tokenizer, encoder


def _clip_with_projection(seed: int):
    """The tiny CLIP tokenizer and a seeded CLIPTextModelWithProjection of the same size."""
    from transformers import CLIPTextModelWithProjection

    tokenizer, plain = tiny_text_encoder(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return tokenizer, CLIPTextModelWithProjection(plain.config)


def _vae(seed: int, **over):
    from diffusers import AutoencoderKL

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoencoderKL(**{**TINY_VAE, **over})


def _seeded(cls, seed: int, **kw):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return cls(**kw)


def _sdxl(seed: int):
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel

    tok, enc = tiny_text_encoder(seed + 2)
    tok2, enc2 = _clip_with_projection(seed + 3)
    sched = {
        k: v
        for k, v in SD_SCHEDULER.items()
        if k in ("num_train_timesteps", "beta_start", "beta_end", "beta_schedule", "steps_offset")
    }
    return StableDiffusionXLPipeline(
        vae=_vae(seed + 1),
        text_encoder=enc,
        text_encoder_2=enc2,
        tokenizer=tok,
        tokenizer_2=tok2,
        unet=_seeded(UNet2DConditionModel, seed, **TINY_SDXL_UNET),
        scheduler=EulerDiscreteScheduler(**sched),
    )


def _pixart(seed: int):
    from diffusers import DPMSolverMultistepScheduler, PixArtAlphaPipeline, PixArtTransformer2DModel

    tok, enc = tiny_t5(seed + 2)
    return PixArtAlphaPipeline(
        tokenizer=tok,
        text_encoder=enc,
        vae=_vae(seed + 1),
        transformer=_seeded(PixArtTransformer2DModel, seed, **TINY_PIXART),
        scheduler=DPMSolverMultistepScheduler(**PIXART_SCHEDULER),
    )


def _sd3(seed: int):
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    tok, enc = _clip_with_projection(seed + 2)
    tok2, enc2 = _clip_with_projection(seed + 3)
    tok3, enc3 = tiny_t5(seed + 4)
    return StableDiffusion3Pipeline(
        transformer=_seeded(SD3Transformer2DModel, seed, **TINY_SD3),
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        vae=_vae(seed + 1, shift_factor=0.0609, scaling_factor=1.5305),  # SD3's VAE constants
        text_encoder=enc,
        tokenizer=tok,
        text_encoder_2=enc2,
        tokenizer_2=tok2,
        text_encoder_3=enc3,
        tokenizer_3=tok3,
    )


_BUILDERS = {"sdxl": _sdxl, "pixart": _pixart, "sd3": _sd3}


def _kind(family: str) -> str:
    return f"feddifrc-tiny-{family}"


def _write(folder: Path, family: str, seed: int) -> None:
    pipe = _BUILDERS[family](seed)
    with quiet():
        pipe.save_pretrained(folder, safe_serialization=True)
    vocab, merges = _tiny_bpe()  # the vocab.json/merges.txt pair SD hub folders ship
    for name in ("tokenizer", "tokenizer_2"):
        tok_dir = folder / name
        if (tok_dir / "tokenizer.json").is_file() and type(getattr(pipe, name)).__name__ == "CLIPTokenizer":
            (tok_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
            (tok_dir / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    marker = {
        "kind": _kind(family),
        "model_id": zoo_name(family, seed),
        "seed": seed,
        "random_weights": True,
        "resolution": TINY_RESOLUTION,
        "note": f"RANDOM weights, {family} architecture only: no pretrained knowledge. For tests.",
    }
    (folder / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
    card = _CARD.format(name=zoo_name(family, seed), family=family, cls=type(pipe).__name__)
    (folder / "README.md").write_text(card)


def _is_complete(folder: Path, family: str, seed: int) -> bool:
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (
        marker.get("seed") == seed
        and marker.get("kind") == _kind(family)
        and (folder / "model_index.json").is_file()
    )


class _AlreadyBuilt(Exception):
    """A concurrent builder finished first: keep its (byte-identical) folder."""


def build_tiny_zoo(family: str, path: Path, seed: int = 0) -> Path:
    """Write the seeded tiny random-weight ``family`` pipeline to ``path``; an existing complete one
    of this family and seed (built earlier, or by a concurrent builder meanwhile) is kept."""
    if family not in _BUILDERS:
        raise ValueError(f"unknown tiny teacher family {family!r}; known: {', '.join(ZOO_FAMILIES)}")
    path = Path(path).expanduser().resolve()
    if _is_complete(path, family, seed):
        return path
    with contextlib.suppress(_AlreadyBuilt), atomic_folder(path) as tmp:
        _write(tmp, family, seed)
        if _is_complete(path, family, seed):
            raise _AlreadyBuilt
    return path
