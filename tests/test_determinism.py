"""A run's numbers do not depend on where and by whom its parts were computed (docs/results.md,
"Reproducibility"): the teacher's features are the same bits whichever process filled the cache,
at whatever thread count and with whichever other images; a node's torch threads come from
``train.threads`` (or the OMP_NUM_THREADS its Ray actor was given), never the machine's cores.

The Flower-level bars reuse the suite's runs (no run here): test_simulation.py's cold run (one actor
of 1 CPU, ``init-args-num-cpus=1``) equals ``tests/reference/suite-quickstart.json``
(``simulation_runs.assert_reference``), and so do test_ray_cluster.py's warm runs (one actor of 2
CPUs; two actors of 1 CPU on two raylets, where ``init-args-num-cpus`` cannot be given).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_config

from feddifrc_app.data.registry import load_dataset
from feddifrc_app.device import TORCH_DEFAULT_THREADS, DeviceError, node_threads, torch_threads
from feddifrc_app.diffusion.shards import FeatureStore
from feddifrc_app.methods.feddifrc.teacher import feature_set, pooled_features, teacher_prompts, teacher_spec
from feddifrc_app.train import configure_torch

IMAGES = 20  # of the quickstart's mnist-5k, through its tiny-mnist (~0.15 s an image on one core)
BATCH = 8  # diffusion.batch-size: the shape at which 1 and 2 threads were measured to differ


def _fill(cache: Path, calls: list[np.ndarray], threads: int, **overrides) -> dict[int, np.ndarray]:
    """Fill a fresh cache with one ``pooled_features`` call per id set, the caller at ``threads``;
    every feature as the cache holds it (float16), by block."""
    cfg = make_config(plumbing=False, dataset__train_limit=200, **overrides)
    data = load_dataset(cfg.dataset, "train", seed=cfg.seed)
    features = feature_set(teacher_spec(cfg, cache), data, teacher_prompts(cfg, data.class_names))
    with torch_threads(threads):
        for ids in calls:
            pooled_features(features, ids)
        assert torch.get_num_threads() == threads  # the extraction's own count was put back
    ids = np.concatenate(calls)
    found, missing = FeatureStore(cache / "features").load(features.key, np.sort(ids))
    assert missing.size == 0
    return found


def _same_bits(a: dict[int, np.ndarray], b: dict[int, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    for blk in a:
        assert a[blk].dtype == b[blk].dtype == np.float16
        assert a[blk].tobytes() == b[blk].tobytes(), f"block {blk}: {(a[blk] != b[blk]).sum()} values differ"


def test_a_cache_holds_the_same_bits_whichever_id_sets_filled_it(tmp_path: Path) -> None:
    """A node extracts its own ids, `feddifrc extract` all of them: the images land in batches of
    other sizes (measured before padding: a batch of 8 or 12 vs 16 changed 136 of 84,480 float16
    values of 48 images, enough to move the federated basis)."""
    ids = np.arange(IMAGES)
    whole = _fill(tmp_path / "whole", [ids], threads=1, diffusion__batch_size=BATCH)  # 8 + 8 + 4
    halves = [ids[::2], ids[1::2]]  # two nodes' ids: 8 + 2 each
    _same_bits(whole, _fill(tmp_path / "nodes", halves, threads=1, diffusion__batch_size=BATCH))


def test_a_cache_holds_the_same_bits_whatever_the_writers_thread_count(tmp_path: Path) -> None:
    """At diffusion.batch-size 8, where measured 1 vs 2 threads changed every image's float32
    features (and 24 float16 values of 8 images): the extraction runs at one thread whatever the
    caller's count."""
    ids = np.arange(2 * BATCH)
    one = _fill(tmp_path / "one", [ids], threads=1, diffusion__batch_size=BATCH)
    two = _fill(tmp_path / "two", [ids], threads=2, diffusion__batch_size=BATCH)
    _same_bits(one, two)


def test_a_nodes_threads_come_from_train_threads_or_its_omp_num_threads_never_the_cores(monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert node_threads(0) == TORCH_DEFAULT_THREADS  # a deployment's node without it: torch's choice
    assert node_threads(3) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # what Ray sets in an actor of client-resources-num-cpus=2
    assert node_threads(0) == 2 and node_threads(1) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "4,2")  # OpenMP's nested form: the outer level
    assert node_threads(0) == 4
    monkeypatch.setenv("OMP_NUM_THREADS", "many")
    with pytest.raises(DeviceError, match="OMP_NUM_THREADS = 'many'.*train.threads"):
        node_threads(0)


def test_configure_torch_sets_the_threads_and_deterministic_kernels(monkeypatch) -> None:
    before = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")  # recorded, so the test's value is undone after it
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    try:
        assert configure_torch(make_config(train__threads=2, train__deterministic=True).train) == 2
        assert torch.get_num_threads() == 2 and torch.are_deterministic_algorithms_enabled()
        import os

        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"  # cuBLAS's deterministic workspace
        # The next message of another run in the same actor gets its own settings back.
        assert configure_torch(make_config(train__threads=1).train) == 1
        assert torch.get_num_threads() == 1 and not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.set_num_threads(before[0])
        torch.use_deterministic_algorithms(before[1])
