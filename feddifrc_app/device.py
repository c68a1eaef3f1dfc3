"""Device and dtype names from the config -> torch objects, and torch's thread count. Never a silent
CPU fallback."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch

from feddifrc_app import log

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class DeviceError(RuntimeError):
    """The configured device or dtype is not available here; the message says what to set."""


def resolve_device(name: str, key: str = "device") -> torch.device:
    """``auto`` -> CUDA when visible, else CPU; ``cpu``; ``cuda`` / ``cuda:N`` (an error without it)."""
    n = str(name).strip().lower()
    if n == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        _say_auto_is_cpu(key)
        return torch.device("cpu")
    if n == "cpu":
        return torch.device("cpu")
    if n != "cuda" and not n.startswith("cuda:"):
        raise DeviceError(f"{key} = {name!r}: expected auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise DeviceError(f"{key} = {name!r}, but {no_cuda_reason()}; or set {key} = 'cpu' to run on the CPU")
    dev = torch.device(n)
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise DeviceError(f"{key} = {name!r} but only {torch.cuda.device_count()} CUDA device(s) exist")
    return dev


def no_cuda_reason() -> str:
    """Why this process has no CUDA device: a CPU-only torch, no GPU given to it, or the driver."""
    if torch.version.cuda is None:
        return (
            f"torch {torch.__version__} is a CPU-only build: install a CUDA build of torch "
            "(pip install torch --index-url https://download.pytorch.org/whl/cu130)"
        )
    if os.environ.get("CUDA_VISIBLE_DEVICES", "x").strip() in ("", "-1"):
        return (
            "this process was given no GPU (CUDA_VISIBLE_DEVICES is empty): in simulation Ray gives a "
            "ClientApp a GPU only with --federation-config 'client-resources-num-gpus=...' above 0"
        )
    try:
        torch.cuda.init()
        detail = "no CUDA device is visible"
    except Exception as e:  # noqa: BLE001 - its message is the reason we report
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return (
        f"torch {torch.__version__} (built for CUDA {torch.version.cuda}) cannot use a GPU here: {detail} "
        "(check `nvidia-smi`: no GPU, or a driver too old for this CUDA version)"
    )


@functools.cache
def _say_auto_is_cpu(key: str) -> None:
    log.info("%s = 'auto' runs on the CPU: %s", key, no_cuda_reason())


def resolve_dtype(
    name: str, device: torch.device, key: str = "dtype", *, prefer_bf16: bool = False
) -> torch.dtype:
    """``auto`` -> ``auto_dtype``; else float32 / float16 / bfloat16.

    ``prefer_bf16``: the model's activations can leave float16's range (SDXL, SD3: the teacher
    family's ``AUTO_BF16``). float16 on the CPU is refused: it computes ~22x slower than
    float32 there (measured with the SD-2.1 UNet), so it is never what anyone wants.
    """
    n = str(name).strip().lower()
    if n == "auto":
        return auto_dtype(device.type, prefer_bf16, prefer_bf16 and _cuda_bf16(device))
    if n not in _DTYPES:
        raise DeviceError(f"{key} = {name!r}: expected auto, float32, float16 or bfloat16")
    if n == "float16" and device.type == "cpu":
        raise DeviceError(
            f"{key} = 'float16' on the CPU runs ~22x slower than float32; set {key} = 'float32' "
            "(or 'auto': float32 on the CPU)"
        )
    return _DTYPES[n]


def auto_dtype(device_type: str, prefer_bf16: bool, bf16_supported: bool) -> torch.dtype:
    """What ``auto`` means: float32 off CUDA; on CUDA bfloat16 for a model that prefers it where
    the GPU computes it natively (``bf16_supported``), else float16."""
    if device_type != "cuda":
        return torch.float32
    return torch.bfloat16 if prefer_bf16 and bf16_supported else torch.float16


def _cuda_bf16(device: torch.device) -> bool:
    """Native bfloat16 (compute capability 8.0+); emulated bfloat16 (older GPUs) is slow."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    with torch.cuda.device(device):
        return torch.cuda.is_bf16_supported(including_emulation=False)


# Threads of the teacher's feature extraction and target fusion, whatever the node's train.threads:
# their results are cached and shared by every run on the cache folder, and the float sums of a
# convolution depend on how many threads split it (measured on the quickstart's 600 images: 1.1%
# of the float32 features differ between 1 and 2 threads, 24 of 1,056,000 after float16 rounding).
EXTRACTION_THREADS = 1
# torch's intra-op threads before this app set any (read at import: configure_torch changes them).
TORCH_DEFAULT_THREADS = torch.get_num_threads()


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads = ``n`` inside the block, the previous count restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def node_threads(configured: int) -> int:
    """``train.threads``: N > 0 as given; 0 = ``OMP_NUM_THREADS`` of the node's environment (Ray
    sets it to client-resources-num-cpus in a simulation's actors), or, where it is unset (a
    deployment's SuperNode without it), torch's own default (a thread per core, as torch chooses):
    such a node's numbers then follow its host's cores (docs/results.md, "Reproducibility")."""
    if configured > 0:
        return configured
    raw = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not raw:
        return TORCH_DEFAULT_THREADS
    first = raw.split(",")[0].strip()  # OpenMP's nested form "4,2": the outer level's
    if not first.isdigit() or int(first) < 1:
        raise DeviceError(f"OMP_NUM_THREADS = {raw!r}: expected a positive integer (or set train.threads)")
    return int(first)


def platform_info() -> dict[str, str]:
    """What a run's bits are conditional on besides its config (docs/results.md, "Reproducibility"):
    the torch build, the CPU kernels torch picked (``AVX2``, ``AVX512``, ...) and the machine."""
    import platform

    return {
        "torch": torch.__version__,
        "cpu-kernels": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine(),
    }
