"""``benchmarks/round_overhead.py --scale paper``: the CIFAR-10 paper cell's client on this CPU
without a teacher. A random-pixel CIFAR-10 in the real file format, a feature cache of SD-2.1's
block widths filled with random pooled features through the real FeatureStore, and the
fresh-process check: a NEW process preparing the trained client's targets, as a deployment's
ClientApp does at every train message (``--fresh-targets``, run by round_overhead.py)."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Message, RecordDict

from feddifrc_app.config import load_node_config
from feddifrc_app.config_loader import load_config
from feddifrc_app.data.shares import client_split

SCRIPT = Path(__file__).resolve().with_name("round_overhead.py")  # the child runs its --fresh-targets

PAPER_SD_WIDTHS = {1: 1280, 2: 640, 3: 320}  # SD-2.1 unet.up_blocks[1..3] output channels


def trust_random_cifar() -> None:
    """Random pixels: no md5 to match; torchvision then only checks that the files exist."""
    from torchvision.datasets import CIFAR10

    for attr in ("train_list", "test_list"):
        setattr(CIFAR10, attr, [[name, None] for name, _ in getattr(CIFAR10, attr)])
    CIFAR10.meta = {**CIFAR10.meta, "md5": None}


def paper_scale(tmp: Path) -> dict[str, Any]:
    """A random-pixel CIFAR-10 (real file format) and the run-config overrides of the paper cell's
    client; the feature cache is filled by ``fill_paper_cache`` once the config is loaded."""
    trust_random_cifar()
    d = tmp / "data" / "cifar-10-batches-py"
    d.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name, n in [(f"data_batch_{i}", 10_000) for i in range(1, 6)] + [("test_batch", 1_000)]:
        batch = {
            "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            "labels": list(rng.integers(0, 10, n)),
        }
        with open(d / name, "wb") as f:
            pickle.dump(batch, f)
    with open(d / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"class{i}" for i in range(10)]}, f)
    return {
        "dataset.name": "cifar10",
        "dataset.data-dir": str(tmp / "data"),
        "dataset.image-size": 32,
        "partition.name": "iid",
        "model.width": 64,
        "diffusion.channels": "256,128,128",
        "train.batch-size": 64,
    }


def fill_paper_cache(cfg, cache_dir: Path) -> None:
    """Random pooled features with SD-2.1 widths for every training image, under the run's real key."""
    fill_random_features(cfg, cache_dir, PAPER_SD_WIDTHS)


def fill_random_features(cfg, cache_dir: Path, widths: dict[int, int], only_missing: bool = False) -> int:
    """Random pooled features (``widths``: block -> channels) for every training image of ``cfg``
    (``only_missing``: those not cached yet), written through the real FeatureStore under the
    run's real key; no teacher runs. Also used by benchmarks/scale.py. Returns the images filled."""
    from feddifrc_app.data.registry import load_dataset
    from feddifrc_app.diffusion.shards import FeatureStore
    from feddifrc_app.methods.feddifrc.teacher import feature_set, teacher_prompts, teacher_spec

    data = load_dataset(cfg.dataset, "train", seed=cfg.seed)
    prompts = teacher_prompts(cfg, data.class_names)
    features = feature_set(teacher_spec(cfg, cache_dir), data, prompts)
    key, fields = features.key, features.fields
    store = FeatureStore(cache_dir / "features")
    store.describe(key, fields)
    todo = store.missing(key, np.arange(len(data))) if only_missing else np.arange(len(data))
    rng = np.random.default_rng(1)
    step = 2560
    for s in range(0, len(todo), step):
        ids = todo[s : s + step]
        shape = (len(ids), len(prompts))
        store.save(
            key,
            ids,
            {b: rng.standard_normal((*shape, c), dtype=np.float32) for b, c in widths.items()},
        )
    size = sum(f.stat().st_size for f in store.key_dir(key).glob("*.npz"))
    print(
        f"  feature cache: {len(todo)} of {len(data)} images x {len(prompts)} prompts x "
        f"{sum(widths.values())} random channels filled, {size / 1e9:.2f} GB in "
        f"{len(list(store.key_dir(key).glob('*.npz')))} shards"
    )
    return len(todo)


def fresh_process_targets(
    run_config: dict[str, Any], node_config: dict[str, Any], basis: ArrayRecord | None, work: Path
) -> dict[str, float]:
    """Time a NEW Python process preparing one client's targets, as a deployment's ClientApp does
    at every train message (``--fresh-targets``, below); its numbers, from the child's stdout."""
    spec = work / "fresh-targets.json"
    basis_file = work / "fresh-targets-basis.npz"
    if basis is not None:
        np.savez(basis_file, **{k: v.numpy() for k, v in basis.items()})
    spec.write_text(
        json.dumps(
            {
                "run_config": run_config,
                "node_config": node_config,
                "basis": str(basis_file) if basis is not None else None,
            }
        )
    )
    t0 = time.perf_counter()
    cp = subprocess.run(
        [sys.executable, str(SCRIPT), "--fresh-targets", str(spec)],
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    if cp.returncode != 0:
        raise RuntimeError(f"the fresh process failed:\n{cp.stderr[-4000:]}")
    return {**json.loads(cp.stdout.strip().splitlines()[-1]), "process-seconds": wall}


def fresh_targets_child(spec_path: Path) -> int:
    """``--fresh-targets SPEC``: in this new process, the train handler's target preparation for the
    spec's client (FedDifRC's node half: cache key, prepared-targets file or shards, fusion)."""
    from feddifrc_app.halves import Node
    from feddifrc_app.methods import model_for
    from feddifrc_app.methods.feddifrc.node import node_half
    from feddifrc_app.records import arrays_to_record

    spec = json.loads(spec_path.read_text())
    trust_random_cifar()
    cfg, node = load_config(spec["run_config"]), load_node_config(spec["node_config"])
    data, ids = client_split(cfg, node)
    content = RecordDict()
    if spec["basis"] is not None:
        with np.load(spec["basis"]) as z:
            content["basis"] = arrays_to_record({k: z[k] for k in z.files})
    msg = Message(content, message_type="train", dst_node_id=1)
    half = node_half(msg, Node(cfg, data, ids, torch.device("cpu"), 0, RecordDict(), config=node))
    metrics = half.start(model_for(cfg, data.num_classes))
    print(
        json.dumps(
            {
                "teacher-seconds": metrics["teacher-seconds"],
                "teacher-cache-misses": metrics["teacher-cache-misses"],
            }
        )
    )
    return 0
