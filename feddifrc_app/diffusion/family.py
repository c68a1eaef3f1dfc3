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


def component_config(folder: Path, part: str) -> dict:
    """``<folder>/<part>/config.json`` as a dict (no network); an unreadable or non-object file is
    a FamilyError naming it (a folder without ``feddifrc.json`` is not checksummed: a damaged
    config is found here, before any work)."""
    path = Path(folder) / part / "config.json"
    try:
        cfg = json.loads(path.read_text())
        if not isinstance(cfg, dict):
            raise ValueError("not a JSON object")
        return cfg
    except (OSError, ValueError) as e:
        msg = " ".join(str(e).split())[:160]
        raise FamilyError(
            f"teacher folder {folder}: {part}/config.json is unreadable ({type(e).__name__}: {msg}); "
            "restore it, or download or rebuild the whole folder (feddifrc fetch)"
        ) from None


def _config_value(folder: Path, part: str, cfg: dict, name: str, ok) -> object:
    """``cfg[name]`` if ``ok`` says it is usable, else a FamilyError naming the file and key."""
    value = cfg.get(name)
    if not ok(value):
        raise FamilyError(
            f"teacher folder {folder}: {part}/config.json has no usable {name!r} ({value!r}); restore "
            "the file, or download or rebuild the whole folder (feddifrc fetch)"
        )
    return value


def layer_count(folder: Path, family: str) -> int:
    """How many hookable layers the folder's denoiser has, read from its config.json (no network)."""
    mod = family_module(family)
    cfg = component_config(folder, mod.DENOISER)
    ok = lambda v: (isinstance(v, list) and v) or (type(v) is int and v > 0)  # noqa: E731
    value = _config_value(folder, mod.DENOISER, cfg, mod.LAYER_COUNT_KEY, ok)
    return len(value) if isinstance(value, list) else int(value)


def has_mid_block(folder: Path, family: str) -> bool:
    """Whether the folder's denoiser has a mid-block to hook (from its config.json, no network)."""
    mod = family_module(family)
    if getattr(mod, "MID_ATTR", None) is None:
        return False
    cfg = component_config(folder, mod.DENOISER)
    return cfg.get("mid_block_type", "UNetMidBlock2DCrossAttn") is not None  # diffusers' default


def vae_factor(folder: Path) -> int:
    """Pixel -> latent downsampling of the folder's VAE (``Teacher.vae_scale_factor``), from its
    config.json: one factor 2 per encoder block but the last."""
    ok = lambda v: isinstance(v, list) and v  # noqa: E731
    blocks = _config_value(folder, "vae", component_config(folder, "vae"), "block_out_channels", ok)
    return 2 ** (len(blocks) - 1)


def map_sides(folder: Path, family: str, resolution: int) -> dict[int, int]:
    """The side of each hookable layer's feature map (``diffusion.blocks`` index -> side) for
    ``resolution`` px images, from the folder's config files (no network). The latent is
    ``resolution / vae_factor``. A DiT (``patch_size`` in its config) holds its patch grid on
    every layer. A UNet halves the map after every down block but the last (a stride-2
    convolution: ``ceil(n / 2)``); its mid-block holds the smallest map and ``up_blocks[i]``
    (upsampled after every one but the last, to the matching skip's size) down level
    ``n - 2 - i``'s, the last one the latent's. {} for a denoiser config that says neither."""
    mod = family_module(family)
    cfg, n = component_config(folder, mod.DENOISER), layer_count(folder, family)
    latent = int(resolution) // vae_factor(folder)
    if type(patch := cfg.get("patch_size")) is int and patch > 0:
        return {b: latent // patch for b in range(n)}
    downs = cfg.get("block_out_channels")
    if not isinstance(downs, list) or not downs:
        return {}
    sides = [latent]
    for _ in downs[1:]:
        sides.append(-(-sides[-1] // 2))
    out = {i: sides[max(len(downs) - 2 - i, 0)] for i in range(n)}
    if has_mid_block(folder, family):
        out[MID_BLOCK] = sides[-1]
    return out


def check_maps(folder: Path, family: str, blocks: tuple[int, ...], resolution: int, grid: int) -> None:
    """``diffusion.resolution`` fits the folder's VAE and, under grid pooling (``grid`` = g > 0),
    every layer of ``blocks`` holds a g x g grid (``pool_map``): else a FamilyError naming the key,
    before any network is built."""
    f = vae_factor(folder)
    if int(resolution) < f or int(resolution) % f:
        raise FamilyError(
            f"diffusion.resolution = {resolution} must be a positive multiple of this {family} teacher's "
            f"VAE factor {f} (its vae/config.json)"
        )
    sides = map_sides(folder, family, resolution) if grid else {}
    small = {b: sides[b] for b in blocks if b in sides and sides[b] < grid}
    if small:
        name = family_module(family).LAYER_NAME
        where = lambda b: "the mid-block" if b == MID_BLOCK else f"{name}[{b}]"  # noqa: E731
        maps = ", ".join(f"{where(b)} {s}x{s}" for b, s in small.items())
        raise FamilyError(
            f"diffusion.pool-grid = {grid} exceeds the feature map of diffusion.blocks {tuple(small)} of "
            f"this {family} teacher at diffusion.resolution = {resolution} ({maps}); choose a "
            f"diffusion.pool-grid <= {min(small.values())}, other diffusion.blocks, or "
            "diffusion.pooling = 'mean'"
        )


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
    return torch.float32 if component_config(folder, "vae").get("force_upcast", True) else dtype


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
