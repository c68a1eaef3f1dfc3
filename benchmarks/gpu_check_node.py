"""The GPU check's sections E and F (``benchmarks/gpu_check.py``): a node's work beside the
denoiser. E. the feature cache's write stall; F. the paper cell's training step with 0 and 4
loader workers."""

from __future__ import annotations

import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

import full_size as fs  # the sibling benchmarks: benchmarks/ is on sys.path
import numpy as np
import torch
from gpu_check_measure import GB, PROMPTS, images, kernel_seconds, profiled, stand_in_featurizer, sync
from gpu_check_rows import Check

ROOT = Path(__file__).resolve().parents[1]


def section_e(c: Check) -> None:
    """SD-2.1 through ``cached_pooled_features``: how long extraction waits for the cache writer."""
    from feddifrc_app.diffusion.cache import LazyExtractor, cached_pooled_features
    from feddifrc_app.diffusion.shards import FeatureStore, key_fields, key_from_fields

    b, n, chunk, res = (2, 32, 8, 64) if c.dry else (32, 1024, 256, 224)
    teacher = fs.teacher("sd", c.device, c.dtype, small=c.dry)
    feat = stand_in_featurizer(teacher, res)
    base = images(64, seed=3)
    fields = key_fields(
        weights_hash=teacher.model_id,
        resolution=res,
        timestep=feat.timestep,
        blocks=feat.blocks,
        prompts=PROMPTS,
        seed=feat.seed,
        ensemble=1,
        dataset_fingerprint="gpu-check",
        dtype=str(c.dtype),
    )
    key = key_from_fields(fields)
    feat(base[:b], torch.arange(b), PROMPTS)  # warm-up
    c.data["E"] = {}
    with tempfile.TemporaryDirectory(prefix="feddifrc-gpu-check-") as tmp:
        store = FeatureStore(Path(tmp) / "features")
        for name, ids in (
            ("scattered ids (every 10th)", np.arange(n) * 10),
            ("contiguous ids", np.arange(n) + 10 * n),
        ):
            ex = LazyExtractor(lambda: feat, lambda sub: base[torch.as_tensor(sub) % len(base)], PROMPTS, b)
            _, s = cached_pooled_features(store, key, ids, ex, chunk=chunk)
            frac = s.stall_seconds / s.seconds
            c.data["E"][name] = {
                "seconds": s.seconds,
                "extract_seconds": s.extract_seconds,
                "write_seconds": s.write_seconds,
                "stall_seconds": s.stall_seconds,
            }
            text = (
                f"{100 * frac:.1f}% stalled ({s.stall_seconds:.2f} of {s.seconds:.1f} s; extract "
                f"{s.extract_seconds:.1f} s, writes {s.write_seconds:.2f} s; {n} images at B={b})"
            )
            c.judge(f"cache stall, {name}", frac, frac <= 0.05, "<= 5% of the wall time", text, gpu=True)


# --------------------------------------------------------------------------- F


def paper_config(conf: str = "conf/cifar10-nid1-a0.5-feddifrc.toml") -> dict[str, Any]:
    """The paper cell's flat run config: pyproject's defaults updated with the conf file, read
    with tomllib (flwr's ``app_defaults`` is not on a bare host)."""

    def flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    defaults = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    return flat(defaults) | flat(tomllib.loads((ROOT / conf).read_text()))


def section_f(c: Check) -> None:
    """``train_local`` of the paper cell on synthetic CIFAR-sized data with random teacher targets."""
    import torchvision  # noqa: F401  the loader's transforms: a SKIP naming it when absent

    from feddifrc_app.config_loader import load_config
    from feddifrc_app.model import build_model

    n = 64 if c.dry else 5000
    flat = paper_config() | {"train.device": c.device.type, "train.local-epochs": 1}
    if c.dry:
        flat |= {"model.width": 8, "diffusion.channels": "32,16,16", "train.batch-size": 16}
    cfg = load_config(flat)
    data, targets = _synthetic_client(n, cfg.embedding_dim)
    model = build_model(cfg.model.name, 10, cfg.model.width)
    d: dict[str, Any] = {}
    c.data["F"] = d
    for workers in (0, 4):
        if not c.time_for(25, f"training, {workers} loader workers"):
            continue
        cfg = load_config(flat | {"dataset.num-workers": workers})
        d[workers] = _training_speed(c, cfg, data, targets, model)
    if 0 in d and 4 in d:
        ratio = d[4]["steps_per_s"] / d[0]["steps_per_s"]
        c.add("4 workers / 0 workers", ratio, f"{ratio:.2f}x", "report: decides num-workers and pin_memory")


def _synthetic_client(n: int, dim: int):
    """(ImageData, TeacherTargets): ``n`` random CIFAR-sized images of 10 classes and random
    teacher targets of width ``dim`` for them."""
    from feddifrc_app.data.images import ImageData
    from feddifrc_app.data.sources.hub import CIFAR10_STATS
    from feddifrc_app.methods.feddifrc.targets import TeacherTargets

    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 10, (n,), generator=g).numpy().astype(np.int64)
    data = ImageData(
        name="cifar10",
        split="train",
        images=images(n, seed=4),
        labels=labels,
        class_names=[f"class {i}" for i in range(10)],
        fingerprint="gpu-check-synthetic",
        mean=CIFAR10_STATS[0],
        std=CIFAR10_STATS[1],
    )
    targets = TeacherTargets(
        rows=torch.arange(n),
        prompt_reps=torch.randn(n, 10, dim, generator=g),
        ndcr=torch.randn(n, dim, generator=g),
    )
    return data, targets


def _training_speed(c: Check, cfg, data, targets, model) -> dict[str, Any]:
    """One timed epoch (after a warm-up one) and one profiled: steps/s, GPU busy, peak memory."""
    from feddifrc_app.data.loader import make_loader
    from feddifrc_app.halves import Node
    from feddifrc_app.methods.feddifrc.node import FedDifRC
    from feddifrc_app.train import train_local

    n, workers = len(data.labels), cfg.dataset.num_workers
    loader = make_loader(
        data,
        np.arange(n),
        train=True,
        batch_size=cfg.train.batch_size,
        seed=0,
        num_workers=workers,
        augment=cfg.train.augment,
        pin_memory=c.cuda,  # as the ClientApp's training loader (client_app.py): on a CUDA device
    )

    def epoch(seed: int) -> dict[str, float]:
        half = FedDifRC(Node(cfg, data, np.arange(n), c.device, seed), targets=targets)
        return train_local(model, loader, cfg, c.device, halves=[half])[0]

    epoch(0)  # warm-up: kernels, the allocator, the optimiser's first step
    if c.cuda:
        torch.cuda.reset_peak_memory_stats(c.device)
    sync(c.device)
    t0 = time.perf_counter()
    steps = epoch(1)["local-steps"]
    sync(c.device)
    sps = steps / (time.perf_counter() - t0)
    prof, wall = profiled(lambda: epoch(2), c.device)
    busy = sum(kernel_seconds(prof).values()) / wall if c.cuda else None
    peak = torch.cuda.max_memory_allocated(c.device) if c.cuda else None
    more = f", GPU busy {busy:.2f}, peak {peak / GB:.2f} GB" if c.cuda else ""
    text = f"{sps:.1f} steps/s ({int(steps)} steps of {cfg.train.batch_size}){more}"
    if workers == 0:
        c.judge("steps/s, 0 loader workers", sps, sps >= 60, ">= 60 (a client-round <= 13 s)", text, gpu=True)
    else:
        c.add(f"steps/s, {workers} loader workers", sps, text)
    return {"steps": steps, "steps_per_s": sps, "busy": busy, "peak_bytes": peak}
