"""Images x prompts -> per-block, spatially mean-pooled UNet features of the frozen teacher.

Work per batch of B images and P prompts:

1. pixels -> [-1, 1] once (``to_unit_range``: the ONLY pixel mapping; the public code
   scaled twice), VAE-encode once per image (deterministic latent mean);
2. prompt embeddings computed once per prompt tuple and memoised;
3. per noise draw: seeded noise per image (seeded by ``(seed, dataset id, draw)``, so a
   feature never depends on which other images share its batch),
   ``l_t = sqrt(a_t) l0 + sqrt(1 - a_t) eps``, and ONE UNet call for all P x B rows, in
   PROMPT-MAJOR order (row ``p * B + b`` = image b under prompt p);
4. forward hooks on ``unet.up_blocks[b]`` mean-pool each needed block over space; the
   UNet is stopped right after the last needed block;
5. draws are averaged. Returns ``{block: float32 (B, P, C_b)}`` on CPU.

Inside the one UNet call (``fast=True``, the default) three exact shortcuts apply; each
changes only the float rounding (checked against ``fast=False`` in the tests and in
``benchmarks/featurizer.py``):

- cross-attention keys/values are computed for the P prompts, not for P x B copies of
  them: with prompt-major rows the B x L queries of prompt p form ONE attention batch
  entry against prompt p's keys (softmax is per query, so this is the same attention);
- the prompt-independent prefix of the UNet (``conv_in``, the first resnet of
  ``down_blocks[0]``, and the first transformer's ``proj_in`` and self-attention, which
  see no prompt yet) runs on the B distinct images and is tiled P times;
- on CPU in float32, ``nn.Linear`` runs through oneDNN (``mkldnn::_linear_pointwise``)
  instead of the BLAS ``addmm`` (2-2.5x faster GEMMs on AVX-512 CPUs where MKL takes its
  generic path, e.g. AMD EPYC), and each GEGLU feed-forward input layer becomes two oneDNN
  GEMMs with the GELU and the product fused into them. Probed once per process; the
  stock modules if the op is missing or disagrees.

Mean pooling commutes with any linear projection, so the pooled per-block features
are what the cache stores and any basis (PCA, random) is applied afterwards.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
from collections import OrderedDict
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from feddifrc_app.diffusion.pipeline import Teacher

__all__ = ["to_unit_range", "encode_prompts", "Featurizer", "noise_seed"]

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
        x = F.interpolate(x, size=(resolution, resolution), mode="bilinear", align_corners=False, antialias=True)
        x = x.clamp_(-1.0, 1.0)
    return x.contiguous()


def encode_prompts(tokenizer, text_encoder, prompts: tuple[str, ...]) -> Tensor:
    """``(P, L, D)`` last hidden states of the text encoder, prompts padded to the tokenizer's
    max length as Stable Diffusion does (the teacher's pretraining conditions the same way)."""
    device = next(text_encoder.parameters()).device
    ids = tokenizer(list(prompts), padding="max_length", max_length=tokenizer.model_max_length,
                    truncation=True, return_tensors="pt").input_ids.to(device)
    return text_encoder(ids)[0]


def noise_seed(seed: int, image_id: int, draw: int) -> int:
    """A 63-bit generator seed for one image's noise draw, stable across processes and platforms."""
    digest = hashlib.sha256(f"feddifrc-noise:{int(seed)}:{int(image_id)}:{int(draw)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class _StopUNet(Exception):
    """Raised by the last needed hook to skip the rest of the UNet."""


# --------------------------------------------------------------------------- exact shortcuts


@functools.cache
def onednn_linear_available() -> bool:
    """True if ``mkldnn::_linear_pointwise`` runs here and matches ``F.linear`` (probed once)."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        op = torch.ops.mkldnn._linear_pointwise
        g = torch.Generator().manual_seed(0)
        x, w, b = (torch.randn(s, generator=g) for s in ((3, 5, 24), (40, 24), (40,)))
        with torch.inference_mode():
            got = op(x, w, b, "none", [], "")
            ok = torch.allclose(got, F.linear(x, w, b), atol=1e-4, rtol=1e-4)
            ok = ok and torch.allclose(op(x, w, None, "none", [], ""), F.linear(x, w), atol=1e-4, rtol=1e-4)
            h, gate = F.linear(x, w, b).chunk(2, dim=-1)
            ok = ok and torch.allclose(_geglu(x, w, b), h * F.gelu(gate), atol=1e-4, rtol=1e-4)
        return bool(ok)
    except Exception:  # op missing, or this torch build has no oneDNN
        return False


def _onednn_forward(mod: torch.nn.Linear):
    op = torch.ops.mkldnn._linear_pointwise
    weight, bias = mod.weight, mod.bias

    def forward(x: Tensor) -> Tensor:
        return op(x, weight, bias, "none", [], "")

    return forward


def _geglu(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """diffusers' GEGLU ``h * gelu(gate)`` with ``h, gate = linear(x).chunk(2)``, as two oneDNN GEMMs
    with the erf-GELU and the product fused into their epilogues (no separate passes)."""
    op = torch.ops.mkldnn._linear_pointwise
    n = weight.shape[0] // 2
    bh, bg = (None, None) if bias is None else (bias[:n], bias[n:])
    gate = op(x, weight[n:], bg, "gelu", [], "none")
    return op.binary(x, gate, weight[:n], bh, "mul")


def _geglu_forward(mod: torch.nn.Module):
    weight, bias = mod.proj.weight, mod.proj.bias

    def forward(hidden_states: Tensor, *args, **kwargs) -> Tensor:
        return _geglu(hidden_states, weight, bias)

    return forward


def _is_plain_geglu(mod: torch.nn.Module) -> bool:
    try:
        from diffusers.models.activations import GEGLU
    except ImportError:  # pragma: no cover
        return False
    return type(mod) is GEGLU and type(getattr(mod, "proj", None)) is torch.nn.Linear


def _shared_prefix_forward(mod: torch.nn.Module, n_images: int, n_prompts: int):
    """``mod`` on the first ``n_images`` rows only, its output tiled ``n_prompts`` times.

    Valid for a module whose inputs are identical across prompts: in prompt-major order row
    ``p * B + b`` equals row ``b``.
    """
    orig = mod.forward  # the class's bound forward
    rows = n_images * n_prompts

    def cut(a):
        return a[:n_images] if isinstance(a, Tensor) and a.ndim and a.shape[0] == rows else a

    def tile(out):
        if isinstance(out, Tensor):
            return out.repeat(n_prompts, *([1] * (out.ndim - 1)))
        if isinstance(out, tuple):
            return tuple(tile(o) for o in out)
        raise TypeError(f"cannot tile a {type(out).__name__} output")  # pragma: no cover

    def forward(*args, **kwargs):
        return tile(orig(*(cut(a) for a in args), **{k: cut(v) for k, v in kwargs.items()}))

    return forward


class SharedPromptCrossAttention:
    """Cross-attention for prompt-major rows whose B images share the P prompt embeddings.

    ``encoder_hidden_states`` holds the P prompts only (``(P, S, D)``); the hidden states are
    ``(P * B, L, C)`` with row ``p * B + b``. Keys/values are projected once per prompt and
    the ``B * L`` queries of prompt p attend to them as one batch entry of one SDPA call:
    per query the same softmax over the same keys as ``AttnProcessor2_0`` on P x B rows.
    """

    @staticmethod
    def supports(attn) -> bool:
        return (
            type(attn.processor).__name__ == "AttnProcessor2_0"  # the same maths (no upcast, default scale)
            and getattr(attn, "spatial_norm", None) is None
            and getattr(attn, "group_norm", None) is None
            and not getattr(attn, "norm_cross", None)
            and getattr(attn, "norm_q", None) is None
            and getattr(attn, "norm_k", None) is None
            and not getattr(attn, "residual_connection", False)
        )

    def __call__(self, attn, hidden_states: Tensor, encoder_hidden_states: Tensor | None = None,
                 attention_mask: Tensor | None = None, temb: Tensor | None = None, **kwargs) -> Tensor:
        if encoder_hidden_states is None or attention_mask is not None or hidden_states.ndim != 3:
            raise RuntimeError("SharedPromptCrossAttention: needs 3-d hidden states, prompt states, no mask")
        n, length, _ = hidden_states.shape
        n_prompts = int(encoder_hidden_states.shape[0])
        heads = attn.heads
        q = attn.to_q(hidden_states)
        k = attn.to_k(encoder_hidden_states)
        v = attn.to_v(encoder_hidden_states)
        d = k.shape[-1] // heads
        q = q.view(n_prompts, -1, heads, d).transpose(1, 2)  # (P, h, B*L, d)
        k = k.view(n_prompts, -1, heads, d).transpose(1, 2)  # (P, h, S, d)
        v = v.view(n_prompts, -1, heads, d).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)
        out = out.transpose(1, 2).reshape(n, length, heads * d).to(q.dtype)
        out = attn.to_out[1](attn.to_out[0](out))
        return out / attn.rescale_output_factor


def _prefix_modules(unet) -> list[torch.nn.Module]:
    """Modules of ``unet`` that run before any prompt information enters (see module doc)."""
    cfg = unet.config
    if (getattr(cfg, "addition_embed_type", None) is not None or getattr(cfg, "class_embed_type", None) is not None
            or getattr(unet, "encoder_hid_proj", None) is not None
            or getattr(cfg, "num_class_embeds", None) is not None):
        return []  # the time embedding may carry text: nothing is prompt-independent
    mods: list[torch.nn.Module] = [unet.conv_in]
    d0 = unet.down_blocks[0]
    if not (getattr(d0, "has_cross_attention", False) and len(d0.resnets) and len(getattr(d0, "attentions", []))):
        return mods
    mods.append(d0.resnets[0])
    tr = d0.attentions[0]
    blocks = getattr(tr, "transformer_blocks", None)
    if not blocks or not hasattr(tr, "proj_in"):
        return mods
    mods.append(tr.proj_in)
    blk = blocks[0]
    if (getattr(blk, "norm_type", None) == "layer_norm" and not getattr(blk, "only_cross_attention", True)
            and getattr(blk, "pos_embed", None) is None and not blk.attn1.is_cross_attention):
        mods.append(blk.attn1)
    return mods


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
        a = float(teacher.alphas_cumprod[self.timestep].double())
        self._sqrt_a = math.sqrt(a)
        self._sqrt_1ma = math.sqrt(1.0 - a)
        self._latent_shape = (teacher.latent_channels, self.resolution // f, self.resolution // f)
        self._prompts: OrderedDict[tuple[str, ...], Tensor] = OrderedDict()
        unet = teacher.unet
        cross = [m for m in unet.modules() if getattr(m, "is_cross_attention", False) and hasattr(m, "processor")]
        self._cross = cross if self.fast and cross and all(SharedPromptCrossAttention.supports(m) for m in cross) else []
        self._prefix = _prefix_modules(unet) if self.fast else []
        onednn = (self.fast and teacher.device.type == "cpu" and teacher.dtype == torch.float32
                  and onednn_linear_available())
        self._linears = [m for m in unet.modules() if type(m) is torch.nn.Linear] if onednn else []
        self._geglus = [m for m in unet.modules() if _is_plain_geglu(m)] if onednn else []

    @property
    def block_channels(self) -> dict[int, int]:
        return {b: self.teacher.block_channels[b] for b in self.blocks}

    @property
    def shortcuts(self) -> dict[str, bool]:
        """Which exact shortcuts this featurizer uses (for logs and benchmarks)."""
        return {"shared-prompt-cross-attention": bool(self._cross), "shared-prefix": bool(self._prefix),
                "onednn-linear": bool(self._linears), "onednn-geglu": bool(self._geglus)}

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
    ) -> dict[int, Tensor]:
        """``{block: float32 (B, P, C_b)}`` on CPU for uint8 ``images (B, 3, H, W)``.

        ``ids`` (B,) dataset indices seed each image's noise. ``token_offsets`` (B, D_text), if
        given, is added to every prompt-token embedding of that image's rows (the
        model-conditioned variant). Runs under ``torch.inference_mode``; the returned tensors
        are ordinary tensors (usable as loss targets).
        """
        with torch.inference_mode():
            out = self._extract(images, ids, prompts, token_offsets)
        return {b: v.clone() for b, v in out.items()}  # leave inference mode: normal tensors

    def _extract(
        self, images: Tensor, ids: Tensor, prompts: tuple[str, ...], token_offsets: Tensor | None
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
        l0 = self.encode(images)  # (B, C, h, w) float32
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

    @contextlib.contextmanager
    def _shortcuts(self, n_images: int, n_prompts: int, shared_prompts: bool) -> Iterator[None]:
        """Install the exact shortcuts on the shared teacher for one UNet call; always undone."""
        swapped: list[torch.nn.Module] = []
        procs: list[tuple[torch.nn.Module, object]] = []
        try:
            for m in self._linears:
                m.forward = _onednn_forward(m)
                swapped.append(m)
            for m in self._geglus:
                m.forward = _geglu_forward(m)
                swapped.append(m)
            if n_prompts > 1:
                for m in self._prefix:
                    m.forward = _shared_prefix_forward(m, n_images, n_prompts)  # wraps the linear one too
                    swapped.append(m)
            if shared_prompts:
                proc = SharedPromptCrossAttention()
                for m in self._cross:
                    procs.append((m, m.processor))
                    m.processor = proc
            yield
        finally:
            for m, p in procs:
                m.processor = p
            for m in swapped:
                m.__dict__.pop("forward", None)

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
        fast_cross = shared and bool(self._cross)
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
            with self._shortcuts(B, P, fast_cross):
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
