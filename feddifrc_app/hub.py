"""Hugging Face Hub offline mode: one place that reads it (teachers and datasets both ask)."""

from __future__ import annotations

import os

import huggingface_hub

_TRUTHY = {"1", "ON", "YES", "TRUE"}


def hub_offline() -> bool:
    """True when the user asked for offline mode: ``HF_HUB_OFFLINE`` (read now, not only when
    ``huggingface_hub`` was imported) or the datasets / transformers switches."""
    env = any(
        os.environ.get(k, "").strip().upper() in _TRUTHY
        for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    )
    return env or huggingface_hub.is_offline_mode()
