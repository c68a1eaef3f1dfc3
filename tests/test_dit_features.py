"""diffusion.dit-features (diffusion/dit_features.py): DiT block outputs LayerNorm'd and modulated
as the network itself reads them next, with massive-activation channels found per row and zeroed
or rescaled; checked against the tiny PixArt and SD3 DiTs' own modules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import make_config

from feddifrc_app.data.registry import load_dataset
from feddifrc_app.diffusion.dit_features import (
    MASSIVE_RATIO,
    Reader,
    adaln,
    check_mode,
    massive_channels,
    tame,
)
from feddifrc_app.diffusion.family import family_module, pool_tokens
from feddifrc_app.diffusion.featurizer import Featurizer
from feddifrc_app.diffusion.pipeline import load_teacher
from feddifrc_app.methods.feddifrc.teacher import feature_set, teacher_spec

CPU = torch.device("cpu")
PROMPTS = ("a photo of a zero", "")
FAMILIES = ("pixart", "sd3")


@pytest.fixture(scope="module", params=FAMILIES)
def teacher(request, teacher_cache: Path):
    return load_teacher(f"tiny-{request.param}", teacher_cache, CPU, torch.float32)


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 256, (2, 3, 16, 16), generator=g, dtype=torch.uint8)


def _featurizer(teacher, blocks, mode: str, grid: int = 0) -> Featurizer:
    return Featurizer(
        teacher,
        resolution=16,
        timestep=200,
        blocks=blocks,
        ensemble=1,
        seed=0,
        dit_features=mode,
        pool_grid=grid,
    )


def _reads(teacher):
    """The tensor each layer b's output is next normalised into, taken from the network's own
    modules: ``{b: module}`` and how to get that tensor from the module's (inputs, output)."""
    net, n = teacher.unet, len(teacher.unet.transformer_blocks)
    if teacher.family == "pixart":  # the next block's attn1 input, the output layer's proj_out input
        mods = {b: net.transformer_blocks[b + 1].attn1 for b in range(n - 1)} | {n - 1: net.proj_out}
        return mods, lambda inputs, kwargs, _out: inputs[0] if inputs else kwargs["hidden_states"]
    # sd3: the next block's norm1 (its first output: the modulated image stream), then norm_out
    mods = {b: net.transformer_blocks[b + 1].norm1 for b in range(n - 1)} | {n - 1: net.norm_out}
    return mods, lambda _inputs, _kwargs, out: out[0] if isinstance(out, tuple) else out


def test_adaln_is_what_the_network_feeds_the_next_module(teacher, images: torch.Tensor) -> None:
    """For every block, the Reader's tokens equal the modulated LayerNorm the network computes
    from that block's output in its next module (the next block's first AdaLN; the output layer's
    for the last block), over a full denoiser call on real noised latents."""
    f = _featurizer(teacher, (0,), "raw")
    n = len(teacher.unet.transformer_blocks)
    outs, refs = {}, {}
    mods, pick = _reads(teacher)
    handles = [
        teacher.unet.transformer_blocks[b].register_forward_hook(
            lambda _m, _i, o, b=b: outs.__setitem__(b, o)
        )
        for b in range(n)
    ]
    handles += [
        m.register_forward_hook(lambda _m, i, k, o, b=b: refs.__setitem__(b, pick(i, k, o)), with_kwargs=True)
        for b, m in mods.items()
    ]
    reader = Reader(teacher.unet, teacher.adapter, "adaln", teacher.family)
    cond = f.conditioning(PROMPTS).rows(2)
    lt = f.encode(images).repeat(2, 1, 1, 1)
    with torch.inference_mode(), reader.capturing():
        teacher.adapter.denoise(teacher, lt, f._step, cond)
        got = {b: reader(b, outs[b]) for b in range(n)}
    for h in handles:
        h.remove()
    assert sorted(refs) == list(range(n))
    for b in range(n):
        assert got[b].shape == refs[b].shape
        torch.testing.assert_close(got[b], refs[b].float(), atol=2e-5, rtol=1e-5)
        raw = teacher.adapter.image_tokens(outs[b]).float()
        assert (got[b] - raw).abs().max() > 0.1  # it is not the raw output


def test_the_featurizer_pools_the_normalised_tokens(teacher, images: torch.Tensor) -> None:
    """Featurizer(dit_features="adaln") of layer 0 = the pooled tokens that block 1 itself
    normalises (captured in the same call: block 1 runs, the hooks stop after it)."""
    mods, pick = _reads(teacher)
    ref = {}
    h = mods[0].register_forward_hook(lambda _m, i, k, o: ref.__setitem__(0, pick(i, k, o)), with_kwargs=True)
    f = _featurizer(teacher, (0, 1), "adaln")
    try:
        out = f(images, torch.arange(2), PROMPTS)
    finally:
        h.remove()
    want = pool_tokens(ref[0], f._grid).reshape(len(PROMPTS), 2, -1).transpose(0, 1)
    torch.testing.assert_close(out[0], want, atol=2e-5, rtol=1e-5)
    raw = _featurizer(teacher, (0,), "raw")(images, torch.arange(2), PROMPTS)
    assert (out[0] - raw[0]).abs().max() > 0.1


def _tokens(rows: int = 3, n: int = 16, d: int = 32) -> torch.Tensor:
    return torch.randn(rows, n, d, generator=torch.Generator().manual_seed(0))


def test_a_planted_massive_channel_is_found_and_ordinary_outliers_are_not() -> None:
    h = _tokens()
    h[:, :, 5] = h[:, :, 5].sign() * 400 * (1 + h[:, :, 5].abs())  # huge on every token
    h[:, :, 7] *= 10  # a heavy but ordinary channel
    h[:, :3, 9] = 1e5  # huge on 3 of 16 tokens only
    massive, med, typical = massive_channels(h)
    assert massive.sum().item() == 3 and massive[:, 5].all()
    # hand check of the rule on row 0: the median |h_5| over tokens against 100 x the median channel's
    row = h[0].abs()
    assert med[0, 5] == row[:, 5].median() and typical[0, 0] == row.median(0).values.median()
    assert med[0, 5] > MASSIVE_RATIO * typical[0, 0] > med[0, 7]
    # per row: a row's channels never depend on the other rows (features never depend on the batch)
    h[1, :, 5] = 0.01
    assert massive_channels(h)[0][:, 5].tolist() == [True, False, True]


def test_drop_zeroes_and_rescale_shrinks_only_the_massive_channels() -> None:
    h = _tokens()
    h[:, :, 5] = 1000 + h[:, :, 5]
    _, med, typical = massive_channels(h)
    dropped, rescaled = tame(h, "adaln-drop"), tame(h, "adaln-rescale")
    keep = [c for c in range(32) if c != 5]
    assert (dropped[:, :, 5] == 0).all() and torch.equal(dropped[:, :, keep], h[:, :, keep])
    assert torch.equal(rescaled[:, :, keep], h[:, :, keep])
    torch.testing.assert_close(rescaled[:, :, 5], h[:, :, 5] * (typical / med[:, 5:6]))
    torch.testing.assert_close(rescaled[:, :, 5].abs().median(dim=1).values, typical[:, 0])
    assert torch.equal(tame(h, "adaln"), h)


def test_adaln_by_hand() -> None:
    h = torch.tensor([[[1.0, 2.0, 3.0, 6.0]]])  # mean 3, variance 3.5
    shift, scale = torch.tensor([[0.0, 1.0, 0.0, 0.0]]), torch.tensor([[1.0, 0.0, 0.0, -1.0]])
    z = torch.tensor([-2.0, -1.0, 0.0, 3.0]) / 3.5**0.5
    want = z * torch.tensor([2.0, 1.0, 1.0, 0.0]) + torch.tensor([0.0, 1.0, 0.0, 0.0])
    torch.testing.assert_close(adaln(h, shift, scale, 0.0)[0, 0], want)


def test_a_planted_massive_channel_is_set_aside_in_a_real_block(teacher, images: torch.Tensor) -> None:
    """Block 0's output with channel 3 made massive: plain AdaLN reading is swamped by it, the
    drop mode reads exactly what it reads with channel 3 zeroed, the rescale mode stays close."""

    def plant(value):
        def hook(_m, _i, out):
            h = teacher.adapter.image_tokens(out).clone()
            h[..., 3] = value(h[..., 3])
            return (out[0], h) if isinstance(out, tuple) else h

        return teacher.unet.transformer_blocks[0].register_forward_hook(hook)

    def read(mode: str, value=None):
        handle = plant(value) if value else None
        try:
            return _featurizer(teacher, (0,), mode, grid=2)(images, torch.arange(2), PROMPTS)[0]
        finally:
            if handle:
                handle.remove()

    big = lambda c: 2000.0 + c  # noqa: E731
    clean = read("adaln")
    assert (read("adaln", big) - clean).abs().max() > 1.0
    torch.testing.assert_close(
        read("adaln-drop", big), read("adaln-drop", lambda c: 0 * c), atol=1e-5, rtol=0
    )
    # no massive channel in the tiny DiT: drop and rescale read what adaln reads
    torch.testing.assert_close(read("adaln-drop"), clean)
    torch.testing.assert_close(read("adaln-rescale"), clean)


def test_the_mode_is_a_key_field_only_off_raw_and_unets_refuse_it(teacher_cache: Path) -> None:
    base = {"diffusion.model": "tiny-pixart", "diffusion.blocks": "1,2,3", "diffusion.device": "cpu"}
    base["diffusion.noise-seed"] = -1  # the pinned keys' noise: the run seed's (test_feature_keys)
    data, keys = None, {}
    for mode in ("raw", "adaln", "adaln-drop", "adaln-rescale"):
        cfg = make_config(**base, **{"diffusion.dit-features": mode})
        data = data or load_dataset(cfg.dataset, "train", seed=cfg.seed)
        fs = feature_set(
            teacher_spec(cfg, teacher_cache), data, ("a photo of a zero", "a photo of a one", "")
        )
        keys[mode] = fs
    # raw: the pinned key of tests/test_feature_keys.py, no new field
    assert keys["raw"].key == "837fd5d9693c06ebe2dfd2f6b18e99c20dacac64735ea9a1d3a148899ad7049a"
    assert "dit_features" not in keys["raw"].fields
    for mode in ("adaln", "adaln-drop", "adaln-rescale"):
        assert keys[mode].fields == {**keys["raw"].fields, "dit_features": mode}
    assert len({fs.key for fs in keys.values()}) == 4
    with pytest.raises(ValueError, match=r"dit-features = 'adaln' .* this sd teacher has none"):
        teacher_spec(
            make_config(**{"diffusion.device": "cpu", "diffusion.dit-features": "adaln"}), teacher_cache
        )
    with pytest.raises(ValueError, match="dit-features"):
        make_config(**{"diffusion.dit-features": "normalised"})
    assert check_mode("raw", "sd", family_module("sd")) == "raw"
