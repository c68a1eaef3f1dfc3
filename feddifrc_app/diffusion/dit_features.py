"""DiT block outputs read the way the network reads them (``diffusion.dit-features``).

A diffusion transformer's residual stream is only ever read through an adaptive LayerNorm:
each block normalises its input (LayerNorm without affine) and modulates it with a per-timestep
``(1 + scale)`` and ``shift``. DiTF (arXiv 2505.18584, ``ganchaofan0000/DiTF``) reads features
exactly there; raw block outputs instead carry "massive activations" (a few fixed channels,
large on every token) that dominate a pooled vector. Modes:

- ``raw``: the block output as it is (the default; today's features and keys);
- ``adaln``: layer b's output, LayerNorm'd and modulated with the modulation the network
  applies to it next: block b + 1's first AdaLN (PixArt: its ``scale_shift_table`` plus the
  ``adaln_single`` timestep embedding; SD3: its ``norm1`` on the image stream), the output
  layer's for the last block. This is DiTF's feature at block b + 1 (the input of its
  attention), so layer b keeps its depth in every mode;
- ``adaln-drop``: as ``adaln`` with the massive channels zeroed before the LayerNorm (DiTF's
  channel discard: they no longer set its mean and variance);
- ``adaln-rescale``: as ``adaln`` with each massive channel scaled down to the typical channel's
  magnitude before the LayerNorm (its per-token variation, which can carry prompt
  information, is kept).

Massive channels are found per row (one image under one prompt), from the row's tokens alone,
so a feature never depends on its batch: channel c is massive when the median over tokens of
``|h_c|`` exceeds ``MASSIVE_RATIO`` times the median of that over channels, i.e. it is that much
larger than a typical channel on at least half the tokens. Sun et al. (2024) call activations
massive at about 1000x the median magnitude; 100x leaves a factor 10 of margin below that while
staying far above an ordinary heavy-tailed channel (10x), and the median over tokens ignores a
channel that spikes on a few tokens only.

A family opts in with ``DIT_COND_ATTR`` (the denoiser module whose output is the conditioning
the modulations are computed from) and ``modulation(denoiser, b, cond) -> (shift, scale, eps)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import torch
from torch import Tensor

from feddifrc_app.diffusion.family import FamilyError

MODES = ("raw", "adaln", "adaln-drop", "adaln-rescale")  # diffusion.dit-features
MASSIVE_RATIO = 100.0


def check_mode(mode: str, family: str, adapter: ModuleType) -> str:
    """``mode`` if the family can be read that way, else a one-line FamilyError (a ValueError)."""
    if mode not in MODES:
        raise FamilyError(f"diffusion.dit-features = {mode!r}; choose one of {', '.join(MODES)}")
    if mode != "raw" and getattr(adapter, "DIT_COND_ATTR", None) is None:
        raise FamilyError(
            f"diffusion.dit-features = {mode!r} reads AdaLN-modulated transformer blocks; this {family} "
            "teacher has none (use 'raw', or a pixart / sd3 teacher)"
        )
    return mode


def massive_channels(h: Tensor, ratio: float = MASSIVE_RATIO) -> tuple[Tensor, Tensor]:
    """Tokens ``(rows, N, D)`` -> (bool ``(rows, D)``: the row's massive channels, float32
    ``(rows, D)``: each channel's median ``|h|`` over tokens, ``(rows, 1)``: the row's typical
    channel magnitude)."""
    med = h.float().abs().median(dim=1).values  # (rows, D)
    typical = med.median(dim=1, keepdim=True).values  # (rows, 1)
    return med > ratio * typical, med, typical


def tame(h: Tensor, mode: str, ratio: float = MASSIVE_RATIO) -> Tensor:
    """float32 tokens with the massive channels zeroed (``adaln-drop``) or scaled by
    ``typical / median |h_c|`` (``adaln-rescale``); unchanged for the other modes."""
    h = h.float()
    if mode not in ("adaln-drop", "adaln-rescale"):
        return h
    massive, med, typical = massive_channels(h, ratio)
    if mode == "adaln-drop":
        factor = (~massive).float()
    else:
        factor = torch.where(massive, typical / med.clamp_min(torch.finfo(torch.float32).tiny), 1.0)
    return h * factor[:, None, :]


def adaln(h: Tensor, shift: Tensor, scale: Tensor, eps: float) -> Tensor:
    """``LayerNorm(h) * (1 + scale) + shift`` per row: ``h (rows, N, D)``, ``shift, scale (rows, D)``;
    the LayerNorm has no affine, as the DiTs' own (float32 here)."""
    x = torch.nn.functional.layer_norm(h.float(), (int(h.shape[-1]),), eps=eps)
    return x * (1 + scale.float()[:, None, :]) + shift.float()[:, None, :]


class Reader:
    """Turns a hooked DiT layer's output into its ``mode`` feature tokens within one denoiser call.

    ``capturing()`` hooks the family's conditioning module for the call; ``__call__(b, output)``
    returns the output unchanged under ``raw``, else the float32 normalised image tokens."""

    def __init__(self, denoiser, adapter: ModuleType, mode: str, family: str = "") -> None:
        self.mode = check_mode(mode, family or adapter.__name__.rsplit(".", 1)[-1], adapter)
        self.denoiser, self.adapter = denoiser, adapter
        self._cond: object = None

    @contextmanager
    def capturing(self) -> Iterator[None]:
        if self.mode == "raw":
            yield
            return

        def keep(_module, _inputs, output) -> None:
            self._cond = output

        handle = getattr(self.denoiser, self.adapter.DIT_COND_ATTR).register_forward_hook(keep)
        try:
            yield
        finally:
            handle.remove()
            self._cond = None

    def __call__(self, b: int, output):
        if self.mode == "raw":
            return output
        if self._cond is None:  # pragma: no cover - the conditioning module runs before any block
            raise RuntimeError(f"{self.adapter.DIT_COND_ATTR} gave no conditioning before layer {b}")
        h = self.adapter.image_tokens(output)
        shift, scale, eps = self.adapter.modulation(self.denoiser, b, self._cond)
        return adaln(tame(h, self.mode), shift, scale, eps)
