"""Pixel operations: fitting decoded images to the classifier size, and the per-sample transforms.

``resize_square`` / ``fit_rgb`` run once, when a source decodes a split; ``ImageTransform``
(``train_transform`` / ``eval_transform``) runs per sample in the loader.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from feddifrc_app.data.images import ImageData

CROP_PADDING = 4  # paper: RandomCrop(S, padding=4)
# Horizontal flip changes what a digit means (mirrored 2, 3, 7 are not digits).
NO_FLIP: frozenset[str] = frozenset({"digits", "mnist-5k", "mnist-5k-pool"})


def tv_functional():
    """torchvision's functional transforms, imported where they are first used, never at import.

    Importing torchvision imports torch._dynamo (through torchvision.ops): about 3.5 s of a new
    process on a loaded 2-core machine, and a deployment starts one per message. A message that
    resizes, crops or normalises nothing (a setup query on mnist-5k at its native 28 px) so never
    pays it. (An optimiser's first step imports torch._dynamo anyway: a train message saves little.)
    """
    import torchvision.transforms.v2.functional as TF

    return TF


def resize_square(images: torch.Tensor, size: int, antialias: bool = True) -> torch.Tensor:
    """(N, C, s, s) pixel values in 0..255 -> uint8 (N, C, size, size), bilinear.

    Resized in float and rounded: torchvision's uint8 kernel rounds differently (off by one).
    """
    if images.shape[-1] != size:
        images = tv_functional().resize(images.float(), [size, size], antialias=antialias)
    return images if images.dtype == torch.uint8 else images.round().clamp(0, 255).to(torch.uint8)


def fit_rgb(im, size: int) -> np.ndarray:
    """A PIL image -> uint8 (size, size, 3): RGB, shorter side to ``size``, centre crop."""
    from PIL import Image, ImageOps

    rgb = im.convert("RGB")
    if rgb.size != (size, size):
        rgb = ImageOps.fit(rgb, (size, size), method=Image.Resampling.BILINEAR)
    return np.asarray(rgb, dtype=np.uint8)


@dataclass(frozen=True)
class ImageTransform:
    """uint8 (3, S, S) -> float32 (3, S, S), normalised; optional pad-and-crop and flip.

    Randomness comes from the ``generator`` passed per call (the loader's), so an augmented
    epoch is reproducible from the loader seed alone; torchvision's random transforms draw
    from the global RNG, so only its functional ops are used.
    """

    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    crop_padding: int = 0  # > 0: zero-pad by this much, then a random S x S crop
    flip: bool = False  # random horizontal flip with p = 0.5

    @property
    def random(self) -> bool:
        return self.crop_padding > 0 or self.flip

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        if x.dtype != torch.uint8 or x.ndim != 3 or x.shape[0] != 3:
            raise ValueError(f"expected a uint8 (3, S, S) image, got {x.dtype} {tuple(x.shape)}")
        tf = tv_functional()
        if self.crop_padding:
            p, s = self.crop_padding, x.shape[-1]
            i, j = torch.randint(0, 2 * p + 1, (2,), generator=generator).tolist()
            x = tf.crop(x, i - p, j - p, s, s)  # outside the image = zeros (black), as RandomCrop's padding
        if self.flip and bool(torch.rand((), generator=generator) < 0.5):
            x = tf.horizontal_flip(x)
        return tf.normalize(x.float().div_(255.0), list(self.mean), list(self.std))


def train_transform(data: ImageData) -> ImageTransform:
    """Paper's CIFAR augmentation: RandomCrop(S, padding=4), horizontal flip (not for digits), normalise."""
    return ImageTransform(data.mean, data.std, crop_padding=CROP_PADDING, flip=data.name not in NO_FLIP)


def eval_transform(data: ImageData) -> ImageTransform:
    """Deterministic: normalise only."""
    return ImageTransform(data.mean, data.std)
