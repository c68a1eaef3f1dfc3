"""diffusion.pooling (the mean, or a g x g grid of region means) and the mid-block
(``diffusion.blocks`` index -1) in the family layer: hand-computed grids, which families have a
mid-block. The features against the denoiser's own outputs: tests/test_featurizer.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import PLUMBING, ROOT, make_config

from feddifrc_app.diffusion.family import (
    MID_BLOCK,
    FamilyError,
    family_module,
    layer_module,
    map_sides,
    pool_map,
    pool_tokens,
)
from feddifrc_app.diffusion.featurizer import check_layers
from feddifrc_app.methods.feddifrc.teacher import teacher_spec

# --------------------------------------------------------------------------- grids by hand


def test_grid_pooling_of_a_known_map() -> None:
    # channel 0 = 0..15 row by row, channel 1 = 10 x channel 0
    ch0 = torch.arange(16.0).reshape(4, 4)
    h = torch.stack([ch0, 10 * ch0])[None]  # (1, 2, 4, 4)
    # quadrants of channel 0: {0,1,4,5} -> 2.5, {2,3,6,7} -> 4.5, {8,9,12,13} -> 10.5, {10,11,14,15} -> 12.5
    assert pool_map(h, 2).tolist() == [[2.5, 4.5, 10.5, 12.5, 25.0, 45.0, 105.0, 125.0]]
    assert pool_map(h, 0).tolist() == [[7.5, 75.0]]  # the mean (today's pooling)
    assert pool_map(h, 1).tolist() == [[7.5, 75.0]]
    assert pool_map(h, 4).tolist() == [ch0.flatten().tolist() + (10 * ch0).flatten().tolist()]
    # a 3x3 map into 2x2 regions: rows/cols [0, 2) and [1, 3) overlap on the middle one
    m = torch.arange(9.0).reshape(1, 1, 3, 3)
    assert pool_map(m, 2).tolist() == [[2.0, 3.0, 5.0, 6.0]]  # {0,1,3,4}, {1,2,4,5}, {3,4,6,7}, {4,5,7,8}
    assert pool_map(h.half(), 2).dtype == torch.float32


def test_a_grid_larger_than_the_map_is_refused() -> None:
    with pytest.raises(ValueError, match=r"diffusion.pool-grid = 3 exceeds a hooked layer's 2x2 map"):
        pool_map(torch.zeros(1, 4, 2, 2), 3)


def test_dit_tokens_are_pooled_on_their_patch_grid() -> None:
    # tokens row-major over a 2x4 patch grid: token i*4 + j is cell (i, j); D = 1, value = token index
    tokens = torch.arange(8.0).reshape(1, 8, 1)
    grid = tokens.reshape(1, 2, 4, 1).permute(0, 3, 1, 2)
    assert torch.equal(pool_tokens(tokens, (2, 4), 2), pool_map(grid, 2))
    # 2 x 2 regions over 2 rows: each region is one row and two columns
    assert pool_tokens(tokens, (2, 4), 2).tolist() == [[0.5, 2.5, 4.5, 6.5]]
    assert pool_tokens(tokens, (2, 4)).tolist() == [[3.5]]


# --------------------------------------------------------------------------- families without a mid-block


@pytest.mark.parametrize("family", ["pixart", "sd3"])
def test_a_dit_has_no_mid_block(family: str, teacher_cache: Path) -> None:
    with pytest.raises(FamilyError, match=r"it has no mid-block \(-1\)"):
        check_layers((MID_BLOCK, 1), 8, family, family_module(family), mid=False)
    cfg = make_config(
        **{"diffusion.model": f"tiny-{family}", "diffusion.blocks": "-1,1,2", "diffusion.device": "cpu"}
    )
    with pytest.raises(FamilyError, match=r"it has no mid-block \(-1\)"):
        teacher_spec(cfg, teacher_cache)


def test_unet_families_accept_the_mid_block(teacher_cache: Path) -> None:
    for model, blocks in (("tiny", "-1,1,2"), ("tiny-sdxl", "-1,0,1")):
        cfg = make_config(**{"diffusion.model": model, "diffusion.blocks": blocks, "diffusion.device": "cpu"})
        assert teacher_spec(cfg, teacher_cache).blocks[0] == MID_BLOCK
    assert check_layers((MID_BLOCK, 3), 4, "sd", family_module("sd"), mid=True) == (-1, 3)
    mid_range = r"unet.up_blocks indices in 0..3 for this sd teacher \(it has 4; -1 is its mid-block\)"
    with pytest.raises(FamilyError, match=mid_range):
        check_layers((MID_BLOCK, 4), 4, "sd", family_module("sd"), mid=True)


# --------------------------------------------------------------------------- map sizes, before any work


def test_the_map_sides_read_from_the_folder_are_the_maps_a_forward_pass_hooks(teacher_cache: Path) -> None:
    """``family.map_sides`` (config files only) against the shapes the hooked layers give."""
    from feddifrc_app.diffusion.featurizer import Featurizer
    from feddifrc_app.diffusion.pipeline import load_teacher, teacher_identity

    for model, res, want in (
        ("tiny", 16, {0: 2, 1: 4, 2: 8, 3: 8, MID_BLOCK: 1}),  # latent 8: 8, 4, 2, 1 going down
        ("tiny-sdxl", 20, {0: 5, 1: 10, 2: 10, MID_BLOCK: 3}),  # latent 10: an odd map rounds up
    ):
        ident = teacher_identity(model, teacher_cache)
        assert map_sides(ident.folder, ident.family, res) == want
        t = load_teacher(model, teacher_cache, torch.device("cpu"), torch.float32)
        got: dict[int, int] = {}

        def side(b: int, got: dict[int, int] = got):
            def hook(_m, _i, out) -> None:
                got[b] = (out[0] if isinstance(out, tuple) else out).shape[-1]

            return hook

        hooks = [layer_module(t.unet, t.adapter, b).register_forward_hook(side(b)) for b in want]
        f = Featurizer(t, resolution=res, timestep=100, blocks=tuple(want), ensemble=1, seed=0)
        f(torch.zeros(1, 3, res, res, dtype=torch.uint8), torch.zeros(1, dtype=torch.int64), ("a",))
        for h in hooks:
            h.remove()
        assert got == want, model


def test_a_grid_no_map_holds_and_adaln_on_a_unet_fail_in_one_line_before_any_work(
    tmp_path: Path, teacher_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 45 case 7: diffusion.pool-grid larger than a hooked map, grid pooling of the 1x1
    mid-block and diffusion.dit-features = 'adaln' on a UNet passed `extract --check` (and `fetch`),
    then extraction (a run's node setup) raised a traceback from inside the featurizer."""
    from feddifrc_app.tools import cli
    from feddifrc_app.tools.run_config import load_app_config

    grid = lambda g: {"diffusion.pooling": "grid", "diffusion.pool-grid": g}  # noqa: E731
    cases = [  # the plumbing's tiny UNet at 16 px: up_blocks 2x2, 4x4, 8x8, 8x8, its mid-block 1x1
        (
            grid(16),
            "diffusion.pool-grid = 16 exceeds the feature map of diffusion.blocks (1, 2, 3) of this sd "
            "teacher at diffusion.resolution = 16 (unet.up_blocks[1] 4x4, unet.up_blocks[2] 8x8, "
            "unet.up_blocks[3] 8x8); choose a diffusion.pool-grid <= 4, other diffusion.blocks, or "
            "diffusion.pooling = 'mean'",
        ),
        (
            grid(2) | {"diffusion.blocks": "-1,1,2"},
            "diffusion.pool-grid = 2 exceeds the feature map of diffusion.blocks (-1,) of this sd teacher at "
            "diffusion.resolution = 16 (the mid-block 1x1); choose a diffusion.pool-grid <= 1",
        ),
        ({"diffusion.dit-features": "adaln"}, "diffusion.dit-features = 'adaln' reads AdaLN-modulated"),
        ({"diffusion.resolution": 15}, "diffusion.resolution = 15 must be a positive multiple of this sd"),
    ]
    app = ["--app", str(ROOT), "--cache-dir", str(teacher_cache)]
    for over, said in cases:
        keys = " ".join(f"{k}={v!r}" for k, v in (PLUMBING | over).items())
        with pytest.raises(FamilyError) as e:  # where a run's node meets it first, before any work
            teacher_spec(load_app_config(str(ROOT), [keys]), teacher_cache)
        for command in (["extract", "--check"], ["fetch", "--split", "test"]):
            assert cli.main([*command, *app, "--run-config", keys]) == 2, (command, keys)
            err = capsys.readouterr().err
            assert err == f"feddifrc {command[0]}: error: {e.value}\n" and said in err, err
