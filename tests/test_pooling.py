"""diffusion.pooling (the mean, or a g x g grid of region means) and the mid-block
(``diffusion.blocks`` index -1) in the family layer: hand-computed grids, which families have a
mid-block. The features against the denoiser's own outputs: tests/test_featurizer.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import make_config

from feddifrc_app.diffusion.family import MID_BLOCK, FamilyError, check_layers, pool_map, pool_tokens
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
        check_layers((MID_BLOCK, 1), 8, family, mid=False)
    cfg = make_config(
        **{"diffusion.model": f"tiny-{family}", "diffusion.blocks": "-1,1,2", "diffusion.device": "cpu"}
    )
    with pytest.raises(FamilyError, match=r"it has no mid-block \(-1\)"):
        teacher_spec(cfg, teacher_cache)


def test_unet_families_accept_the_mid_block(teacher_cache: Path) -> None:
    for model, blocks in (("tiny", "-1,1,2"), ("tiny-sdxl", "-1,0,1")):
        cfg = make_config(**{"diffusion.model": model, "diffusion.blocks": blocks, "diffusion.device": "cpu"})
        assert teacher_spec(cfg, teacher_cache).blocks[0] == MID_BLOCK
    assert check_layers((MID_BLOCK, 3), 4, "sd", mid=True) == (-1, 3)
    mid_range = r"unet.up_blocks indices in 0..3 for this sd teacher \(it has 4; -1 is its mid-block\)"
    with pytest.raises(FamilyError, match=mid_range):
        check_layers((MID_BLOCK, 4), 4, "sd", mid=True)
