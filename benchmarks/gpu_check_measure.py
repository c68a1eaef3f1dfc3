"""The GPU check's measuring tools (``benchmarks/gpu_check.py``): timing on the device, profiles
and their kernels, test images, and the app's Featurizer fed stand-in prompt embeddings."""

from __future__ import annotations

import gc
import time

import featurizer as fb  # the sibling benchmarks: benchmarks/ is on sys.path
import full_size as fs
import torch

PROMPTS = tuple(f"a photo of a {d}" for d in fb.DIGITS) + ("",)  # 10 class prompts + the NDCR one
GB = 1e9  # card sizes are quoted in GB


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, warmup: int, reps: int) -> list[float]:
    """Seconds of each of ``reps`` calls after ``warmup`` (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    sync(device)
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return out


def images(n: int, seed: int, size: int = 32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, size, size), generator=g, dtype=torch.uint8)


def finite(*outs: dict[int, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(v).all()) for out in outs for v in out.values())


def make_featurizer(teacher, resolution: int, fast: bool = True):
    """The app's Featurizer over the family's default layers (t = 300, one draw, seed 0)."""
    from feddifrc_app.diffusion.featurizer import Featurizer

    n = len(getattr(teacher.unet, teacher.adapter.LAYER_ATTR))
    blocks = teacher.adapter.default_layers(n)
    return Featurizer(
        teacher, resolution=resolution, timestep=300, blocks=blocks, ensemble=1, seed=0, fast=fast
    )


def stand_in_featurizer(teacher, resolution: int, fast: bool = True, seed: int = 0):
    """A Featurizer whose prompt memo already holds stand-in embeddings for ``PROMPTS``: the call
    then runs the real path (encode, noise, denoiser, pooling, D2H) without a text encoder."""
    feat = make_featurizer(teacher, resolution, fast)
    feat._prompts[PROMPTS] = fs.stand_in(teacher, len(PROMPTS), seed=seed)
    return feat


def profiled(fn, device: torch.device):
    """(profile, wall seconds) of one ``fn()`` call."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        fn()
        sync(device)
        wall = time.perf_counter() - t0
    return prof, wall


def kernel_seconds(prof) -> dict[str, float]:
    """Device seconds per CUDA kernel name ({} without CUDA activity)."""
    from torch.autograd import DeviceType

    out: dict[str, float] = {}
    events = prof.key_averages()
    for e in events:
        if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0:
            out[e.key] = out.get(e.key, 0.0) + e.self_device_time_total / 1e6
    if not out:  # a layout without kernel rows: the self device time of the ops that launched them
        out = {e.key: e.self_device_time_total / 1e6 for e in events if e.self_device_time_total > 0}
    return out


def attention_ops(prof) -> list[str]:
    """The scaled-dot-product-attention implementations the profile ran (aten op names)."""
    return sorted({e.key for e in prof.key_averages() if "_scaled_dot_product" in e.key})
