"""The GPU check's section B and its dtypes and agreement bounds (``benchmarks/gpu_check.py``),
from the app's rules. ``section_b``: the tiny teachers through the real ``load_teacher`` in
float32 / float16 / bfloat16.

- ``app_dtypes``: the denoiser's and the VAE's dtype a node picks for ``diffusion.dtype = "auto"``
  (``device.resolve_dtype`` with the family's ``AUTO_BF16``: bfloat16 for SDXL and SD3 on a GPU
  that computes it natively, such as Hopper; ``family.vae_dtype``: float32 for SDXL's VAE under
  float16), so section C measures what a run computes.
- ``rounding_bound``: section B holds a GPU's float16 / bfloat16 error to a multiple of the same
  model's error in that dtype on the CPU (its own rounding), never below a fixed floor, so a
  correct GPU never fails on rounding alone while an overflow or a wrong path still does
  (``cpu_errors``, ``judge_rounding``); ``audit``: every component's dtype as loaded.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import featurizer as fb  # the sibling benchmarks: benchmarks/ is on sys.path
import torch
from gpu_check_measure import PROMPTS, finite, images, make_featurizer
from gpu_check_rows import Check

from feddifrc_app.device import resolve_dtype
from feddifrc_app.diffusion.family import family_module, vae_dtype

TINY_MODELS = ("tiny", "tiny-mnist", "tiny-sdxl", "tiny-pixart", "tiny-sd3")
ROUNDING_FACTOR = 4.0  # a GPU's error may be this many times the CPU's in the same dtype
# mantissa bits: of two outputs, the one in the more precise dtype is the reference
PRECISION = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}


def app_dtypes(family: str, device: torch.device, vae_config: dict[str, Any]) -> tuple[torch.dtype, ...]:
    """(denoiser dtype, VAE dtype) for ``diffusion.dtype = "auto"`` on ``device``. ``vae_config``:
    the VAE's config (``family.vae_dtype`` reads it from a teacher folder's ``vae/config.json``:
    written to a temporary one here, as the full-size teachers have no folder)."""
    prefer = bool(family_module(family).AUTO_BF16)
    dtype = resolve_dtype("auto", device, "diffusion.dtype", prefer_bf16=prefer)
    return dtype, vae_dtype_for(family, dtype, vae_config)


def vae_dtype_for(family: str, dtype: torch.dtype, vae_config: dict[str, Any]) -> torch.dtype:
    """``family.vae_dtype`` of a teacher running in ``dtype`` whose VAE has ``vae_config``."""
    with tempfile.TemporaryDirectory(prefix="feddifrc-gpu-check-vae-") as tmp:
        (Path(tmp) / "vae").mkdir()
        (Path(tmp) / "vae" / "config.json").write_text(json.dumps(vae_config))
        return vae_dtype(Path(tmp), family, dtype)


def name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def rounding_bound(floor: float, own: float | None) -> float:
    """``ROUNDING_FACTOR`` x ``own`` (the model's error in the dtype on the CPU; None: not
    measured, as in a dry run, where the CPU's error is the one judged), at least ``floor``."""
    return floor if own is None else max(floor, ROUNDING_FACTOR * own)


def rel_l2(a: dict[int, torch.Tensor], r: dict[int, torch.Tensor]) -> float:
    """The worst relative L2 error of ``a`` against ``r`` over the layers (``featurizer.compare``'s)."""
    return fb.compare(a, r, fp32=True)[2]


def reference_first(a: torch.dtype, b: torch.dtype) -> bool:
    """Whether ``a`` is the more precise of the two (the one the other is compared against)."""
    return PRECISION[a] >= PRECISION[b]


# --------------------------------------------------------------------------- section B


def cpu_errors(c, model: str, feats, ref: dict) -> dict[str, float]:
    """On a GPU host: the model's own rounding, on the CPU (4 images): float16's and bfloat16's
    error against float32 there, and the GPU's float32 against the CPU's (cuDNN's TF32: ~1e-3)."""
    if not c.cuda:
        c.add(f"{model}: cuda vs cpu, fp32", "n/a", "no CUDA in a dry run", verdict="n/a")
        return {}
    k = 4
    _, cpu = feats(torch.device("cpu"), torch.float32, k=k)
    got = {"cuda_vs_cpu": rel_l2({b: v[:k] for b, v in ref.items()}, cpu)}
    e = got["cuda_vs_cpu"]
    c.add(f"{model}: cuda vs cpu, fp32", e, f"{e:.2e}", "report (cuDNN's TF32: ~1e-3)")
    for dtype in (torch.float16, torch.bfloat16):
        got[name(dtype)] = rel_l2(feats(torch.device("cpu"), dtype, k=k)[1], cpu)
    return got


def judge_rounding(c, model: str, dtype: torch.dtype, err: float, floor: float, own: dict) -> float:
    """``err`` (this device's ``dtype`` against its float32) within ``rounding_bound`` of the
    model's own error in ``dtype`` on the CPU (a dry run: the fixed ``floor``, on the CPU's)."""
    mine = own.get(name(dtype))
    bound = rounding_bound(floor, mine)
    short = name(dtype).replace("float", "fp").replace("bfp", "bf")
    what, text = f"<= {bound:.1e}", f"{err:.2e}"
    if mine is not None:
        what, text = (
            f"{what} (max({floor:g}, {ROUNDING_FACTOR:g} x CPU {short}))",
            f"{text}; on the CPU {mine:.2e}",
        )
    c.judge(f"{model}: {short} vs fp32", err, err <= bound, what, text)
    return err


def _dtype_of(module) -> str:
    names = sorted({str(p.dtype).removeprefix("torch.") for p in module.parameters()})
    return "+".join(names).replace("float", "fp").replace("bfp16", "bf16")


def audit(c, model: str, t) -> None:
    """Each component's dtype as loaded, the VAE's force_upcast, and T5's ``wo`` under fp16."""
    pipe = t.parts.get("pipe")
    parts = {"denoiser": t.unet, "vae": t.vae}
    for name in t.adapter.TEXT_PARTS:
        enc = (
            getattr(pipe, name, None)
            if pipe is not None
            else t.text_encoder
            if name == "text_encoder"
            else None
        )
        if enc is not None:
            parts[name] = enc
    dtypes = {k: _dtype_of(m) for k, m in parts.items()}
    upcast = bool(getattr(t.vae.config, "force_upcast", False))
    dt = str(t.dtype).removeprefix("torch.")
    text = ", ".join(f"{k} {v}" for k, v in dtypes.items()) + f"; vae force_upcast={upcast}"
    value = {"components": dtypes, "force_upcast": upcast}
    if t.family == "sdxl" and dtypes["vae"] == "fp16" and upcast:
        bound = "SDXL's VAE encodes in fp32 (it overflows in fp16)"
        c.add(f"{model} {dt}: dtypes", value, text, bound, "WARN")
    else:
        c.add(f"{model} {dt}: dtypes", value, text)
    wo = [m.weight.dtype for enc in parts.values() for n, m in enc.named_modules() if n.endswith(".wo")]
    if wo and t.dtype == torch.float16:
        ok = all(d == torch.float32 for d in wo)
        c.judge(
            f"{model} {dt}: T5 wo", str(wo[0]), ok, "float32 under fp16", str(wo[0]).removeprefix("torch.")
        )


def section_b(c: Check) -> None:
    """The tiny teachers through the real ``load_teacher`` in float32 / float16 / bfloat16."""
    from feddifrc_app.diffusion.pipeline import load_teacher, teacher_resolution
    from feddifrc_app.diffusion.tiny import TINY_RESOLUTION

    n = 4 if c.dry else 16
    x, ids = images(n, seed=1), torch.arange(n)
    c.data["B"] = {}
    for model in TINY_MODELS:
        if not c.time_for(25, model):
            continue
        res = teacher_resolution(model, c.cache_dir) or TINY_RESOLUTION

        def feats(device: torch.device, dtype: torch.dtype, fast=True, k=n, model=model, res=res):
            t = load_teacher(model, c.cache_dir, device, dtype)
            return t, make_featurizer(t, res, fast)(x[:k], ids[:k], PROMPTS)

        _, ref = feats(c.device, torch.float32)
        _, plain = feats(c.device, torch.float32, fast=False)
        out: dict[torch.dtype, dict] = {}
        for dtype in (torch.float16, torch.bfloat16):
            t, out[dtype] = feats(c.device, dtype)
            audit(c, model, t)
        ok = finite(ref, plain, *out.values())
        c.judge(f"{model}: all finite", ok, ok, "fp32, fp16, bf16, plain")
        own = cpu_errors(c, model, feats, ref)
        row: dict[str, Any] = {"cpu": own}
        for dtype, floor in ((torch.float16, 2e-2), (torch.bfloat16, 5e-2)):
            row[name(dtype)] = judge_rounding(c, model, dtype, rel_l2(out[dtype], ref), floor, own)
        row["fast_vs_plain"] = rfp = rel_l2(ref, plain)
        bound = rounding_bound(1e-4, own.get("cuda_vs_cpu"))
        c.judge(f"{model}: fast vs plain, fp32", rfp, rfp <= bound, f"<= {bound:.1e}", f"{rfp:.2e}")
        c.data["B"][model] = row
