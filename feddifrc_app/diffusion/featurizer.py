"""Images x prompts -> per-block, spatially mean-pooled UNet features of the frozen teacher.

Per batch of B images and P prompts: pixels -> [-1, 1] once (``to_unit_range``, the only
pixel mapping) and VAE-encoded once per image; prompt embeddings memoised per prompt tuple;
per noise draw, seeded noise per image (by ``(seed, dataset id, draw)``, so a feature never
depends on its batch), ``l_t = sqrt(a_t) l0 + sqrt(1 - a_t) eps`` and ONE UNet call for all
P x B rows in PROMPT-MAJOR order (row ``p * B + b`` = image b under prompt p), with forward
hooks mean-pooling the needed ``unet.up_blocks`` and stopping the UNet after the last one;
draws are averaged. ``speed.Shortcuts`` makes that call cheaper without changing its maths.

Mean pooling commutes with any linear projection, so the pooled per-block features are what
the cache stores and any basis (PCA, random) is applied afterwards.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import Tensor

from feddifrc_app.diffusion.pipeline import Teacher
from feddifrc_app.diffusion.speed import Shortcuts

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


def encode_prompts(tokenizer, text_encoder, prompts: tuple[str, ...]) -> Tensor:
    """``(P, L, D)`` last hidden states of the text encoder, prompts padded to the tokenizer's
    max length as Stable Diffusion does (the teacher's pretraining conditions the same way)."""
    device = next(text_encoder.parameters()).device
    ids = tokenizer(
        list(prompts),
        padding="max_length",
        max_length=tokenizer.model_max_length,
        truncation=True,
        return_tensors="pt",
    ).input_ids.to(device)
    return text_encoder(ids)[0]


def noise_seed(seed: int, image_id: int, draw: int) -> int:
    """A 63-bit generator seed for one image's noise draw, stable across processes and platforms."""
    digest = hashlib.sha256(f"feddifrc-noise:{int(seed)}:{int(image_id)}:{int(draw)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


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
    ) -> None:
        n_up = len(teacher.unet.up_blocks)
        blocks = tuple(int(b) for b in blocks)
        if not blocks or len(set(blocks)) != len(blocks) or any(b < 0 or b >= n_up for b in blocks):
            raise ValueError(f"blocks {blocks} must be distinct up_block indices in 0..{n_up - 1}")
        n_t = int(teacher.alphas_cumprod.shape[0])
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
        # DDPM's forward process by hand, not the pipeline's scheduler.add_noise: that rounds
        # sqrt(1 - a) in float32 (117 of SD's 1000 timesteps differ bitwise) and sigma-parametrised
        # schedulers (Euler, LMS) noise another way.
        a = float(teacher.alphas_cumprod[self.timestep].double())
        self._sqrt_a = math.sqrt(a)
        self._sqrt_1ma = math.sqrt(1.0 - a)
        self._latent_shape = (teacher.latent_channels, self.resolution // f, self.resolution // f)
        self._prompts: OrderedDict[tuple[str, ...], Tensor] = OrderedDict()
        cpu_fp32 = teacher.device.type == "cpu" and teacher.dtype == torch.float32
        self._speed = Shortcuts(teacher.unet, enabled=self.fast, onednn=cpu_fp32)

    @property
    def shortcuts(self) -> dict[str, bool]:
        """Which exact shortcuts this featurizer uses (for logs and benchmarks)."""
        return self._speed.flags

    # ------------------------------------------------------------------ prompts

    def prompt_embeddings(self, prompts: tuple[str, ...]) -> Tensor:
        """``(P, L, D)`` text-encoder last hidden states (teacher device/dtype), once per tuple.

        The returned tensor is the memoised one (an inference tensor): do not modify it.
        """
        key = tuple(str(p) for p in prompts)
        if not key:
            raise ValueError("at least one prompt is needed")
        hit = self._prompts.get(key)
        if hit is not None:
            self._prompts.move_to_end(key)
            return hit
        t = self.teacher
        with torch.inference_mode():
            emb = encode_prompts(t.tokenizer, t.text_encoder, key).to(t.dtype)
        self._prompts[key] = emb
        if len(self._prompts) > _PROMPT_MEMO:
            self._prompts.popitem(last=False)
        return emb

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
        emb = self.prompt_embeddings(prompts)  # (P, L, D)
        P = int(emb.shape[0])
        cond = emb  # shared by all images: P rows
        if token_offsets is not None:
            off = torch.as_tensor(token_offsets)
            if tuple(off.shape) != (B, t.text_width):
                raise ValueError(
                    f"token_offsets must be (B, text width) = ({B}, {t.text_width}), got {tuple(off.shape)}"
                )
            # per-image prompt rows, prompt-major: row p*B + b = prompt p + offset of image b
            cond = (emb[:, None] + off.to(t.device, t.dtype)[None, :, None, :]).reshape(P * B, *emb.shape[1:])
        l0 = self.encode(images) if latents is None else latents.to(t.device)  # (B, C, h, w) float32
        total: dict[int, Tensor] | None = None
        for draw in range(self.ensemble):
            feats = self._draw(l0, ids, draw, cond, P)
            total = feats if total is None else {b: total[b] + feats[b] for b in self.blocks}
        assert total is not None
        return {b: (total[b] / self.ensemble).to("cpu", torch.float32).contiguous() for b in self.blocks}

    def encode(self, images: Tensor) -> Tensor:
        """uint8 images -> VAE latent mean x scaling factor, float32 ``(B, C, h, w)`` on the device."""
        t = self.teacher
        x = to_unit_range(images.to(t.device), self.resolution).to(t.dtype)
        with torch.inference_mode():
            lat = t.vae.encode(x).latent_dist.mean
        return lat.float() * float(t.vae.config.scaling_factor)

    def noise(self, ids: Tensor, draw: int) -> Tensor:
        """Per-image seeded standard normal noise, float32 ``(B, C, h, w)`` (drawn on the CPU)."""
        out = torch.empty((len(ids), *self._latent_shape), dtype=torch.float32)
        g = torch.Generator(device="cpu")
        for i, image_id in enumerate(ids.tolist()):
            g.manual_seed(noise_seed(self.seed, image_id, draw))
            out[i] = torch.randn(self._latent_shape, generator=g)
        return out

    def _draw(self, l0: Tensor, ids: Tensor, draw: int, cond: Tensor, P: int) -> dict[int, Tensor]:
        """One noise draw, ONE UNet call over all P x B rows; pooled ``(B, P, C_b)`` per block.

        ``cond``: ``(P, L, D)`` prompt embeddings shared by every image, or ``(P * B, L, D)``
        per-row (prompt-major) embeddings.
        """
        t = self.teacher
        B = int(l0.shape[0])
        eps = self.noise(ids, draw).to(l0.device)
        lt = (self._sqrt_a * l0 + self._sqrt_1ma * eps).to(t.dtype)
        sample = lt.repeat(P, 1, 1, 1)  # prompt-major: row p*B + b = image b
        shared = int(cond.shape[0]) == P and P * B != P
        fast_cross = shared and bool(self._speed.cross)
        if shared and not fast_cross:
            cond = cond.repeat_interleave(B, dim=0)  # row p*B + b = prompt p
        pooled: dict[int, Tensor] = {}
        last = max(self.blocks)

        def hook_for(b: int):
            def hook(_module, _inputs, output):
                h = output[0] if isinstance(output, tuple) else output
                pooled[b] = h.mean(dim=(2, 3), dtype=torch.float32)
                if b == last:
                    raise _StopUNet

            return hook

        handles = [t.unet.up_blocks[b].register_forward_hook(hook_for(b)) for b in self.blocks]
        try:
            with self._speed.installed(B, P, fast_cross):
                step = torch.tensor(self.timestep, dtype=torch.long, device=t.device)
                t.unet(sample, step, encoder_hidden_states=cond)
        except _StopUNet:
            pass
        finally:
            for h in handles:
                h.remove()
        missing = [b for b in self.blocks if b not in pooled]
        if missing:  # pragma: no cover - only if the UNet skips its up_blocks
            raise RuntimeError(f"UNet up_blocks {missing} produced no output")
        return {b: v.reshape(P, B, -1).transpose(0, 1) for b, v in pooled.items()}
