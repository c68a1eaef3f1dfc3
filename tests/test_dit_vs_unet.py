"""benchmarks/dit_vs_unet.py: the pure parts (PCA widths per layer, the seed summary)."""

from __future__ import annotations

import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import dit_vs_unet as dvu  # noqa: E402


def test_channels_for_gives_the_widest_layer_the_largest_width():
    assert dvu.channels_for([64, 128, 32], (64, 32, 32)) == (32, 64, 32)
    assert dvu.channels_for([128, 128, 128], (64, 32, 32)) == (64, 32, 32)
    assert dvu.channels_for([32, 64, 64], (64, 32, 32)) == (32, 64, 32)


def test_channels_for_refuses_layers_too_narrow():
    with pytest.raises(ValueError, match="cannot hold"):
        dvu.channels_for([32, 32, 32], (64, 32, 32))
    with pytest.raises(ValueError):  # one width per layer
        dvu.channels_for([64, 64], (64, 32, 32))


def test_summary_is_mean_and_sample_sd_over_seeds():
    rows = [{k: v for k, _ in dvu.METRICS} for v in (0.2, 0.4, 0.9)]
    s = dvu.summary(rows)
    assert s["probe"][0] == pytest.approx(0.5)
    assert s["probe"][1] == pytest.approx(((0.09 + 0.01 + 0.16) / 2) ** 0.5)
    assert dvu.summary(rows[:1])["ndcr-ncc"] == (0.2, 0.0)


def test_the_defaults_arm_reads_the_configured_unet_blocks_and_the_dit_rule(tmp_path):
    from argparse import Namespace

    from conftest import make_config

    over = {"diffusion.blocks": "0,2", "diffusion.channels": "256,256", "diffusion.timestep": 50}
    cfg = make_config(**{"diffusion.device": "cpu", **over})
    args = Namespace(unet=["tiny"], dit=["tiny-pixart"])
    want = {"blocks": [0, 2], "timestep": 50, "channels": [256, 256]}
    assert dvu.default_setting(cfg, args, tmp_path, "sd") == want
    # the tiny PixArt has 4 transformer blocks: round(4 k / 4) - 1 for k = 2, 3, 4
    assert dvu.default_setting(cfg, args, tmp_path, "pixart")["blocks"] == [1, 2, 3]
