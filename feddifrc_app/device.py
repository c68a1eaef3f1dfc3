"""Device and dtype names from the config -> torch objects. Never a silent CPU fallback."""

from __future__ import annotations

import os

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class DeviceError(RuntimeError):
    """The configured device or dtype is not available here; the message says what to set."""


def resolve_device(name: str, key: str = "device") -> torch.device:
    """``auto`` -> CUDA when visible, else CPU; ``cpu``; ``cuda`` / ``cuda:N`` (an error without it)."""
    n = str(name).strip().lower()
    if n == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if n == "cpu":
        return torch.device("cpu")
    if n != "cuda" and not n.startswith("cuda:"):
        raise DeviceError(f"{key} = {name!r}: expected auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise DeviceError(
            f"{key} = {name!r} but torch {torch.__version__} sees no CUDA device "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}); set it to "
            "'auto' or 'cpu', or give the ClientApp a GPU (client-resources-num-gpus > 0)"
        )
    dev = torch.device(n)
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise DeviceError(f"{key} = {name!r} but only {torch.cuda.device_count()} CUDA device(s) exist")
    return dev


def resolve_dtype(name: str, device: torch.device, key: str = "dtype") -> torch.dtype:
    """``auto`` -> float16 on CUDA, float32 on CPU; else float32 / float16 / bfloat16."""
    n = str(name).strip().lower()
    if n == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    if n in _DTYPES:
        return _DTYPES[n]
    raise DeviceError(f"{key} = {name!r}: expected auto, float32, float16 or bfloat16")
