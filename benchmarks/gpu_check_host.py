"""The GPU check's section A (``benchmarks/gpu_check.py``): the host. Versions, the device, the
bf16 matmul and copy ceilings, and device resolution in a process given no GPU."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import torch
from gpu_check_measure import timed
from gpu_check_rows import Check, clip

ROOT = Path(__file__).resolve().parents[1]


def section_a(c: Check) -> None:
    """Versions, device, the bf16 matmul and copy ceilings, device resolution without a GPU."""
    c.add("torch", torch.__version__, f"{torch.__version__} (CUDA {torch.version.cuda})")
    names = ("diffusers", "transformers", "accelerate", "torchvision", "requests", "flwr", "ray")
    pkgs = {p: _version(p) for p in names}
    c.add("packages", pkgs, ", ".join(f"{k} {v}" for k, v in pkgs.items()))
    c.data["A"] = {"packages": pkgs}
    if c.cuda:
        p = torch.cuda.get_device_properties(c.device)
        cap = torch.cuda.get_device_capability(c.device)
        c.add("device", p.name, f"{p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs")
        c.judge("capability", list(cap), cap == (9, 0), "(9, 0): H100 / H200", str(cap), warn=True)
        n, dtype, copy_bytes = 8192, torch.bfloat16, 4 * 2**30
    else:
        c.add(
            "device", "cpu", f"CPU, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads (dry run)"
        )
        n, dtype, copy_bytes = 512, torch.float32, 64 * 2**20
    c.data["A"]["matmul_tflops"] = tflops = _matmul_tflops(n, dtype, c.device)
    what = f"matmul {n}^3 {str(dtype).removeprefix('torch.')}"
    c.judge(what, tflops, tflops >= 600, ">= 600 TFLOP/s", f"{tflops:.1f} TFLOP/s (median of 10)", gpu=True)
    gbps = _copy_gbps(copy_bytes, c.device)
    c.add(f"copy {copy_bytes / 2**30:g} GiB on the device", gbps, f"{gbps:.0f} GB/s read + write")
    _device_resolution(c)


def _matmul_tflops(n: int, dtype: torch.dtype, device: torch.device) -> float:
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    return 2 * n**3 / statistics.median(timed(lambda: a @ b, device, warmup=3, reps=10)) / 1e12


def _copy_gbps(nbytes: int, device: torch.device) -> float:
    """Bytes read plus bytes written per second by a device-to-device copy."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    return 2 * nbytes / statistics.median(timed(lambda: y.copy_(x), device, warmup=2, reps=5)) / 1e9


def _version(name: str) -> str:
    """The installed version of an importable package, else "absent"."""
    try:
        if importlib.util.find_spec(name) is None:
            return "absent"
    except ImportError:
        return "absent"
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "present"


_RESOLVE = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
from feddifrc_app.device import DeviceError, resolve_device
out = {"auto": str(resolve_device("auto"))}
try:
    out["cuda"] = "no error: " + str(resolve_device("cuda"))
except DeviceError as e:
    out["cuda"] = "DeviceError: " + str(e)
print(json.dumps(out))
"""


def _device_resolution(c: Check) -> None:
    """In a process given no GPU (CUDA_VISIBLE_DEVICES=""): auto -> cpu with the reason logged,
    cuda -> DeviceError naming Ray (how a ClientApp gets a GPU), or the CPU-only torch build."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    p = subprocess.run([sys.executable, "-c", _RESOLVE], env=env, capture_output=True, text=True, timeout=300)
    try:
        got = json.loads(p.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise RuntimeError(f"the device-resolution process failed: {clip(p.stderr.strip(), 300)}") from None
    logged = next((ln for ln in p.stderr.splitlines() if "runs on the CPU" in ln), "")
    c.judge(
        "no GPU: resolve_device('auto')",
        got["auto"],
        got["auto"] == "cpu" and "CUDA_VISIBLE_DEVICES" in logged,
        "cpu, the reason logged",
        f"{got['auto']}; logged: {clip(logged, 70) or 'nothing'}",
    )
    want = "Ray" if torch.version.cuda else "CPU-only build"
    ok = got["cuda"].startswith("DeviceError") and want in got["cuda"]
    c.judge(
        "no GPU: resolve_device('cuda')",
        got["cuda"],
        ok,
        f"DeviceError naming {want}",
        clip(got["cuda"], 90),
    )
