"""Pooled per-block UNet features from the frozen tiny teacher (offline, CPU, real diffusers)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from feddifrc_app.diffusion.family import MID_BLOCK
from feddifrc_app.diffusion.featurizer import Featurizer, noise_seed, to_unit_range
from feddifrc_app.diffusion.pipeline import Teacher, load_teacher, placement

CPU = torch.device("cpu")
PROMPTS = ("a photo of a zero", "a photo of a one", "")
ATOL, RTOL = 2e-4, 1e-3  # float32 reduction order differs between batch sizes/thread counts


@pytest.fixture(scope="module")
def teacher(tmp_path_factory: pytest.TempPathFactory) -> Teacher:
    d = tmp_path_factory.getbasetemp() / "feddifrc-tiny-cache"  # shared with test_diffusion_pipeline.py
    d.mkdir(exist_ok=True)
    return load_teacher("tiny", d, CPU, torch.float32)


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    g = torch.Generator().manual_seed(123)
    return torch.randint(0, 256, (4, 3, 12, 12), generator=g, dtype=torch.uint8)


def make(teacher: Teacher, **kw) -> Featurizer:
    args = dict(resolution=16, timestep=300, blocks=(1, 2, 3), ensemble=1, seed=0)
    args.update(kw)
    return Featurizer(teacher, **args)


def state_hash(teacher: Teacher) -> str:
    h = hashlib.sha256()
    for mod in (teacher.unet, teacher.vae, teacher.text_encoder):
        for k, v in mod.state_dict().items():
            h.update(k.encode())
            h.update(v.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


# --------------------------------------------------------------------------- pixels


def test_to_unit_range_is_exact_on_known_pixels() -> None:
    img = torch.tensor([0, 255, 51, 204], dtype=torch.uint8).reshape(1, 1, 2, 2).expand(1, 3, 2, 2)
    out = to_unit_range(img.contiguous(), 2)
    assert out.dtype == torch.float32 and out.shape == (1, 3, 2, 2)
    assert out[0, 0, 0, 0].item() == -1.0 and out[0, 0, 0, 1].item() == 1.0  # exact ends
    expected = torch.tensor([0.0, 255.0, 51.0, 204.0]) / 127.5 - 1.0  # (-1, 1, -0.6, 0.6) in float32
    assert torch.equal(out[0, 0].flatten(), expected) and torch.equal(out[0, 0], out[0, 2])
    assert expected[2].item() == pytest.approx(-0.6) and expected[3].item() == pytest.approx(0.6)
    # resize keeps [-1, 1]; constant images stay constant
    white = torch.full((2, 3, 8, 8), 255, dtype=torch.uint8)
    big = to_unit_range(white, 16)
    assert big.shape == (2, 3, 16, 16) and torch.allclose(big, torch.ones_like(big))
    rnd = to_unit_range(torch.randint(0, 256, (2, 3, 9, 13), dtype=torch.uint8), 16)
    assert rnd.min() >= -1 and rnd.max() <= 1
    # grey images become 3 channels; float input (already scaled) is refused
    assert to_unit_range(torch.zeros(1, 1, 4, 4, dtype=torch.uint8), 4).shape == (1, 3, 4, 4)
    with pytest.raises(TypeError):
        to_unit_range(torch.zeros(1, 3, 4, 4), 4)


# --------------------------------------------------------------------------- features


def test_block_shapes_and_channels(teacher: Teacher, images: torch.Tensor) -> None:
    f = make(teacher)
    out = f(images, torch.arange(4), PROMPTS)
    assert set(out) == {1, 2, 3}
    for b, c in zip((1, 2, 3), (256, 128, 128), strict=True):
        assert out[b].shape == (4, 3, c) and out[b].dtype == torch.float32
        assert out[b].device == CPU and torch.isfinite(out[b]).all()
        assert not out[b].is_inference() and not out[b].requires_grad
    # ordinary tensors: usable as targets in a loss that back-propagates into a model
    z = torch.randn(4, 128, requires_grad=True)
    torch.nn.functional.cosine_similarity(z[:, None, :], out[3], dim=-1).sum().backward()
    assert z.grad is not None
    # prompts actually condition the features
    assert not torch.allclose(out[3][:, 0], out[3][:, 1])


def test_deterministic_and_seed_dependent(teacher: Teacher, images: torch.Tensor) -> None:
    ids = torch.tensor([5, 6, 7, 8])
    a = make(teacher)(images, ids, PROMPTS)
    b = make(teacher)(images, ids, PROMPTS)
    c = make(teacher, seed=1)(images, ids, PROMPTS)
    for k in a:
        assert torch.equal(a[k], b[k])
        assert not torch.allclose(a[k], c[k], atol=1e-4)
    assert noise_seed(0, 5, 0) == noise_seed(0, 5, 0) != noise_seed(0, 5, 1)


def test_batched_equals_one_call_per_image_prompt_pair(teacher: Teacher, images: torch.Tensor) -> None:
    f = make(teacher)
    ids = torch.tensor([10, 11, 12])
    batched = f(images[:3], ids, PROMPTS)
    for i in range(3):
        for p, prompt in enumerate(PROMPTS):
            single = f(images[i : i + 1], ids[i : i + 1], (prompt,))
            for b in f.blocks:
                torch.testing.assert_close(batched[b][i, p], single[b][0, 0], atol=ATOL, rtol=RTOL)


def test_features_do_not_depend_on_batch_composition(teacher: Teacher, images: torch.Tensor) -> None:
    f = make(teacher)
    first = f(images[[0, 1, 2]], torch.tensor([40, 41, 42]), PROMPTS)
    second = f(images[[3, 2]], torch.tensor([43, 42]), PROMPTS)
    for b in f.blocks:
        torch.testing.assert_close(first[b][2], second[b][1], atol=ATOL, rtol=RTOL)
    # same pixels under another id -> another noise draw -> another feature
    other = f(images[[2]], torch.tensor([99]), PROMPTS)
    assert not torch.allclose(first[3][2], other[3][0], atol=1e-4)


def test_teacher_weights_are_untouched(teacher: Teacher, images: torch.Tensor) -> None:
    before = state_hash(teacher)
    make(teacher, ensemble=2)(images, torch.arange(4), PROMPTS, torch.randn(4, teacher.text_width))
    assert state_hash(teacher) == before
    assert all(not p.requires_grad for p in teacher.unet.parameters())
    # no hooks, forward overrides or attention processors left behind on the shared teacher
    assert all(not blk._forward_hooks for blk in teacher.unet.up_blocks)
    assert not [n for n, m in teacher.unet.named_modules() if "forward" in m.__dict__]
    procs = {type(p).__name__ for p in teacher.unet.attn_processors.values()}
    assert procs == {"AttnProcessor2_0"}


# --------------------------------------------------------------------------- exact shortcuts


def test_shortcuts_match_the_stock_modules(teacher: Teacher, images: torch.Tensor) -> None:
    """Shared-prompt cross-attention, the prompt-independent prefix and oneDNN linear/GEGLU only
    change float rounding: same features as the stock UNet modules on P x B rows."""
    ids = torch.tensor([7, 8, 9, 10])
    fast, plain = make(teacher, ensemble=2), make(teacher, ensemble=2, fast=False)
    assert not any(plain.shortcuts.values())
    assert fast.shortcuts["shared-prompt-cross-attention"] and fast.shortcuts["shared-prefix"]
    a, r = fast(images, ids, PROMPTS), plain(images, ids, PROMPTS)
    off = torch.randn(4, teacher.text_width, generator=torch.Generator().manual_seed(5))
    a_off, r_off = fast(images, ids, PROMPTS, off), plain(images, ids, PROMPTS, off)
    for b in fast.blocks:
        torch.testing.assert_close(a[b], r[b], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(a_off[b], r_off[b], atol=ATOL, rtol=RTOL)
        assert a[b].is_contiguous()
    # one prompt: nothing to share, same answer
    one_f, one_p = fast(images[:2], ids[:2], PROMPTS[:1]), plain(images[:2], ids[:2], PROMPTS[:1])
    for b in fast.blocks:
        torch.testing.assert_close(one_f[b], one_p[b], atol=ATOL, rtol=RTOL)


def test_prompt_major_rows_match_the_image_major_reference(teacher: Teacher, images: torch.Tensor) -> None:
    """The stock path (fast=False) is the plain diffusers call on image-major rows, reordered."""
    f = make(teacher, fast=False)
    ids = torch.tensor([1, 2, 3])
    got = f(images[:3], ids, PROMPTS)
    with torch.inference_mode():
        l0 = f.encode(images[:3])
        eps = f.noise(ids, 0)
        lt = (f._sqrt_a * l0 + f._sqrt_1ma * eps).repeat_interleave(len(PROMPTS), dim=0)  # row b*P + p
        rows = f.prompt_embeddings(PROMPTS).repeat(3, 1, 1)
        feats = {}
        hooks = [
            teacher.unet.up_blocks[b].register_forward_hook(
                lambda _m, _i, o, b=b: feats.__setitem__(b, o.mean(dim=(2, 3)))
            )
            for b in f.blocks
        ]
        try:
            teacher.unet(lt, torch.tensor(300), encoder_hidden_states=rows)
        finally:
            for h in hooks:
                h.remove()
    for b in f.blocks:
        torch.testing.assert_close(got[b], feats[b].reshape(3, len(PROMPTS), -1), atol=ATOL, rtol=RTOL)


def test_onednn_linear_and_geglu_agree_with_torch() -> None:
    from feddifrc_app.diffusion.speed import _geglu, onednn_linear_available

    if not onednn_linear_available():
        pytest.skip("no oneDNN linear in this torch build: the featurizer uses the stock modules")
    g = torch.Generator().manual_seed(3)
    x, w, b = (
        torch.randn(2, 9, 48, generator=g),
        torch.randn(64, 48, generator=g),
        torch.randn(64, generator=g),
    )
    h, gate = torch.nn.functional.linear(x, w, b).chunk(2, dim=-1)
    with torch.inference_mode():
        torch.testing.assert_close(_geglu(x, w, b), h * torch.nn.functional.gelu(gate), atol=1e-4, rtol=1e-4)
        xt = x.transpose(0, 1)  # non-contiguous input
        h, gate = torch.nn.functional.linear(xt, w, None).chunk(2, dim=-1)
        torch.testing.assert_close(
            _geglu(xt, w, None), h * torch.nn.functional.gelu(gate), atol=1e-4, rtol=1e-4
        )


def test_ensemble_is_the_mean_of_seeded_draws(teacher: Teacher, images: torch.Tensor) -> None:
    ids = torch.tensor([3, 4])
    f1, f2 = make(teacher, ensemble=1), make(teacher, ensemble=2)
    one = f1(images[:2], ids, PROMPTS)
    two = f2(images[:2], ids, PROMPTS)
    assert all(not torch.allclose(one[b], two[b], atol=1e-4) for b in one)
    torch.testing.assert_close(two, f2(images[:2], ids, PROMPTS), atol=0, rtol=0)
    # by hand: draws 0 and 1, averaged
    with torch.inference_mode():
        l0 = f1.encode(images[:2])
        emb = f1.prompt_embeddings(PROMPTS)
        d0 = f1._draw(l0, ids, 0, emb, len(PROMPTS))
        d1 = f1._draw(l0, ids, 1, emb, len(PROMPTS))
    for b in f1.blocks:
        torch.testing.assert_close(one[b], d0[b], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(two[b], (d0[b] + d1[b]) / 2, atol=ATOL, rtol=RTOL)


def test_unet_stops_after_the_last_needed_block(teacher: Teacher, images: torch.Tensor) -> None:
    calls: dict[str, int] = {}

    def counter(name: str):
        def pre_hook(_module, _args):
            calls[name] = calls.get(name, 0) + 1

        return pre_hook

    mods = {f"up{i}": blk for i, blk in enumerate(teacher.unet.up_blocks)} | {
        "conv_out": teacher.unet.conv_out
    }
    handles = [m.register_forward_pre_hook(counter(n)) for n, m in mods.items()]
    try:
        make(teacher, blocks=(1,))(images[:2], torch.arange(2), PROMPTS)
        assert calls == {"up0": 1, "up1": 1}
        calls.clear()
        make(teacher, blocks=(3, 1))(images[:2], torch.arange(2), PROMPTS)
        assert calls == {"up0": 1, "up1": 1, "up2": 1, "up3": 1}  # conv_out never runs
    finally:
        for h in handles:
            h.remove()


def test_prompt_embeddings_are_computed_once(teacher: Teacher, images: torch.Tensor) -> None:
    runs = []
    h = teacher.text_encoder.register_forward_pre_hook(lambda *_: runs.append(1))
    try:
        f = make(teacher)
        e1 = f.prompt_embeddings(PROMPTS)
        f(images, torch.arange(4), PROMPTS)
        f(images[:1], torch.arange(1), PROMPTS)
        assert f.prompt_embeddings(PROMPTS) is e1 and len(runs) == 1
    finally:
        h.remove()
    assert e1.shape == (3, 77, teacher.text_width)


def test_a_new_prompt_list_encodes_after_the_encoders_went_home(
    teacher: Teacher, images: torch.Tensor
) -> None:
    """The text encoders wait where ``placement`` says (the CPU) once a prompt list is encoded; a
    new list brings them to the teacher's device again and encodes as a fresh featurizer does."""
    f = make(teacher)
    home = placement(teacher.device)["text_encoders"]
    ran_on = []
    h = teacher.text_encoder.register_forward_pre_hook(
        lambda m, _a: ran_on.append(next(m.parameters()).device)
    )
    try:
        f.prompt_embeddings(PROMPTS)
        assert {p.device for p in teacher.text_encoder.parameters()} == {home}
        other = ("a photo of a seven", "")
        got = f.prompt_embeddings(other)
    finally:
        h.remove()
    assert ran_on == [teacher.device, teacher.device] and got.device == teacher.device
    assert {p.device for p in teacher.text_encoder.parameters()} == {home}
    torch.testing.assert_close(got, make(teacher).prompt_embeddings(other), atol=0, rtol=0)
    assert not torch.equal(got[0], f.prompt_embeddings(PROMPTS)[0])  # the new prompt, not a stale memo


def test_token_offsets(teacher: Teacher, images: torch.Tensor) -> None:
    f = make(teacher)
    ids = torch.tensor([0, 1])
    base = f(images[:2], ids, PROMPTS)
    zero = f(images[:2], ids, PROMPTS, torch.zeros(2, teacher.text_width))
    off = torch.zeros(2, teacher.text_width)
    off[0] = torch.randn(teacher.text_width)
    moved = f(images[:2], ids, PROMPTS, off)
    for b in f.blocks:
        # zero offsets: same features (per-row prompt states take the stock cross-attention, the
        # shared ones the shared-prompt path: equal up to float rounding)
        torch.testing.assert_close(base[b], zero[b], atol=ATOL, rtol=RTOL)
        assert not torch.allclose(base[b][0], moved[b][0], atol=1e-4)  # image 0's rows change
        torch.testing.assert_close(base[b][1], moved[b][1], atol=ATOL, rtol=RTOL)  # image 1's do not
    with pytest.raises(ValueError, match="token_offsets"):
        f(images[:2], ids, PROMPTS, torch.zeros(2, teacher.text_width + 1))


def test_bad_arguments(teacher: Teacher, images: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="blocks"):
        make(teacher, blocks=(4,))
    with pytest.raises(ValueError, match="timestep"):
        make(teacher, timestep=1000)
    with pytest.raises(ValueError, match="resolution"):
        make(teacher, resolution=15)
    with pytest.raises(ValueError, match="ids"):
        make(teacher)(images, torch.arange(3), PROMPTS)


# --------------------------------------------------------------------------- pooling and the mid-block


def _captured(module: torch.nn.Module, run) -> torch.Tensor:
    """The output of ``module`` during ``run()`` (a forward hook registered before the featurizer's)."""
    seen: list[torch.Tensor] = []
    handle = module.register_forward_hook(
        lambda _m, _i, out: seen.append((out[0] if isinstance(out, tuple) else out).clone())
    )
    try:
        result = run()
    finally:
        handle.remove()
    assert len(seen) == 1
    return seen[0], result


@pytest.mark.parametrize("fast", [True, False])
def test_mid_block_features_are_the_unets_mid_block_output(
    teacher: Teacher, images: torch.Tensor, fast: bool
) -> None:
    f = make(teacher, blocks=(MID_BLOCK, 2), fast=fast)
    ids = torch.arange(4)
    h, out = _captured(teacher.unet.mid_block, lambda: f(images, ids, PROMPTS[1:]))
    B, P = 4, len(PROMPTS[1:])
    want = h.mean(dim=(2, 3)).reshape(P, B, -1).transpose(0, 1)  # rows prompt-major
    assert out[MID_BLOCK].shape == (B, P, teacher.unet.mid_block.resnets[-1].out_channels)
    torch.testing.assert_close(out[MID_BLOCK], want, rtol=0, atol=0)
    assert f.width(MID_BLOCK) == 64  # tiny: block_out_channels[-1]
    # the up_block beside it is unchanged by asking for the mid-block too
    torch.testing.assert_close(out[2], make(teacher, blocks=(2,), fast=fast)(images, ids, PROMPTS[1:])[2])


def test_the_mid_block_alone_stops_the_unet_before_the_up_blocks(
    teacher: Teacher, images: torch.Tensor
) -> None:
    ran: list[int] = []
    handle = teacher.unet.up_blocks[0].register_forward_hook(lambda *_: ran.append(0))
    try:
        out = make(teacher, blocks=(MID_BLOCK,))(images, torch.arange(4), PROMPTS[1:])
    finally:
        handle.remove()
    assert list(out) == [MID_BLOCK] and ran == []


@pytest.mark.parametrize("fast", [True, False])
def test_grid_features_are_the_grid_means_of_each_blocks_map(
    teacher: Teacher, images: torch.Tensor, fast: bool
) -> None:
    ids, B, P = torch.arange(4), 4, len(PROMPTS[1:])
    f = make(teacher, blocks=(1, 3), pool_grid=2, fast=fast)
    h, out = _captured(teacher.unet.up_blocks[3], lambda: f(images, ids, PROMPTS[1:]))
    assert h.shape[-2:] == (8, 8)
    # cell (i, j) of channel c = the mean of the 4x4 quadrant (i, j): by hand, not by adaptive pooling
    quads = h.reshape(P * B, -1, 2, 4, 2, 4).mean(dim=(3, 5))  # (rows, C, 2, 2)
    want = quads.reshape(P, B, -1).transpose(0, 1)
    torch.testing.assert_close(out[3], want, rtol=1e-6, atol=1e-6)
    assert (
        out[3].shape == (B, P, 4 * teacher.block_channels[3]) and f.width(1) == 4 * teacher.block_channels[1]
    )
    # the grid's mean is the mean-pooled feature
    mean = make(teacher, blocks=(1, 3), fast=fast)(images, ids, PROMPTS[1:])
    for b in (1, 3):
        grid = out[b].reshape(B, P, -1, 4).mean(-1)
        torch.testing.assert_close(grid, mean[b], rtol=1e-5, atol=1e-5)


def test_a_grid_the_mid_blocks_map_cannot_hold_is_refused(teacher: Teacher, images: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="pool-grid = 2 exceeds a hooked layer's 1x1 map"):
        make(teacher, blocks=(MID_BLOCK, 1), pool_grid=2)(images, torch.arange(4), PROMPTS[1:])
