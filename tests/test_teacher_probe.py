"""feddifrc probe-teacher (tools/teacher_probe.py, tools/cmd_probe.py): the measures by
hand, the recommendation rule, a real probe of the tiny UNet, and the test split refused."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import PLUMBING, ROOT, make_config

from feddifrc_app.data.registry import load_dataset
from feddifrc_app.methods.feddifrc.teacher import feature_set, pooled_features, teacher_prompts, teacher_spec
from feddifrc_app.tools import cli
from feddifrc_app.tools.teacher_probe import (
    Cell,
    ndcr_geometry,
    probe,
    prompt_effect,
    recommend,
    table,
    unit,
)


def test_prompt_effect_and_unit_by_hand() -> None:
    orth = np.array([[[2.0, 0.0], [0.0, 3.0]]])
    assert prompt_effect(orth) == pytest.approx(1.0)
    assert prompt_effect(np.array([[[1.0, 0.0], [5.0, 0.0]]])) == pytest.approx(0.0)
    assert prompt_effect(np.array([[[1.0, 0.0], [1.0, 1.0]]])) == pytest.approx(1 - 1 / math.sqrt(2))
    assert np.allclose(np.linalg.norm(unit(np.array([[3.0, 4.0], [0.0, 2.0]])), axis=-1), 1.0)


def test_ndcr_geometry_separates_separated_directions_and_not_noise() -> None:
    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(3), 20)
    x = np.eye(3)[y] * 5 + rng.normal(0, 0.3, (60, 3))
    assert ndcr_geometry(x, y, 4) == (1.0, 1.0)
    ncc, _ = ndcr_geometry(rng.normal(size=(60, 8)), y, 4)
    assert ncc < 0.7


def _cell(pooling: str, t: int, block: int, ncc: float) -> Cell:
    return Cell(pooling, t, block, 8, ncc, 0.0, 0.0, 0.0)


def test_recommend_takes_the_best_mean_of_the_top_layers() -> None:
    cells = [_cell("mean", 100, b, s) for b, s in zip((-1, 0, 1, 2), (0.5, 0.9, 0.8, 0.1), strict=True)]
    cells += [_cell("grid 2", 100, b, 0.84) for b in (0, 1, 2)]
    cells += [_cell("mean", 300, b, s) for b, s in zip((-1, 0, 1, 2), (0.95, 0.2, 0.7, 0.2), strict=True)]
    assert recommend(cells, 2) == ("mean", 100, (0, 1), pytest.approx(0.85))
    assert recommend(cells, 1) == ("mean", 300, (-1,), pytest.approx(0.95))
    assert recommend(cells, 3)[:3] == ("grid 2", 100, (0, 1, 2))  # 0.84 > (0.9 + 0.8 + 0.5) / 3
    assert "| mean | 300 | mid (-1) | 8 | 0.950 |" in table(cells, 10)


def test_a_probe_of_the_tiny_unet_scores_every_layer_as_its_own_extraction(teacher_cache: Path) -> None:
    cfg = make_config(**{"diffusion.device": "cpu", "dataset.train-limit": 30})
    data = load_dataset(cfg.dataset, "train", seed=cfg.seed)
    cells = probe(cfg, teacher_cache, data, (100,), ("mean", "grid"), 2)
    mean = [c for c in cells if c.pooling == "mean"]
    grid = [c for c in cells if c.pooling == f"grid {cfg.diffusion.pool_grid}"]
    assert [c.block for c in mean] == [-1, 0, 1, 2, 3]  # the mid-block, then every up_block
    assert {c.block for c in grid} < {c.block for c in mean}  # a map smaller than the grid is left out
    assert -1 not in {c.block for c in grid}
    assert all(0 <= c.ndcr_ncc <= 1 and 0 <= c.prompt_effect <= 2 and c.tdcl > 0 for c in cells)
    # block 2's NDCR score is what its own extraction (diffusion.blocks = "2") scores
    one = cfg.replace(diffusion=dataclasses.replace(cfg.diffusion, blocks=(2,)))
    fs = feature_set(teacher_spec(one, teacher_cache), data, teacher_prompts(cfg, data.class_names))
    pooled, _ = pooled_features(fs, np.arange(len(data)))
    ndcr = unit(pooled[2][:, -1].astype(np.float32))
    want = ndcr_geometry(ndcr - ndcr.mean(0), data.labels, 2)
    got = next(c for c in mean if c.block == 2)
    assert (got.ndcr_ncc, got.ndcr_linear) == pytest.approx(want)
    assert got.width == pooled[2].shape[-1]


def test_the_test_split_is_refused(teacher_cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["probe-teacher", "--split", "test"]) == 2
    assert "the test split is what a benchmark reports" in capsys.readouterr().err
    cfg = make_config(**{"diffusion.device": "cpu", "dataset.eval-limit": 20})
    with pytest.raises(ValueError, match="train/val split, not 'test'"):
        probe(cfg, teacher_cache, load_dataset(cfg.dataset, "test"), (100,), ("mean",), 2)


def test_probe_teacher_refuses_what_it_cannot_probe_in_one_line_before_any_work(
    tmp_path: Path, teacher_cache: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 45 case 4: a teacher that does not load (a missing folder, a hub id offline), --json
    naming a folder, an empty split and a class with fewer images than --folds were tracebacks
    (the last two after the teacher work, the --json one after the whole probe)."""
    from feddifrc_app.tools import teacher_probe

    monkeypatch.setattr(teacher_probe, "score_pass", lambda *a: pytest.fail("the probe started"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    argv = ["probe-teacher", "--app", str(ROOT), "--cache-dir", str(teacher_cache)]
    argv += ["--timesteps", "100", "--poolings", "mean", "--folds", "2"]
    cases = [  # (run config keys, flags, the line)
        ({"diffusion.model": "{tmp}/nope"}, [], "diffusion model folder '{tmp}/nope' does not exist"),
        ({"diffusion.model": "nobody/no-such-model"}, [], "diffusion model 'nobody/no-such-model' is not in"),
        ({}, ["--json", "{tmp}"], "--json {tmp}: {tmp} is a folder; give a file path"),
        (
            {"dataset.val-fraction": 0.0},
            ["--split", "val"],
            "the val split has 0 images of 0 class(es) (none); the probe needs two classes or more with "
            "--folds (2) images each: raise dataset.val-fraction and dataset.eval-limit",
        ),
        (
            {"dataset.train-limit": 15},
            ["--folds", "5"],
            "the train split has 15 images of 10 class(es) (1 in its smallest class); the probe needs two "
            "classes or more with --folds (5) images each: raise dataset.train-limit",
        ),
    ]
    for keys, flags, said in cases:
        tmp = lambda s: s.replace("{tmp}", str(tmp_path))  # noqa: E731
        keys = tmp(" ".join(f"{k}={v!r}" for k, v in (PLUMBING | keys).items()))
        assert cli.main([*argv, "--run-config", keys, *map(tmp, flags)]) == 2, said
        err = capsys.readouterr().err
        want = "feddifrc probe-teacher: error: " + tmp(said)
        assert err.startswith(want) and err.count("\n") == 1, err
