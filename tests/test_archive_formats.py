"""The on-disk files of the two verified-archive users, pinned byte for byte where it matters: the
feature shards (``diffusion``'s cache) and the prepared targets (``methods/feddifrc/targets.py``).
The header's JSON text and the member names and order were written on commit 113fb0d, so files
written before any refactor of the archive code are still what the code writes and loads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from feddifrc_app.diffusion.shards import FeatureStore
from feddifrc_app.methods.feddifrc import targets as tg
from feddifrc_app.methods.feddifrc.projection import Basis
from feddifrc_app.methods.feddifrc.targets import TeacherTargets, target_rows

SHARD_1 = (
    '{"format": "feddifrc-features", "version": 1, "key": "' + "ab" * 32 + '", "shard": 1, "shard_size": 8, '
    '"blocks": [1, 3], "shapes": {"1": [2, 2, 4], "3": [2, 2, 2]}, "dtype": "float16", "n": 2, '
    '"sha256": "5cb20300f48615b0fd4c57596bb51ec2a697ee458bded17f900627c98abf7e64"}'
)
TARGETS = (
    '{"format": "feddifrc-targets", "version": 1, "key": "' + "cd" * 32 + '", "n": 3, "members": '
    '{"basis.1.components": ["<f4", [4, 2]], "basis.1.mean": ["<f4", [4]], '
    '"basis.3.components": ["<f4", [2, 1]], "basis.3.mean": ["<f4", [2]], "basis.blocks": ["<i8", [2]], '
    '"basis.mode": ["|u1", [13]], "ids": ["<i8", [3]], "ndcr": ["<f4", [3, 3]], '
    '"prompt_reps": ["<f4", [3, 2, 3]]}, '
    '"sha256": "17dcbb97b7ebf989a4a842245961e58fde29ecd84857057af5a30f5838d6d757"}'
)


def _raw(path: Path) -> tuple[list[str], str]:
    with np.load(path, allow_pickle=False) as z:
        return list(z.files), bytes(z["header"]).decode("utf-8")


def test_a_feature_shard_is_written_as_before_and_loads(tmp_path: Path) -> None:
    fs = FeatureStore(tmp_path, shard_size=8)
    feats = {
        1: np.arange(24, dtype=np.float32).reshape(3, 2, 4) / 8,
        3: -np.arange(12, dtype=np.float32).reshape(3, 2, 2),
    }
    fs.save("ab" * 32, np.array([9, 3, 12]), feats)
    names, header = _raw(fs.shard_path("ab" * 32, 1))
    assert names == ["header", "ids", "block_1", "block_3"]
    assert header == SHARD_1
    got, missing = FeatureStore(tmp_path, shard_size=8).load("ab" * 32, [12, 9, 3])
    assert missing.size == 0 and got is not None
    np.testing.assert_array_equal(got[1], feats[1][[2, 0, 1]].astype(np.float16))


def test_prepared_targets_are_written_as_before_and_load(tmp_path: Path) -> None:
    ids = np.array([4, 1, 7])
    means = (np.float32([0.5, 1, 0, 2]), np.float32([1, -1]))
    basis = Basis(
        "federated-pca", (1, 3), means, (np.eye(4, 2, dtype=np.float32), np.eye(2, 1, dtype=np.float32))
    )
    reps = torch.arange(18, dtype=torch.float32).reshape(3, 2, 3) / 4
    targets = TeacherTargets(target_rows(ids), reps, torch.ones(3, 3))
    tg.save_prepared(tmp_path / "t.npz", "cd" * 32, ids, targets, basis)
    names, header = _raw(tmp_path / "t.npz")
    assert names == ["header", "ids", "basis.mode", "basis.blocks", "basis.1.mean", "basis.1.components"] + [
        "basis.3.mean",
        "basis.3.components",
        "prompt_reps",
        "ndcr",
    ]
    assert json.loads(header) == json.loads(TARGETS) and header == TARGETS
    loaded, again = tg.load_prepared(tmp_path / "t.npz", "cd" * 32, ids)
    assert torch.equal(loaded.prompt_reps, reps) and torch.equal(loaded.rows, target_rows(ids))
    assert again.fingerprint() == basis.fingerprint()
