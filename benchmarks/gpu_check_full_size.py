"""The GPU check's sections C and D (``benchmarks/gpu_check.py``): the full-size models.

C. the four full-size denoisers (random weights on the device in the dtypes ``diffusion.dtype =
   "auto"`` picks, stand-in prompt embeddings of the real shapes) through the real Featurizer:
   images/s, TFLOP/s, peak memory, GPU-busy fraction and attention kernels per batch size;
D. the text encoders' memory and one encode, and GPU memory per actor and family.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import full_size as fs  # the sibling benchmarks: benchmarks/ is on sys.path
import gpu_check_dtypes as gd
import torch
from gpu_check_dtypes import rel_l2
from gpu_check_measure import (
    GB,
    PROMPTS,
    attention_ops,
    finite,
    free_memory,
    images,
    kernel_seconds,
    profiled,
    stand_in_featurizer,
    timed,
)
from gpu_check_rows import Check, clip

H200_MATMUL_TFLOPS = (
    790.0  # bf16 8192^3, the figure the images/s bounds are drawn from (section A measures it)
)
CONTEXT_BYTES = 0.6 * GB  # a CUDA context and the allocator's slack, per process
ATTENTION_FAST = ("flash", "fmha", "cudnn", "efficient")


# --------------------------------------------------------------------------- C


def _ips_bound(f: fs.Family) -> float:
    """images/s at 25% of the H200's bf16 matmul ceiling, from the estimated GFLOP per image."""
    return 0.25 * H200_MATMUL_TFLOPS * 1e3 / f.gflop


def section_c(c: Check) -> None:
    """The full-size denoisers: speed, memory, busy fraction and kernels at several batch sizes."""
    c.data["C"] = {}
    for fam, f in fs.FAMILIES.items():
        if not c.time_for(35, f"{f.label}: full-size denoiser"):
            continue
        try:
            _family_speed(c, fam, f)
        except ModuleNotFoundError:
            raise
        except Exception as e:  # one family's failure (an OOM) leaves the others to run
            c.fail(f"{f.label}: full-size denoiser", e)
        finally:
            free_memory()


def _family_speed(c: Check, fam: str, f: fs.Family) -> None:
    res = 64 if c.dry else 224
    sizes = (1, 2) if c.dry else ((8, 32, 64, 128) if fam == "sd" else (8, 32, 64))
    extra_b = 2 if c.dry else 32
    reps = 1 if c.dry else 3
    d: dict[str, Any] = {"per_b": {}}
    c.data["C"][fam] = d
    teacher = _build(c, fam, f, d)
    feat = stand_in_featurizer(teacher, res)
    x, ids = images(max(sizes), seed=2), torch.arange(max(sizes))
    from torch.utils.flop_counter import FlopCounterMode

    b0 = sizes[0]
    with FlopCounterMode(display=False) as fc:
        feat(x[:b0], ids[:b0], PROMPTS)
    d["gflop_per_image"] = gflop = fc.get_total_flops() / b0 / 1e9
    est = "" if c.dry else f"estimate {f.gflop:,.0f}"
    c.add(f"{f.label}: GFLOP per image", gflop, f"{gflop:,.1f} at {res} px, {len(PROMPTS)} prompts", est)
    outs = {}
    for b in sizes:
        if not c.time_for(10, f"{f.label}: B={b}"):
            break
        try:
            outs[b], d["per_b"][b] = _speed_at(c, feat, x[:b], ids[:b], reps, gflop)
        except torch.OutOfMemoryError:
            c.add(f"{f.label}: B={b}", "out of memory", verdict="WARN")
            break
        r, ceiling = d["per_b"][b], c.data.get("A", {}).get("matmul_tflops")
        share = f" ({100 * r['tflops'] / ceiling:.0f}% of the matmul ceiling)" if ceiling else ""
        mem = f", peak {r['peak_bytes'] / GB:.1f} GB" if c.cuda else ""
        c.add(f"{f.label}: B={b}", r["ips"], f"{r['ips']:.1f} img/s, {r['tflops']:.2f} TFLOP/s{share}{mem}")
    if not d["per_b"]:
        return
    best = max(d["per_b"], key=lambda b: d["per_b"][b]["ips"])
    d["best_b"], ips = best, d["per_b"][best]["ips"]
    bound = _ips_bound(f)
    c.judge(
        f"{f.label}: images/s at best B={best}", ips, ips >= bound, f">= {bound:.0f}", f"{ips:.1f}", gpu=True
    )
    ok = finite(*outs.values())
    c.judge(f"{f.label}: outputs finite", ok, ok, "finite (random weights: WARN only)", warn=True)
    _profile(c, f, feat, x[:best], ids[:best], d)
    if fam in ("sd", "sdxl") and c.time_for(15, f"{f.label}: fast vs plain"):
        _fast_vs_plain(c, f, teacher, feat, xb=x[:extra_b], ib=ids[:extra_b], reps=reps, d=d)
    if fam in ("sd", "sd3") and c.time_for(20, f"{f.label}: another dtype"):
        teacher = _other_dtype(c, fam, f, teacher, feat, x=x, ids=ids, res=res, reps=reps, d=d)
        feat = stand_in_featurizer(teacher, res)
    if fam == "sd" and c.time_for(30, "SD-2.1: cudnn.benchmark and channels_last"):
        _layout_ab(c, teacher, feat, x=x[:extra_b], ids=ids[:extra_b], reps=reps, d=d)


def _build(c: Check, fam: str, f: fs.Family, d: dict) -> Any:
    """The random full-size teacher on the device in the dtypes ``diffusion.dtype = "auto"``
    picks there (``gd.app_dtypes``: bfloat16 for SDXL and SD3 on Hopper, SDXL's VAE in float32
    under float16); its parameters against the published count (on the meta device in a dry run,
    where the model is shrunk)."""
    dtype, vae = gd.app_dtypes(fam, c.device, f.vae)
    d["dtype"], d["vae_dtype"] = gd.name(dtype), gd.name(vae)
    c.add(f"{f.label}: dtype", d["dtype"], f"{d['dtype']}, VAE {d['vae_dtype']} (diffusion.dtype = auto)")
    t0 = time.perf_counter()
    teacher = fs.teacher(fam, c.device, dtype, small=c.dry, vae_dtype=vae)
    d["build_s"] = time.perf_counter() - t0
    params = fs.count_params(fam) if c.dry else sum(p.numel() for p in teacher.unet.parameters())
    c.judge(
        f"{f.label}: parameters", params, params == fs.PARAMS[fam], f"= {fs.PARAMS[fam]:,}", f"{params:,}"
    )
    d["weights_bytes"] = sum(
        p.numel() * p.element_size() for m in (teacher.unet, teacher.vae) for p in m.parameters()
    )
    return teacher


def _fast_vs_plain(c: Check, f: fs.Family, teacher, feat, *, xb, ib, reps: int, d: dict) -> None:
    plain = stand_in_featurizer(teacher, feat.resolution, fast=False)
    rel = rel_l2(feat(xb, ib, PROMPTS), plain(xb, ib, PROMPTS))
    fast_s, plain_s = (
        statistics.median(timed(lambda m=m: m(xb, ib, PROMPTS), c.device, 0, reps)) for m in (feat, plain)
    )
    d["fast_vs_plain"] = {"rel_l2": rel, "speedup": plain_s / fast_s}
    text = f"{rel:.2e}; the fast path {plain_s / fast_s:.2f}x the plain one's speed at B={len(xb)}"
    c.judge(f"{f.label}: fast vs plain", rel, rel <= 3e-2, "<= 3e-2", text)


def _speed_at(c: Check, feat, x, ids, reps: int, gflop: float) -> tuple[dict, dict[str, Any]]:
    """(features, {ips, tflops, peak_bytes}) of ``reps`` calls on the batch ``x`` after a warm-up."""
    if c.cuda:
        torch.cuda.reset_peak_memory_stats(c.device)
    feat(x, ids, PROMPTS)  # warm-up: kernels, the allocator
    walls = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = feat(x, ids, PROMPTS)  # ends with the copy to the host: synchronous
        walls.append(time.perf_counter() - t0)
    ips = len(x) / statistics.median(walls)
    peak = torch.cuda.max_memory_allocated(c.device) if c.cuda else None
    return out, {"ips": ips, "tflops": ips * gflop / 1e3, "peak_bytes": peak}


def _profile(c: Check, f: fs.Family, feat, x, ids, d: dict) -> None:
    """One profiled call: GPU-busy fraction (kernel time / wall), top kernels, attention kernels."""
    prof, wall = profiled(lambda: feat(x, ids, PROMPTS), c.device)
    kernels = kernel_seconds(prof)
    ops = attention_ops(prof)
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:8]
    d["profile"] = {"wall_s": wall, "top_kernels": top, "attention_ops": ops}
    attn_kernels = sorted(k for k in kernels if any(w in k.lower() for w in (*ATTENTION_FAST, "attention")))
    d["profile"]["attention_kernels"] = attn_kernels
    if c.cuda:
        busy = sum(kernels.values()) / wall
        d["profile"]["busy"] = busy
        c.judge(
            f"{f.label}: GPU busy at B={len(x)}",
            busy,
            busy >= 0.9,
            ">= 0.9 (below: launch-bound)",
            f"{busy:.2f}",
            warn=True,
        )
        c.add(
            f"{f.label}: top kernels", top, "; ".join(f"{clip(k, 40)} {1e3 * s:.1f} ms" for k, s in top[:3])
        )
    names = " ".join([*ops, *attn_kernels]).lower()
    fast = any(w in names for w in ATTENTION_FAST)
    math = "attention_math" in names
    c.judge(
        f"{f.label}: attention",
        {"ops": ops, "kernels": attn_kernels},
        fast and not math,
        "flash / fmha / cudnn / efficient, no math path",
        ", ".join(ops + attn_kernels[:2]) or "no SDPA op seen",
        gpu=True,
    )


def _other_dtype(c: Check, fam: str, f: fs.Family, teacher, feat, *, x, ids, res: int, reps: int, d: dict):
    """SD against float32 at B=8 (float16's error); SD3 in the other half-precision dtype than
    the app's (float16 where it picks bfloat16: its speed and distance); a dry run compares
    float32 with bfloat16. Returns the teacher back in its own dtypes."""
    own, own_vae = teacher.dtype, teacher.vae.dtype
    half = torch.float16 if own == torch.bfloat16 else torch.bfloat16
    other = torch.bfloat16 if c.dry else (torch.float32 if fam == "sd" else half)
    b = 1 if c.dry else (8 if fam == "sd" else 32)
    xb, ib = x[:b], ids[:b]
    base = feat(xb, ib, PROMPTS)
    base_s = statistics.median(timed(lambda: feat(xb, ib, PROMPTS), c.device, 0, reps))
    t2 = fs.recast(teacher, other, gd.vae_dtype_for(fam, other, f.vae))
    f2 = stand_in_featurizer(t2, res)
    got = f2(xb, ib, PROMPTS)
    other_s = statistics.median(timed(lambda: f2(xb, ib, PROMPTS), c.device, 1, reps))
    rel = rel_l2(base, got) if gd.reference_first(other, own) else rel_l2(got, base)  # vs the more precise
    a, o = gd.name(own), gd.name(other)
    d["other_dtype"] = {"dtype": o, "rel_l2": rel, "speed_ratio": base_s / other_s, "finite": finite(got)}
    text = f"{rel:.2e}; {o} runs at {base_s / other_s:.2f}x the speed of {a} (B={b}); finite: {finite(got)}"
    item = f"{f.label}: {a} vs {o}"
    if fam == "sd" and other == torch.float32:
        c.judge(item, rel, rel <= 2e-2, "<= 2e-2", text)
    else:
        c.add(item, rel, text, "report")
    return fs.recast(t2, own, own_vae)


def _layout_ab(c: Check, teacher, feat, *, x, ids, reps: int, d: dict) -> None:
    """Speed with cudnn.benchmark, and with channels_last UNet and VAE, each against the default."""

    def speed() -> float:
        return len(x) / statistics.median(timed(lambda: feat(x, ids, PROMPTS), c.device, 1, reps))

    base = speed()
    was = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        bench = speed()
    finally:
        torch.backends.cudnn.benchmark = was
    for m in (teacher.unet, teacher.vae):
        m.to(memory_format=torch.channels_last)
    try:
        cl = speed()
    finally:
        for m in (teacher.unet, teacher.vae):
            m.to(memory_format=torch.contiguous_format)
    d["layout"] = {"base_ips": base, "cudnn_benchmark": bench / base, "channels_last": cl / base}
    c.add(
        "SD-2.1: cudnn.benchmark",
        bench / base,
        f"{bench / base:.2f}x ({bench:.1f} img/s at B={len(x)})",
        "report",
    )
    c.add("SD-2.1: channels_last", cl / base, f"{cl / base:.2f}x ({cl:.1f} img/s at B={len(x)})", "report")


# --------------------------------------------------------------------------- D


def section_d(c: Check) -> None:
    """Each text encoder's memory and one 11-prompt encode; then GPU memory per actor and family."""
    weights: dict[str, float] = {}
    d: dict[str, Any] = {"encoders": {}, "actors": {}}
    c.data["D"] = d
    for name in fs.TEXT_ENCODERS:
        if not c.time_for(20, name):
            continue
        weights[name], ms = _encoder_cost(c, name)
        d["encoders"][name] = {"bytes": weights[name], "encode_ms": ms}
        how = "allocated" if c.cuda else "parameter bytes of the shrunk model"
        enc = ", ".join(f"{v:.1f} ms at {k} tokens" for k, v in ms.items())
        c.add(name, weights[name], f"{weights[name] / GB:.3f} GB {how}; 11 prompts: {enc}")
        free_memory()
    for fam, f in fs.FAMILIES.items():
        _actor_memory(c, fam, f, weights, d)


def _encoder_cost(c: Check, name: str) -> tuple[float, dict[int, float]]:
    """(bytes the encoder holds, ms of one encode of ``PROMPTS`` per token length)."""
    before = torch.cuda.memory_allocated(c.device) if c.cuda else 0
    m = fs.text_encoder(name, c.device, c.dtype, small=c.dry)
    if c.cuda:
        held = torch.cuda.memory_allocated(c.device) - before
    else:
        held = sum(p.numel() * p.element_size() for p in m.parameters())
    ms = {}
    for n_tok in (120, 256) if name.startswith("t5") else (77,):
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, int(m.config.vocab_size), (len(PROMPTS), n_tok), generator=g).to(c.device)
        with torch.inference_mode():
            ms[n_tok] = 1e3 * statistics.median(timed(lambda ids=ids: m(input_ids=ids), c.device, 1, 3))
    return held, ms


def _actor_memory(c: Check, fam: str, f: fs.Family, weights: dict[str, float], d: dict) -> None:
    """Denoiser + VAE + activations (section C's peak at its best B) + the family's text encoders
    + a CUDA context; how many such actors fit a 141, 80 and 24 GB card."""
    cd = c.data.get("C", {}).get(fam, {})
    missing = [t for t in f.texts if t not in weights]
    if "best_b" not in cd or missing:
        c.add(f"{f.label}: memory per actor", "n/a", f"not measured (C: {'best_b' in cd}; missing {missing})")
        return
    b = cd["best_b"]
    peak = cd["per_b"][b]["peak_bytes"] if c.cuda else cd["weights_bytes"]  # no activation peak on a CPU
    texts = sum(weights[t] for t in f.texts)
    actor = peak + texts + CONTEXT_BYTES
    no_t5 = actor - weights["t5-xxl"] if "t5-xxl" in f.texts else None
    fits = {gb: int(gb * GB // actor) for gb in (141, 80, 24)}
    d["actors"][fam] = {"b": b, "bytes": actor, "without_t5_bytes": no_t5, "fit": fits}
    text = f"{actor / GB:.1f} GB at B={b}"
    text += f" ({no_t5 / GB:.1f} GB without T5 resident)" if no_t5 is not None else ""
    text += "; actors per 141/80/24 GB: " + "/".join(str(v) for v in fits.values())
    c.judge(f"{f.label}: memory per actor", actor, actor <= 70 * GB, "<= 70 GB (2 per H200)", text, gpu=True)
