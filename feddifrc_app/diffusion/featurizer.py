"""Images x prompts -> per-layer, spatially pooled features of the frozen teacher.

The family-specific steps (prompt encoding, the noise law and the model timestep, the
denoiser call, pooling a hooked layer) are the family module's (``family.py``); what follows
is said for the SD UNet and holds for every family with "UNet" read as its denoiser and
``up_blocks`` as its hooked layers (``transformer_blocks`` for the DiTs).

Per batch of B images and P prompts: pixels -> [-1, 1] once (``to_unit_range``, the only
pixel mapping) and VAE-encoded once per image; prompt embeddings memoised per prompt tuple;
per noise draw, seeded noise per image (by ``(seed, dataset id, draw)``, so a feature never
depends on its batch), ``l_t = sqrt(a_t) l0 + sqrt(1 - a_t) eps`` and ONE UNet call for all
P x B rows in PROMPT-MAJOR order (row ``p * B + b`` = image b under prompt p), with forward
hooks pooling the needed ``unet.up_blocks`` (and the mid-block, ``family.MID_BLOCK``) and
stopping the UNet after the last one; draws are averaged. Pooling is the mean over the map
(``pool_grid = 0``) or the means of a g x g grid of it (``pool_grid = g``: C g^2 features).
``speed.Shortcuts`` makes that call cheaper without changing its maths.

Either pooling commutes with any linear projection, so the pooled per-block features are what
the cache stores and any basis (PCA, random) is applied afterwards.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor

from feddifrc_app.diffusion.dit_features import Reader
from feddifrc_app.diffusion.family import MID_BLOCK, Conditioning, FamilyError, encode_image, layer_module
from feddifrc_app.diffusion.pipeline import (
    Teacher,
    release_text_encoders,
    restore_text_encoders,
    text_encoders_on,
)
from feddifrc_app.diffusion.sd import (
    encode_clip as encode_prompts,
)  # SD's CLIP encoding (pretrain, benchmarks)
from feddifrc_app.diffusion.speed import Shortcuts

__all__ = ["Featurizer", "check_layers", "encode_prompts", "noise_seed", "to_unit_range"]

_PROMPT_MEMO = 64  # prompt tuples kept per Featurizer


def to_unit_range(images: Tensor, resolution: int) -> Tensor:
    """uint8 ``(B, 3, H, W)`` in 0..255 -> float32 ``(B, 3, R, R)`` in [-1, 1].

    ``x / 127.5 - 1`` (0 -> -1 and 255 -> 1 exactly), then a bilinear, antialiased resize to
    ``R x R`` (skipped when already that size). Single-channel images are repeated to 3.
    """
    if images.dtype != torch.uint8:
        raise TypeError(f"to_unit_range expects uint8 images in 0..255, got {images.dtype}")
    if images.ndim != 4 or images.shape[1] not in (1, 3):
        raise ValueError(f"to_unit_range expects (B, 3, H, W) images, got shape {tuple(images.shape)}")
    x = images.to(torch.float32) / 127.5 - 1.0
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    if x.shape[-2:] != (resolution, resolution):
        x = F.interpolate(
            x, size=(resolution, resolution), mode="bilinear", align_corners=False, antialias=True
        )
        x = x.clamp_(-1.0, 1.0)
    return x.contiguous()


def noise_seed(seed: int, image_id: int, draw: int) -> int:
    """A 63-bit generator seed for one image's noise draw, stable across processes and platforms."""
    digest = hashlib.sha256(f"feddifrc-noise:{int(seed)}:{int(image_id)}:{int(draw)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def check_layers(
    layers: tuple[int, ...], n: int, family: str, adapter: ModuleType, mid: bool = False
) -> tuple[int, ...]:
    """``layers`` if they are distinct indices of the model's ``n`` layers (or ``MID_BLOCK`` when
    ``mid``: the model has a mid-block), else a FamilyError that names the valid range and the
    family's default (``adapter``: the family's module, ``family.family_module``). The featurizer
    hooks them; ``teacher.check_folder`` checks a run's before any network is built."""
    layers = tuple(int(b) for b in layers)
    ok = lambda b: 0 <= b < n or (b == MID_BLOCK and mid)  # noqa: E731
    if not layers or len(set(layers)) != len(layers) or not all(ok(b) for b in layers):
        default = ",".join(map(str, adapter.default_layers(n)))
        has = f"{n}; {MID_BLOCK} is its mid-block" if mid else str(n)
        none = f"; it has no mid-block ({MID_BLOCK})" if MID_BLOCK in layers and not mid else ""
        raise FamilyError(
            f"diffusion.blocks {layers} must be distinct {adapter.LAYER_NAME} indices in 0..{n - 1} for "
            f"this {family} teacher (it has {has}); its default is '{default}'{none}"
        )
    return layers


class _StopUNet(Exception):
    """Raised by the last needed hook to skip the rest of the UNet."""


class Featurizer:
    """Pooled per-block UNet features for (image, prompt) pairs; see the module docstring.

    ``fast=False`` runs the stock UNet modules on P x B rows (the reference the exact
    shortcuts are checked against).
    """

    def __init__(
        self,
        teacher: Teacher,
        *,
        resolution: int,
        timestep: int,
        blocks: tuple[int, ...],
        ensemble: int,
        seed: int,
        fast: bool = True,
        pool_grid: int = 0,
        dit_features: str = "raw",
    ) -> None:
        adapter = teacher.adapter
        n, mid = len(getattr(teacher.unet, adapter.LAYER_ATTR)), getattr(adapter, "MID_ATTR", None)
        blocks = check_layers(
            blocks, n, teacher.family, adapter, mid=getattr(teacher.unet, mid or "", None) is not None
        )
        if int(pool_grid) < 0:
            raise ValueError(f"pool_grid {pool_grid} must be >= 0 (0 = the mean over the map)")
        n_t = teacher.num_timesteps
        if not 0 <= int(timestep) < n_t:
            raise ValueError(f"timestep {timestep} must be in 0..{n_t - 1}")
        if int(ensemble) < 1:
            raise ValueError(f"ensemble {ensemble} must be >= 1")
        f = teacher.vae_scale_factor
        if int(resolution) < f or int(resolution) % f:
            raise ValueError(f"resolution {resolution} must be a positive multiple of the VAE factor {f}")
        self.teacher = teacher
        self.resolution = int(resolution)
        self.timestep = int(timestep)
        self.blocks = blocks
        self.ensemble = int(ensemble)
        self.seed = int(seed)
        self.fast = bool(fast)
        self.pool_grid = int(pool_grid)
        self._read = Reader(teacher.unet, adapter, dit_features, teacher.family)  # dit_features.py
        # x_t = a x0 + b eps by hand (sd, sdxl, pixart: DDPM's sqrt(a_t), sqrt(1 - a_t) in double,
        # not the scheduler's float32 add_noise; sd3: 1 - sigma, sigma of its flow-matching grid)
        # and the timestep the denoiser expects.
        self._sqrt_a, self._sqrt_1ma, self._step = adapter.noise_coeffs(teacher, self.timestep)
        self._latent_shape = (teacher.latent_channels, self.resolution // f, self.resolution // f)
        patch = int(getattr(teacher.unet.config, "patch_size", None) or 1)
        self._grid = (self.resolution // f // patch, self.resolution // f // patch)  # DiT patch grid
        self._prompts: OrderedDict[tuple[str, ...], Conditioning] = OrderedDict()
        cpu_fp32 = teacher.device.type == "cpu" and teacher.dtype == torch.float32
        fast_ok = self.fast and adapter.SHORTCUTS
        self._speed = Shortcuts(teacher.unet, enabled=fast_ok, onednn=cpu_fp32)

    @property
    def shortcuts(self) -> dict[str, bool]:
        """Which exact shortcuts this featurizer uses (for logs and benchmarks)."""
        return self._speed.flags

    # ------------------------------------------------------------------ prompts

    def prompt_embeddings(self, prompts: tuple[str, ...]) -> Tensor:
        """``(P, L, D)`` prompt-token embeddings the denoiser reads (teacher device/dtype), once
        per tuple (SD: the text encoder's last hidden states).

        The returned tensor is the memoised one (an inference tensor): do not modify it.
        """
        return self.conditioning(prompts).tokens

    def conditioning(self, prompts: tuple[str, ...]) -> Conditioning:
        """The family's encoding of ``prompts`` (tokens and extras), memoised per tuple; a new tuple
        after ``encode_then_release`` loads the text encoders again (``restore_text_encoders``)."""
        key = tuple(str(p) for p in prompts)
        if not key:
            raise ValueError("at least one prompt is needed")
        hit = self._prompts.get(key)
        if hit is not None:
            self._prompts.move_to_end(key)
            return hit
        t = self.teacher
        restore_text_encoders(t)  # nothing to do unless they were released
        with torch.inference_mode(), text_encoders_on(t):  # they wait on the CPU otherwise
            cond = t.adapter.encode_prompts(t, key, self.resolution)
        self._prompts[key] = cond
        if len(self._prompts) > _PROMPT_MEMO:
            self._prompts.popitem(last=False)
        return cond

    def encode_then_release(self, *prompt_lists: tuple[str, ...]) -> None:
        """Encode every prompt list this featurizer will be called with (memoised, at most
        ``_PROMPT_MEMO``), then release the teacher's text encoders and tokenizers: only the
        denoiser and the VAE stay resident. The features are the same: the memoised encodings
        condition the denoiser as before. A later new prompt list loads the encoders again."""
        if len(prompt_lists) > _PROMPT_MEMO:
            raise ValueError(f"at most {_PROMPT_MEMO} prompt lists are kept, got {len(prompt_lists)}")
        for prompts in prompt_lists:
            self.conditioning(prompts)
        release_text_encoders(self.teacher)

    # ------------------------------------------------------------------ features

    def __call__(
        self,
        images: Tensor,
        ids: Tensor,
        prompts: tuple[str, ...],
        token_offsets: Tensor | None = None,
        latents: Tensor | None = None,
    ) -> dict[int, Tensor]:
        """``{block: float32 (B, P, C_b)}`` on CPU for uint8 ``images (B, 3, H, W)``.

        ``ids`` (B,) dataset indices seed each image's noise. ``token_offsets`` (B, D_text), if
        given, is added to every prompt-token embedding of that image's rows (the
        model-conditioned variant). ``latents`` (B, C, h, w), if given, are these images'
        ``encode(images)``, kept by a caller that extracts the same images again. Runs under
        ``torch.inference_mode``; the returned tensors are ordinary tensors (usable as loss targets).
        """
        with torch.inference_mode():
            out = self._extract(images, ids, prompts, token_offsets, latents)
        return {b: v.clone() for b, v in out.items()}  # leave inference mode: normal tensors

    def _extract(
        self,
        images: Tensor,
        ids: Tensor,
        prompts: tuple[str, ...],
        token_offsets: Tensor | None,
        latents: Tensor | None,
    ) -> dict[int, Tensor]:
        t = self.teacher
        B = int(images.shape[0])
        ids = torch.as_tensor(ids).reshape(-1)
        if ids.numel() != B:
            raise ValueError(f"got {B} images but {ids.numel()} ids")
        cond = self.conditioning(prompts)  # tokens (P, L, D): shared by all images
        P = int(cond.tokens.shape[0])
        if token_offsets is not None:
            off = torch.as_tensor(token_offsets)
            if tuple(off.shape) != (B, t.text_width):
                raise ValueError(
                    f"token_offsets must be (B, text width) = ({B}, {t.text_width}), got {tuple(off.shape)}"
                )
            # per-image prompt rows, prompt-major: row p*B + b = prompt p + offset of image b
            cond = cond.rows(B, off.to(t.device, t.dtype))
        l0 = self.encode(images) if latents is None else latents.to(t.device)  # (B, C, h, w) float32
        total: dict[int, Tensor] | None = None
        for draw in range(self.ensemble):
            feats = self._draw(l0, ids, draw, cond, P)
            total = feats if total is None else {b: total[b] + feats[b] for b in self.blocks}
        assert total is not None
        return {b: (total[b] / self.ensemble).to("cpu", torch.float32).contiguous() for b in self.blocks}

    def encode(self, images: Tensor) -> Tensor:
        """uint8 images -> VAE latent mean x scaling factor, float32 ``(B, C, h, w)`` on the device,
        computed in the VAE's dtype (float32 for SDXL under float16: ``family.vae_dtype``); the
        noised latents are cast to the denoiser's dtype in ``_draw``."""
        t = self.teacher
        x = to_unit_range(images.to(t.device), self.resolution).to(t.vae.dtype)
        return encode_image(t.vae, x)

    def noise(self, ids: Tensor, draw: int) -> Tensor:
        """Per-image seeded standard normal noise, float32 ``(B, C, h, w)`` (drawn on the CPU)."""
        out = torch.empty((len(ids), *self._latent_shape), dtype=torch.float32)
        g = torch.Generator(device="cpu")
        for i, image_id in enumerate(ids.tolist()):
            g.manual_seed(noise_seed(self.seed, image_id, draw))
            out[i] = torch.randn(self._latent_shape, generator=g)
        return out

    def _draw(
        self, l0: Tensor, ids: Tensor, draw: int, cond: Conditioning | Tensor, P: int
    ) -> dict[int, Tensor]:
        """One noise draw, ONE denoiser call over all P x B rows; pooled ``(B, P, C_b)`` per layer.

        ``cond``: the P prompts shared by every image, or ``P * B`` per-row (prompt-major) ones;
        a bare tensor is SD's prompt tokens.
        """
        t = self.teacher
        cond = cond if isinstance(cond, Conditioning) else Conditioning(cond)
        B = int(l0.shape[0])
        eps = self.noise(ids, draw).to(l0.device)
        lt = (self._sqrt_a * l0 + self._sqrt_1ma * eps).to(t.dtype)
        sample = lt.repeat(P, 1, 1, 1)  # prompt-major: row p*B + b = image b
        shared = int(cond.tokens.shape[0]) == P and P * B != P
        fast_cross = shared and bool(self._speed.cross)
        if shared:  # row p*B + b = prompt p (the tokens stay P rows for the shared cross-attention)
            cond = cond.rows(B, expand_tokens=not fast_cross)
        pooled = self._run(sample, cond, B, P, fast_cross)
        for b, v in pooled.items():
            if int(v.shape[-1]) != self.width(b):  # pragma: no cover - a family module bug
                raise RuntimeError(f"layer {b} gave width {v.shape[-1]}, declared {self.width(b)}")
        return {b: v.reshape(P, B, -1).transpose(0, 1) for b, v in pooled.items()}

    def width(self, block: int) -> int:
        """Layer ``block``'s pooled feature width: its channels, times g^2 under grid pooling."""
        t = self.teacher
        c = t.adapter.mid_width(t.unet) if block == MID_BLOCK else t.block_channels[block]
        return c * max(1, self.pool_grid) ** 2

    def _run(self, sample: Tensor, cond: Conditioning, B: int, P: int, fast_cross: bool) -> dict[int, Tensor]:
        """The denoiser call with forward hooks pooling ``self.blocks``; stops after the last one."""
        t = self.teacher
        adapter = t.adapter
        pooled: dict[int, Tensor] = {}
        last = max(self.blocks)

        def hook_for(b: int):
            def hook(_module, _inputs, output):
                pooled[b] = adapter.pool(self._read(b, output), self._grid, self.pool_grid)
                if b == last:
                    raise _StopUNet

            return hook

        handles = [layer_module(t.unet, adapter, b).register_forward_hook(hook_for(b)) for b in self.blocks]
        try:
            with self._speed.installed(B, P, fast_cross), self._read.capturing():
                adapter.denoise(t, sample, self._step, cond)
        except _StopUNet:
            pass
        finally:
            for h in handles:
                h.remove()
        missing = [b for b in self.blocks if b not in pooled]
        if missing:  # pragma: no cover - only if the denoiser skips its layers
            raise RuntimeError(f"{adapter.LAYER_NAME} {missing} produced no output")
        return pooled
