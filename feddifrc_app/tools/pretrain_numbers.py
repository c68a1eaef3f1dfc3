"""The numbers of ``feddifrc pretrain-teacher``'s recipe (recipe.py trains with them), torch-free:
``feddifrc pretrain-teacher --help`` shows their defaults without importing torch."""

from __future__ import annotations

from dataclasses import dataclass

KL_WEIGHT = 1e-7
EMPTY_PROMPT_RATE = 0.1
FAMILIES = ("sd", "pixart")  # what pretrain-teacher trains (diffusers pipeline families)


@dataclass(frozen=True)
class PretrainRecipe:
    """Every number that shapes the teacher (recorded in the folder's ``feddifrc.json``)."""

    seed: int = 0
    family: str = "sd"  # sd: UNet + CLIP (tiny-mnist); pixart: DiT + T5
    resolution: int = 32
    batch_size: int = 64
    vae_steps: int = 300
    vae_lr: float = 1e-3
    vae_lr_end: float = 2e-4
    unet_steps: int = 1200
    unet_lr: float = 1e-3
    unet_lr_end: float = 1e-4
    unet_warmup: int = 100
    weight_decay: float = 1e-2
    ema_decay: float = 0.995
    empty_prompt_rate: float = EMPTY_PROMPT_RATE
    kl_weight: float = KL_WEIGHT

    def __post_init__(self) -> None:
        if self.resolution < 4 or self.resolution % 4:
            raise ValueError(
                f"resolution={self.resolution}: expected a positive multiple of 4 (the VAE factor)"
            )
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r}: expected one of {', '.join(FAMILIES)}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size}: expected >= 1")
        for name in ("vae_steps", "unet_steps", "unet_warmup", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: expected >= 0")
        if not 0.0 <= self.empty_prompt_rate <= 1.0 or not 0.0 <= self.ema_decay < 1.0:
            raise ValueError("empty_prompt_rate must be in [0, 1] and ema_decay in [0, 1)")
