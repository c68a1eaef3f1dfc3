"""Teacher families: which diffusers pipeline a folder is, and the small interface each family
module implements for the pipeline loader and the Featurizer.

A family is its adapter module and its line in ``ADAPTERS`` (nothing else names it). It is
detected from the pipeline folder alone (``model_index.json`` ``_class_name``, listed in the
adapter's ``PIPELINES``), so the feature-cache key can name it without building a network. Each
adapter (``sd``, ``sdxl``, ``pixart``, ``sd3``) provides, as constants and plain functions:

- ``PIPELINES``: the ``_class_name`` values it serves (each folder loads with its own class);
  ``LOAD_KWARGS``: extra ``from_pretrained`` arguments (SD: no safety checker);
- ``DENOISER`` / ``LAYER_COUNT_KEY``: the denoiser's component folder and pipeline attribute,
  and its config key holding the number of hookable layers;
- ``LAYER_ATTR`` / ``LAYER_NAME``: the denoiser attribute whose entries are hooked
  (``up_blocks``, ``transformer_blocks``) and how the docs name them;
- ``TEXT_PARTS``: the pipeline's text encoders that prompt encoding runs;
- ``AUTO_BF16``: ``diffusion.dtype = "auto"`` means bfloat16 on a GPU that computes it
  natively (activations that can leave float16's range), float16 otherwise;
- ``VAE_FORCE_UPCAST``: the family's diffusers pipelines honour ``vae.config.force_upcast``
  (the VAE encodes in float32 when the teacher runs in float16: ``vae_dtype``);
- ``SHORTCUTS``: the exact UNet shortcuts of ``speed.py`` are checked on this denoiser;
- ``default_layers(n)``: the documented default of ``diffusion.blocks`` for ``n`` layers;
- ``layer_widths(denoiser)``, ``token_width(pipe, denoiser)``: each hooked layer's output
  width; the width of the prompt tokens the denoiser reads (what ``token_offsets`` shift);
- ``parts(pipe) -> dict``: what the teacher keeps of the pipeline (``Teacher.parts``);
- ``encode_prompts(teacher, prompts, resolution) -> Conditioning``;
- ``noise_coeffs(teacher, timestep) -> (a, b, model_timestep)``: ``x_t = a x0 + b eps``;
- ``denoise(teacher, sample, step, cond)``: one denoiser call (the hooks take the features);
- ``pool(output, grid, cells) -> (rows, C)``: a hooked layer's output, mean-pooled over the
  latent grid (``cells = 0``) or a ``cells x cells`` grid of means (``pool_map``);
- ``MID_ATTR`` (optional, absent = None): the denoiser's middle block (``"mid_block"`` for the
  UNets, hooked as ``diffusion.blocks`` index ``MID_BLOCK = -1``) or None (the DiTs have none);
  ``mid_width(denoiser)``: its output width.

Image encoding (``encode_image``) is common: the VAE mean, shifted and scaled as the
pipeline's VAE config says.
"""

from __future__ import annotations

import importlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

# The registered families: name -> adapter module. A new family is its module and one line here.
ADAPTERS: dict[str, str] = {
    "sd": "feddifrc_app.diffusion.sd",
    "sdxl": "feddifrc_app.diffusion.sdxl",
    "pixart": "feddifrc_app.diffusion.pixart",
    "sd3": "feddifrc_app.diffusion.sd3",
}


# diffusion.blocks index of the UNet's mid-block: it runs before up_blocks[0], so the largest
# index is still the last layer a forward pass reaches.
MID_BLOCK = -1


class FamilyError(ValueError):
    """The folder is no supported pipeline, or a layer index is outside the model."""


@dataclass(frozen=True)
class Conditioning:
    """One prompt list, encoded: ``tokens (P, L, D)`` (what the denoiser cross-attends to; what
    ``token_offsets`` shift) and per-prompt ``extras`` (``(P, ...)`` each: pooled embeddings,
    attention masks, SDXL time ids), passed to ``denoise`` by name."""

    tokens: Tensor
    extras: dict[str, Tensor] = field(default_factory=dict)

    def rows(self, n_images: int, offsets: Tensor | None = None, expand_tokens: bool = True) -> Conditioning:
        """Prompt-major rows ``p * B + b``; ``offsets (B, D)`` are added to image b's tokens.
        ``expand_tokens=False`` keeps the P shared token rows (the UNet's shared-prompt shortcut)."""
        P = int(self.tokens.shape[0])
        if offsets is not None:
            tokens = (self.tokens[:, None] + offsets[None, :, None, :]).reshape(
                P * n_images, *self.tokens.shape[1:]
            )
        elif expand_tokens:
            tokens = self.tokens.repeat_interleave(n_images, dim=0)
        else:
            tokens = self.tokens
        extras = {k: v.repeat_interleave(n_images, dim=0) for k, v in self.extras.items()}
        return Conditioning(tokens, extras)


def pipeline_families() -> dict[str, str]:
    """model_index.json ``_class_name`` -> family, from the registered adapters' ``PIPELINES``."""
    return {name: fam for fam in ADAPTERS for name in family_module(fam).PIPELINES}


def read_family(folder: Path) -> str:
    """The family of a diffusers pipeline folder, from its ``model_index.json``."""
    try:
        name = json.loads((Path(folder) / "model_index.json").read_text()).get("_class_name")
    except (OSError, ValueError, AttributeError):
        name = None
    families = pipeline_families()
    if name not in families:
        raise FamilyError(
            f"diffusion model folder '{folder}' is a {name or 'unreadable'} pipeline; supported teachers are "
            f"{', '.join(sorted(families))} (model_index.json _class_name)"
        )
    return families[name]


def family_module(family: str) -> ModuleType:
    """The adapter module of a registered family (``ADAPTERS``)."""
    if family not in ADAPTERS:
        raise FamilyError(f"unknown teacher family {family!r}; known: {', '.join(sorted(ADAPTERS))}")
    return importlib.import_module(ADAPTERS[family])


def layer_count(folder: Path, family: str) -> int:
    """How many hookable layers the folder's denoiser has, read from its config.json (no network)."""
    mod = family_module(family)
    value = json.loads((Path(folder) / mod.DENOISER / "config.json").read_text())[mod.LAYER_COUNT_KEY]
    return len(value) if isinstance(value, list) else int(value)


def has_mid_block(folder: Path, family: str) -> bool:
    """Whether the folder's denoiser has a mid-block to hook (from its config.json, no network)."""
    mod = family_module(family)
    if getattr(mod, "MID_ATTR", None) is None:
        return False
    cfg = json.loads((Path(folder) / mod.DENOISER / "config.json").read_text())
    return cfg.get("mid_block_type", "UNetMidBlock2DCrossAttn") is not None  # diffusers' default


def check_layers(layers: tuple[int, ...], n: int, family: str, mid: bool = False) -> tuple[int, ...]:
    """``layers`` if they are distinct indices of the model's ``n`` layers (or ``MID_BLOCK`` when
    ``mid``: the model has a mid-block), else a FamilyError that names the valid range and the
    family's default."""
    mod = family_module(family)
    layers = tuple(int(b) for b in layers)
    ok = lambda b: 0 <= b < n or (b == MID_BLOCK and mid)  # noqa: E731
    if not layers or len(set(layers)) != len(layers) or not all(ok(b) for b in layers):
        default = ",".join(map(str, mod.default_layers(n)))
        has = f"{n}; {MID_BLOCK} is its mid-block" if mid else str(n)
        none = f"; it has no mid-block ({MID_BLOCK})" if MID_BLOCK in layers and not mid else ""
        raise FamilyError(
            f"diffusion.blocks {layers} must be distinct {mod.LAYER_NAME} indices in 0..{n - 1} for this "
            f"{family} teacher (it has {has}); its default is '{default}'{none}"
        )
    return layers


def layer_module(denoiser, mod: ModuleType, b: int):
    """The module whose output is layer ``b``'s feature: ``LAYER_ATTR[b]``, or the mid-block."""
    return getattr(denoiser, mod.MID_ATTR) if b == MID_BLOCK else getattr(denoiser, mod.LAYER_ATTR)[b]


def vae_dtype(folder: Path, family: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype the teacher's VAE encodes in: float32 when the teacher runs in float16, the
    family honours ``force_upcast`` and the folder's ``vae/config.json`` sets it (diffusers'
    default: True), as diffusers' SDXL pipelines do (that VAE overflows in float16); else
    ``dtype``. Read from the folder, so the feature key knows it without building a network.

    A family rule, not the flag alone: SD 2.1's, PixArt's and SD3's VAE configs set the flag
    too, but their diffusers pipelines never read it (they encode and decode in the pipeline's
    dtype), and an upcast there would change SD features under unchanged cache keys.
    bfloat16 has float32's exponent range: no upcast."""
    if dtype != torch.float16 or not family_module(family).VAE_FORCE_UPCAST:
        return dtype
    cfg = json.loads((Path(folder) / "vae" / "config.json").read_text())
    return torch.float32 if cfg.get("force_upcast", True) else dtype


def encode_image(vae, x: Tensor) -> Tensor:
    """``x`` in [-1, 1] (VAE dtype) -> float32 latent: ``(mean - shift) * scale`` as the VAE config says."""
    with torch.inference_mode():
        lat = vae.encode(x).latent_dist.mean.float()
    shift = getattr(vae.config, "shift_factor", None)
    if shift is not None:  # SD3: (mean - shift) * scale
        lat = lat - float(shift)
    return lat * float(vae.config.scaling_factor)


def pool_map(h: Tensor, cells: int) -> Tensor:
    """A layer's map ``(rows, C, h, w)`` -> float32 ``(rows, C)``, its mean (``cells = 0``), or
    ``(rows, C * g * g)`` for ``cells = g``: the means of a g x g grid of regions (adaptive
    average pooling: region i of n rows spans ``floor(i n / g)`` to ``ceil((i + 1) n / g)``),
    channel-major (channel c's g x g means, row by row, then channel c + 1's)."""
    if not cells:
        return h.mean(dim=(2, 3), dtype=torch.float32)
    if cells > min(h.shape[-2:]):
        raise ValueError(
            f"diffusion.pool-grid = {cells} exceeds a hooked layer's {h.shape[-2]}x{h.shape[-1]} map; "
            "choose a grid no larger than the smallest map of diffusion.blocks, or diffusion.pooling = 'mean'"
        )
    return torch.nn.functional.adaptive_avg_pool2d(h.float(), cells).flatten(1)


def pool_tokens(h: Tensor, grid: tuple[int, int], cells: int = 0) -> Tensor:
    """DiT tokens ``(rows, N, D)`` -> the latent patch grid ``(rows, D, h, w)`` -> ``pool_map``."""
    rows, n, d = h.shape
    if n != grid[0] * grid[1]:
        raise RuntimeError(
            f"a transformer block gave {n} tokens, expected the {grid[0]}x{grid[1]} patch grid"
        )
    return pool_map(h.reshape(rows, grid[0], grid[1], d).permute(0, 3, 1, 2), cells)


def ddpm_coeffs(alphas_cumprod: Tensor, timestep: int) -> tuple[float, float]:
    """DDPM's ``sqrt(a_t), sqrt(1 - a_t)`` in double precision (not the scheduler's float32 add_noise)."""
    a = float(alphas_cumprod[int(timestep)].double())
    return math.sqrt(a), math.sqrt(1.0 - a)
