"""data.holdouts: the stratified subset by hand and the validation carve of the paper confs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, make_config

from feddifrc_app.data.holdouts import carve_validation, stratified_subset


def test_stratified_subset_largest_remainder_by_hand() -> None:
    labels = np.array([0] * 6 + [1] * 3 + [2] * 1)
    # quotas 3.0 / 1.5 / 0.5 -> floors 3/1/0, one left: tie 0.5 vs 0.5 goes to the lower class (1)
    idx = stratified_subset(labels, 5, seed=0)
    assert np.bincount(labels[idx], minlength=3).tolist() == [3, 2, 0]
    assert np.all(np.diff(idx) > 0)
    assert np.array_equal(idx, stratified_subset(labels, 5, seed=0))
    with pytest.raises(ValueError, match="n=11"):
        stratified_subset(labels, 11, seed=0)


@pytest.mark.parametrize("path", sorted((ROOT / "conf").glob("cifar10-*.toml")), ids=lambda p: p.name)
def test_paper_confs_train_on_all_50000_cifar10_images(path: Path) -> None:
    """Each paper conf's DatasetConfig, loaded with the pyproject defaults, carves its split from
    CIFAR-10's 50,000 training labels (5,000 a class; synthetic: no download) without a hold-out."""
    from conftest import default_run_config

    from feddifrc_app.config_loader import load_config
    from feddifrc_app.tools.run_config import parse_run_config

    raw = default_run_config(plumbing=False) | parse_run_config([str(path)])
    cfg = load_config(raw).dataset
    assert cfg.name == "cifar10"
    labels = np.repeat(np.arange(10, dtype=np.int64), 5000)
    assert len(carve_validation(labels, "train", cfg.val_fraction)) == 50_000
    assert len(carve_validation(labels, "val", cfg.val_fraction)) == 0
    # the default (0.1) would have left 45,000, as before dataset.val-fraction existed
    assert len(carve_validation(labels, "train", make_config().dataset.val_fraction)) == 45_000
