"""Setup and round time of the quickstart at thousands of simulated nodes (issue 49, item 3).

Run by hand (not a test), e.g.

    python benchmarks/scale.py --nodes 100,5000
    python benchmarks/scale.py --nodes 100,500,1000,5000 --out /tmp/scale   # docs/performance.md's table

Each size is one real ``flwr run . local`` in Flower's Ray simulation (``num-supernodes=N
client-resources-num-cpus=1``, an isolated FLWR_HOME and free ports: ``tests/flower_procs.py``),
with the quickstart's method and teacher (``method = "feddifrc"``, ``diffusion.model =
"tiny-mnist"``), 5 nodes sampled per round (``fraction-train = 5 / N``), 5 rounds,
``partition.name = "iid"``, and ``min-nodes = N`` (setup starts once every node is connected).

The data: mnist-5k's 2,500 training digits in 5 versions (as they are, and shifted by 2 pixels
left, right, up and down), 12,500 images, so that each of 5,000 nodes holds at least 2 (one image
would break BatchNorm's training statistics), and mnist-5k's 1,000 test digits, written once as an
``image-folder`` dataset (PNG files; offline, from the data the app ships). ``dataset.val-fraction
= 0``: the server scores the test split only.

The teacher's feature cache is warm before any run (the one-time extraction grows with the
images, not the nodes): ``feddifrc extract`` with the real teacher fills ~250 images, timed and
printed on its own line as images/s, and the other images get random pooled features of the
teacher's block widths through the real FeatureStore (``--features random``, the default: round
and setup times do not depend on the values, so accuracies mean nothing here); ``--features
teacher`` extracts every image instead (hours on a busy 2-core machine).

The federated basis comes from a seeded sample of ``--basis-nodes`` nodes (``diffusion.basis-nodes``,
50 by default: the same setup work at every size); every node still answers the setup query with
who it is. What the sample costs the basis is printed first: the ~250 extracted images as nodes of
5 images, the basis from K of them against the basis from all (the share of the variance it
captures, per block that keeps fewer components than it has channels).

Printed per size: ``scale: N nodes: setup S s, round R s`` with S = results.json's
``setup-seconds`` (the setup exchange: every node's identity, the federated basis) and R = the
median of rounds 2-5's ``seconds``; then, per size, the wall time from submit to the end of the
run, results.json's size, and the ratio of each round to the first size's. Targets (issue 49, on
2 cores): setup <= 60 s at 5,000 nodes; round <= 1.5x the 100-node round. The machine's load
average is printed beside the numbers: compare the ratios on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from feddifrc_app.config_loader import load_config
from feddifrc_app.data.registry import load_dataset
from feddifrc_app.data.sources.digits import DIGIT_NAMES
from feddifrc_app.outputs import RunDir
from feddifrc_app.tools.cmd_common import one_line_errors
from feddifrc_app.tools.run_config import app_defaults
from feddifrc_app.tools.sweep import toml_value

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_env import load, work_folder  # noqa: E402
from flower_procs import FlowerProcs  # noqa: E402

SAMPLED = 5  # nodes per round
ROUNDS = 5  # the round time is the median of rounds 2..ROUNDS
SHIFT = 2  # pixels of each shifted copy
CLASSES = [n.replace(" ", "_") for n in DIGIT_NAMES]  # image-folder: "_" reads as " " (the prompts)
SETUP_TARGET, ROUND_TARGET = 60.0, 1.5
BASIS_NODES = 50  # diffusion.basis-nodes: the same setup work at every size


def shifted(images: np.ndarray) -> list[np.ndarray]:
    """uint8 (N, H, W) -> the images and their 4 copies moved by SHIFT pixels (zeros move in)."""
    out = [images]
    for axis in (1, 2):
        for step in (SHIFT, -SHIFT):
            moved = np.roll(images, step, axis=axis)
            edge = [slice(None)] * 3
            edge[axis] = slice(0, step) if step > 0 else slice(step, None)
            moved[tuple(edge)] = 0
            out.append(moved)
    return out


def write_dataset(root: Path) -> int:
    """mnist-5k's train digits x 5 (``shifted``) and its test digits as PNG class folders under
    ``root/train`` and ``root/test``; the number of training images. Written once per folder."""
    from PIL import Image

    done = root / "done.json"
    if done.is_file():
        return int(json.loads(done.read_text())["train"])
    cfg = load_config({**app_defaults(ROOT), "dataset.name": "mnist-5k", "dataset.image-size": 28}).dataset
    counts = {}
    for split in ("train", "test"):
        data = load_dataset(cfg, split)
        grey = data.images[:, 0].numpy()  # the 3 channels are copies
        copies = shifted(grey) if split == "train" else [grey]
        for c in CLASSES:
            (root / split / c).mkdir(parents=True, exist_ok=True)
        n = 0
        for v, imgs in enumerate(copies):
            for i, (img, label) in enumerate(zip(imgs, data.labels, strict=True)):
                Image.fromarray(img).save(root / split / CLASSES[int(label)] / f"{v}-{i:05d}.png")
                n += 1
        counts[split] = n
    done.write_text(json.dumps(counts))
    return counts["train"]


def run_config(work: Path, data: Path, nodes: int, basis_nodes: int = 0) -> dict[str, Any]:
    return {
        "method": "feddifrc",
        "diffusion.model": "tiny-mnist",
        "dataset.name": "image-folder",
        "dataset.data-dir": str(data),
        "dataset.classes": ",".join(CLASSES),
        "dataset.image-size": 28,
        "dataset.val-fraction": 0.0,
        "partition.name": "iid",
        "diffusion.basis-nodes": basis_nodes,
        "num-server-rounds": ROUNDS,
        "fraction-train": min(1.0, SAMPLED / nodes),
        "min-nodes": nodes,
        "diffusion.cache-dir": str(work / "cache"),
        "outputs-dir": str(work / "outputs"),
        "run-name": f"n{nodes}",
    }


def write_toml(path: Path, rc: dict[str, Any]) -> Path:
    path.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in rc.items()))
    return path


def extract(conf: Path, parts: int | None) -> str:
    """``feddifrc extract`` (the real teacher) of partition 0 of ``parts`` iid parts of the training
    images (None: all of them); its report line, with images/s."""
    which = (
        ["--num-partitions", "1"] if parts is None else ["--num-partitions", str(parts), "--partitions", "0"]
    )
    t0 = time.monotonic()
    cp = subprocess.run(
        [sys.executable, "-m", "feddifrc_app.tools.cli", "extract", "--run-config", str(conf), *which],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    if cp.returncode != 0:
        raise RuntimeError(f"feddifrc extract failed:\n{cp.stdout[-3000:]}\n{cp.stderr[-3000:]}")
    line = [ln for ln in cp.stdout.splitlines() if "images x" in ln][-1]
    return f"{line} ({time.monotonic() - t0:.0f} s with start-up; load {load()})"


def warm_cache(work: Path, data: Path, features: str) -> None:
    """The feature cache of every training image: the teacher's (``features = "teacher"``), or the
    teacher's for ~250 images (the extraction rate) and random pooled features of the teacher's
    block widths for the rest (``"random"``: round and setup times do not depend on the values;
    accuracies then mean nothing)."""
    from round_overhead_paper import fill_random_features

    conf = write_toml(work / "extract.toml", run_config(work, data, 1))
    images = sum(1 for _ in (data / "train").rglob("*.png"))
    print("extract: " + extract(conf, None if features == "teacher" else max(1, images // 250)), flush=True)
    if features == "random":
        shard = next((work / "cache" / "features").rglob("shard-*.npz"))
        with np.load(shard) as z:
            widths = {int(k.split("_")[1]): int(z[k].shape[-1]) for k in z.files if k.startswith("block_")}
        cfg = load_config({**app_defaults(ROOT), **run_config(work, data, 1)})
        fill_random_features(cfg, work / "cache", widths, only_missing=True)


def run_size(work: Path, data: Path, nodes: int, basis_nodes: int, timeout: float) -> dict[str, Any]:
    conf = write_toml(work / f"n{nodes}.toml", run_config(work, data, nodes, basis_nodes))
    fed = f"num-supernodes={nodes} client-resources-num-cpus=1"
    before = load()
    with FlowerProcs(work / f"flower-n{nodes}") as procs:
        t0 = time.monotonic()
        run_id = procs.submit_run(ROOT, "local", run_config=str(conf), federation_config=fed)
        info = procs.wait_for_run(run_id, "local", timeout=timeout)
        wall = time.monotonic() - t0
        if info.get("status") != "finished:completed":
            raise RuntimeError(f"{nodes} nodes: run {info}\n{procs.run_log(run_id, 'local')[-4000:]}")
    run = RunDir(work / "outputs" / f"n{nodes}")
    res = run.load_results()
    rounds = {r.round: r.seconds for r in res.rounds if r.round >= 2}
    return {
        "nodes": nodes,
        "setup": res.setup_seconds,
        "round": statistics.median(rounds.values()),
        "rounds": [rounds[k] for k in sorted(rounds)],
        "wall": wall,
        "results-bytes": (run.path / "results.json").stat().st_size,
        "basis": res.extra.get("basis"),
        "accuracy": res.rounds[-1].test_accuracy,
        "load": f"{before} -> {load()}",
    }


def basis_fidelity(work: Path, data: Path, per_node: int = 5, draws: int = 20) -> list[str]:
    """What ``diffusion.basis-nodes`` costs the basis, on the teacher's real features (the ~250
    images ``warm_cache`` extracted): those images as nodes of ``per_node`` images (the size of a
    node at thousands of nodes); the basis from a seeded sample of K nodes against the one from
    all; per block with fewer components than channels, the share of all rows' variance the
    sampled basis captures of what the full basis captures (1 = as good), min and mean over
    ``draws`` samples. One line per K."""
    import random

    from feddifrc_app.methods.feddifrc.projection import fit_federated_basis

    cfg = load_config({**app_defaults(ROOT), **run_config(work, data, 1)})
    nodes = _extracted_nodes(cfg, work, per_node)
    d = cfg.diffusion
    full, merged = fit_federated_basis(nodes, d.channels, d.blocks, cfg.embedding_dim)

    def captured(basis, b: int) -> float:  # variance of all rows inside the basis's subspace
        i = list(basis.blocks).index(b)
        w = basis.components[i].astype(np.float64)
        return float(np.trace(w.T @ merged[b].covariance() @ w))

    cut = [b for i, b in enumerate(full.blocks) if full.components[i].shape[1] < merged[b].channels]
    lines = []
    for k in (5, 10, 25):
        if k >= len(nodes):
            continue
        shares = {b: [] for b in cut}
        for r in range(draws):
            sample = random.Random(f"basis check {r}").sample(nodes, k)
            basis, _ = fit_federated_basis(sample, d.channels, d.blocks, cfg.embedding_dim)
            for b in cut:
                shares[b].append(captured(basis, b) / captured(full, b))
        lines.append(
            f"basis from {k} of {len(nodes)} nodes ({per_node} images each): "
            + "; ".join(
                f"block {b} ({full.components[list(full.blocks).index(b)].shape[1]} of {merged[b].channels} "
                f"channels) captures {min(v):.3f}-{np.mean(v):.3f} (min-mean) of the full basis's variance"
                for b, v in shares.items()
            )
            + (f"; blocks {[b for b in full.blocks if b not in cut]} keep every channel" if cut else "")
        )
    return lines


def _extracted_nodes(cfg, work: Path, per_node: int) -> list:
    """The PCA statistics of nodes of ``per_node`` images each, over the images ``warm_cache``
    extracted with the teacher (partition 0 of ~250-image partitions)."""
    from feddifrc_app.data.partition import partition_by_config
    from feddifrc_app.diffusion.shards import FeatureStore
    from feddifrc_app.methods.feddifrc.projection import client_stats
    from feddifrc_app.methods.feddifrc.teacher import feature_set, teacher_prompts, teacher_spec

    train = load_dataset(cfg.dataset, "train", seed=cfg.seed)
    parts = max(1, len(train) // 250)  # warm_cache's extraction: partition 0 of these
    ids = partition_by_config(train.labels, parts, cfg.partition, cfg.seed)[0]
    key = feature_set(teacher_spec(cfg, work / "cache"), train, teacher_prompts(cfg, train.class_names)).key
    feats, missing = FeatureStore(work / "cache" / "features").load(key, ids)
    if feats is None or len(missing):
        raise RuntimeError("basis check: the extracted features are not in the cache")
    return [
        client_stats({b: f[i : i + per_node] for b, f in feats.items()}) for i in range(0, len(ids), per_node)
    ]


@one_line_errors("benchmarks/scale.py")
def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    sizes = [int(s) for s in a.nodes.split(",") if s.strip()]
    with work_folder(a.out, "feddifrc-scale-") as work:
        data = work / "data"
        images = write_dataset(data)
        if images < 2 * max(sizes):
            raise SystemExit(f"{images} training images: fewer than 2 per node at {max(sizes)} nodes")
        print(f"data: {images} training images (mnist-5k train x 5 shifts) in {data}; load {load()}")
        warm_cache(work, data, a.features)
        for line in basis_fidelity(work, data):
            print(line, flush=True)
        out = []
        for n in sizes:
            r = run_size(work, data, n, a.basis_nodes, a.timeout)
            out.append(r)
            print(f"scale: {n} nodes: setup {r['setup']:.1f} s, round {r['round']:.2f} s", flush=True)
            print(
                f"  rounds 2-{ROUNDS} {', '.join(f'{s:.2f}' for s in r['rounds'])} s; submit -> finished "
                f"{r['wall']:.0f} s; results.json {r['results-bytes'] / 1024:.0f} KiB; basis from "
                f"{(r['basis'] or {}).get('nodes')} nodes; round-{ROUNDS} test accuracy {r['accuracy']:.4f}; "
                f"load {r['load']}",
                flush=True,
            )
        report(out)
        if a.json is not None:
            a.json.write_text(json.dumps(out, indent=1, default=str))
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="100,5000", help="comma-separated federation sizes")
    ap.add_argument("--out", type=Path, default=None, help="work folder (default: a temporary one)")
    ap.add_argument(
        "--basis-nodes",
        type=int,
        default=BASIS_NODES,
        help="diffusion.basis-nodes: the federated basis from a seeded sample of this many nodes (0 = all)",
    )
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    ap.add_argument(
        "--features",
        choices=("random", "teacher"),
        default="random",
        help="the cache's features: the teacher's for ~250 images (timed) and random ones of its widths for "
        "the rest (default), or the teacher's for all (hours on a busy 2-core machine)",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the measurements here")
    return ap.parse_args(argv)


def report(out: list[dict[str, Any]]) -> None:
    """Each size's round time against the first size's, and the setup time at the largest."""
    base = out[0]
    for r in out[1:]:
        ratio = r["round"] / base["round"]
        print(
            f"{r['nodes']} vs {base['nodes']} nodes: round {ratio:.2f}x (target <= {ROUND_TARGET}: "
            f"{'met' if ratio <= ROUND_TARGET else 'NOT met'})"
        )
    big = max(out, key=lambda r: r["nodes"])
    print(
        f"setup at {big['nodes']} nodes: {big['setup']:.1f} s (target <= {SETUP_TARGET:.0f} s at 5,000: "
        f"{'met' if big['setup'] <= SETUP_TARGET else 'NOT met'})"
    )


if __name__ == "__main__":
    raise SystemExit(main())
