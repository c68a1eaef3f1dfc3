"""Text encoders freed, not parked (issue 46 item 2): once a featurizer's prompts are encoded the
teacher's text encoders and tokenizers are released, and the features are bit-identical to the
path that keeps them."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch

from feddifrc_app.diffusion.featurizer import Featurizer
from feddifrc_app.diffusion.pipeline import load_teacher, release_teacher, teacher_identity
from feddifrc_app.diffusion.text_encoders import released

CPU = torch.device("cpu")
PROMPTS = ("a photo of a zero", "a photo of a one", "")
MODELS = {"sd": ("tiny", (1, 2, 3)), "pixart": ("tiny-pixart", (1, 2, 3)), "sd3": ("tiny-sd3", (1, 2, 3))}
TEXT_PARTS = {"sd": 1, "pixart": 1, "sd3": 3}  # text encoders each family's prompt encoding runs


def _make(teacher, blocks) -> Featurizer:
    return Featurizer(teacher, resolution=16, timestep=300, blocks=blocks, ensemble=1, seed=0)


def _pipe_parts(teacher) -> list:
    """The kept pipeline's text encoders and tokenizers (what would park them in host RAM)."""
    pipe = teacher.parts.get("pipe")
    parts = teacher.adapter.TEXT_PARTS
    names = (*parts, *(p.replace("text_encoder", "tokenizer") for p in parts))
    return [] if pipe is None else [getattr(pipe, n) for n in names]


@pytest.mark.parametrize("family", sorted(MODELS))
def test_text_encoders_are_released_and_features_are_bit_identical(family: str, teacher_cache: Path) -> None:
    model, blocks = MODELS[family]
    kept = _make(load_teacher(model, teacher_cache, CPU, torch.float32), blocks)  # the old path
    folder = str(teacher_identity(model, teacher_cache).folder)  # by path: a Teacher of its own
    t = load_teacher(folder, teacher_cache, CPU, torch.float32)
    try:
        assert len(t.text_encoders) == TEXT_PARTS[family] and not released(t)
        refs = [weakref.ref(m) for m in (*t.text_encoders, t.tokenizer)]
        new = _make(t, blocks)
        new.encode_then_release(PROMPTS)
        gc.collect()
        assert [r() for r in refs] == [None] * len(refs)  # nothing holds them any more
        assert t.text_encoders == () and t.text_encoder is None and t.tokenizer is None
        assert all(p is None for p in _pipe_parts(t))
        gen = torch.Generator().manual_seed(5)
        images = torch.randint(0, 256, (3, 3, 12, 12), generator=gen, dtype=torch.uint8)
        ids = torch.tensor([4, 5, 6])
        a, b = kept(images, ids, PROMPTS), new(images, ids, PROMPTS)
        assert sorted(a) == sorted(b) == list(blocks)
        for k in blocks:
            assert torch.equal(a[k], b[k]), k  # bit-identical
        assert released(t)  # the memoised encodings served: nothing was loaded again
        # a new prompt list loads them again from the folder: the same encodings as never released
        other = ("a photo of a two", "")
        got, want = new.conditioning(other), kept.conditioning(other)
        assert torch.equal(got.tokens, want.tokens) and sorted(got.extras) == sorted(want.extras)
        assert all(torch.equal(got.extras[n], want.extras[n]) for n in want.extras)
        assert len(t.text_encoders) == TEXT_PARTS[family] and not released(t)
        assert {p.device for m in t.text_encoders for p in m.parameters()} == {CPU}
    finally:
        release_teacher(folder, teacher_cache, CPU, torch.float32)
