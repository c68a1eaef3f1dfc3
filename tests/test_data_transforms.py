"""data.transforms: normalisation, the pad-and-crop window, the flip policy."""

from __future__ import annotations

import dataclasses

import torch
from data_helpers import dcfg, digits

from feddifrc_app.data.registry import load_dataset
from feddifrc_app.data.transforms import ImageTransform, eval_transform, train_transform


def test_eval_transform_normalises_training_pixels() -> None:
    digits_train = digits("train")
    t = eval_transform(digits_train)
    x = torch.stack([t(img) for img in digits_train.images])
    assert x.dtype == torch.float32 and x.shape == digits_train.images.shape
    assert abs(float(x.mean())) < 1e-3 and abs(float(x.std()) - 1) < 1e-3
    assert torch.equal(t(digits_train.images[5]), t(digits_train.images[5]))  # deterministic
    assert not t.random


def test_train_transform_crop_pad_keeps_size_and_is_a_shifted_window() -> None:
    t = ImageTransform((0.0, 0.0, 0.0), (1.0, 1.0, 1.0), crop_padding=4)
    img = torch.randint(1, 256, (3, 12, 12), dtype=torch.uint8)  # no zeros: padding is visible
    padded = torch.nn.functional.pad(img, (4, 4, 4, 4))
    g = torch.Generator().manual_seed(0)
    offsets = set()
    for _ in range(40):
        out = (t(img, g) * 255).round().to(torch.uint8)
        assert out.shape == img.shape
        hits = [
            (i, j) for i in range(9) for j in range(9) if torch.equal(padded[:, i : i + 12, j : j + 12], out)
        ]
        assert len(hits) == 1
        offsets.add(hits[0])
    assert len(offsets) > 10  # offsets actually vary


def test_flip_policy_and_flip_draws() -> None:
    t = ImageTransform((0.0, 0.0, 0.0), (1.0, 1.0, 1.0), flip=True)
    img = torch.arange(3 * 4 * 4, dtype=torch.uint8).view(3, 4, 4)
    g = torch.Generator().manual_seed(0)
    outs = [(t(img, g) * 255).round().to(torch.uint8) for _ in range(30)]
    assert {torch.equal(o, img) for o in outs} == {True, False}
    assert all(torch.equal(o, img) or torch.equal(o, img.flip(-1)) for o in outs)

    digits = load_dataset(dcfg(train_limit=20), "train")
    assert train_transform(digits).flip is False  # a mirrored digit is not that digit
    assert train_transform(digits).crop_padding == 4
    cifar_like = dataclasses.replace(digits, name="cifar10")
    assert train_transform(cifar_like).flip is True
