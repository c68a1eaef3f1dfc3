"""ServerApp: config -> setup exchange (node map + federated PCA basis) -> rounds -> results."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Context, RecordDict
from flwr.serverapp import Grid, ServerApp

from feddifrc_app import log, privacy, privacy_accounting
from feddifrc_app.config import Config, load_config
from feddifrc_app.data.images import ImageData
from feddifrc_app.data.registry import load_dataset, load_validation
from feddifrc_app.federation import Federation, watch_for_stop
from feddifrc_app.files import write_json
from feddifrc_app.methods.feddifrc.projection import fit_federated_basis, stats_from_arrays
from feddifrc_app.outputs import RunDir
from feddifrc_app.records import arrays_to_record, record_to_arrays
from feddifrc_app.results import Results
from feddifrc_app.rounds import CentralEvaluator, RoundLoop, record_end
from feddifrc_app.tools import report

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = load_config(context.run_config)  # fails before any work on a bad value
    watch_for_stop()
    run = RunDir.for_config(cfg, context.run_id)
    log.info("run directory: %s", run.path)
    results, checkpoint = run.begin(cfg, context.run_id)  # checkpoint: None unless resume-from
    # From here the folder is this run's: however setup ends, results.json says so (the round
    # loop records its own end).
    try:
        rounds = prepare(grid, cfg, run, results, checkpoint)
    except BaseException as e:
        record_end(run, results, e)
        raise
    rounds.run_all()


def prepare(
    grid: Grid, cfg: Config, run: RunDir, results: Results, checkpoint: dict[str, Any] | None
) -> RoundLoop:
    """The server's own parts, then the setup exchange: the round loop, ready to run."""
    write_json(run.path / "config.json", cfg.to_flat())
    results.privacy = private_settings(cfg)
    # Everything of the server's own that can fail (its datasets, server.device, the model, the
    # strategy) is built before the setup exchange: a wrong setting costs no node an extraction.
    # The teacher is the nodes' (its weights, device and dtype are theirs): each node checks it
    # in setup before extracting anything (teacher.teacher_spec).
    test = load_dataset(cfg.dataset, "test", seed=cfg.seed)
    evaluator = CentralEvaluator(cfg, test, load_validation(cfg.dataset))
    fed = Federation(grid, cfg)
    rounds = RoundLoop(cfg, fed, run, results, evaluator, test.num_classes, basis=None, checkpoint=checkpoint)

    # Setup exchange: node -> partition map and, once, the shared basis (federated PCA; a
    # resumed run continues with the checkpoint's).
    want_stats = cfg.uses_diffusion and cfg.diffusion.projection == "federated-pca" and checkpoint is None
    t0 = time.perf_counter()
    setup = fed.setup(fed.wait_for_nodes(), want_stats)
    check_classes(setup, fed, test)
    check_teachers(setup, fed)
    if want_stats:
        rounds.basis = federated_basis(cfg, setup, results)
    results.setup_seconds = time.perf_counter() - t0
    record_setup(cfg, setup, fed, test, run, results)
    return rounds


def private_settings(cfg: Config) -> dict | None:
    """results.json's privacy block: strategy.dp's settings and how its epsilon is accounted."""
    out = privacy.settings(cfg)
    if out is None:
        return None
    if warning := privacy.noise_warning(cfg):
        log.warning("%s", warning)
    out |= privacy_accounting.settings(cfg)
    if out["accountant"] is None:
        log.warning("strategy.dp = %r: no epsilon is reported: %s", cfg.strategy.dp, out["not-accounted"])
    return out


def federated_basis(cfg: Config, setup: dict[int, RecordDict], results: Results) -> ArrayRecord:
    """Fit the shared PCA basis from the nodes' sufficient statistics (counts, sums, second moments)."""
    stats = [stats_from_arrays(record_to_arrays(c["pca-stats"])) for c in setup.values() if "pca-stats" in c]
    d = cfg.diffusion
    basis, merged = fit_federated_basis(stats, d.channels, d.blocks, cfg.embedding_dim)
    results.basis = {
        "mode": "federated-pca",
        "fingerprint": basis.fingerprint(),
        "rows": merged[d.blocks[0]].count,
        "nodes": len(stats),
        "widths": list(basis.widths),
    }
    results.setup_cache_misses = sum(int(c["info"]["teacher-cache-misses"]) for c in setup.values())
    return arrays_to_record(basis.to_arrays())


def check_classes(setup: dict[int, RecordDict], fed: Federation, test: ImageData) -> None:
    """Labels are positions in a class list: nodes with their own data-dir must share the server's."""
    for node, c in setup.items():
        if list(c["info"]["class-names"]) != list(test.class_names):
            raise ValueError(
                f"node {node} (partition-id {fed.partition_of[node]}) numbers its classes "
                f"{list(c['info']['class-names'])}, the server's test set {list(test.class_names)}; set "
                "dataset.classes to the federation's class folders in label order"
            )


def check_teachers(setup: dict[int, RecordDict], fed: Federation) -> None:
    """Every node's teacher has the same weights: features of different weights live in different
    spaces, so neither one PCA basis nor the comparison of their targets would mean anything."""
    weights: dict[str, list[int]] = {}
    for n in sorted(setup, key=lambda n: (fed.partition_of[n], n)):
        if "teacher-weights" in setup[n]["info"]:
            weights.setdefault(str(setup[n]["info"]["teacher-weights"]), []).append(fed.partition_of[n])
    if len(weights) > 1:
        raise ValueError(
            "the nodes run different diffusion teachers (weights sha256 -> partition ids: "
            + "; ".join(f"{h[:12]} -> {p}" for h, p in weights.items())
            + "): give every node the same diffusion.model files"
        )


def record_setup(
    cfg: Config,
    setup: dict[int, RecordDict],
    fed: Federation,
    test: ImageData,
    run: RunDir,
    results: Results,
) -> None:
    """Which teacher the nodes run, and each node's label counts (table and plot)."""
    teacher = [c["info"] for c in setup.values() if "teacher-model" in c["info"]]
    if teacher:
        devices: dict[str, list[int]] = {}
        for n in sorted(setup, key=lambda n: (fed.partition_of[n], n)):
            devices.setdefault(str(setup[n]["info"]["teacher-device"]), []).append(fed.partition_of[n])
        results.teacher = {
            "model": str(teacher[0]["teacher-model"]),
            "weights-sha256": str(teacher[0]["teacher-weights"]),  # check_teachers: the same on every node
            "random-weights": bool(teacher[0]["teacher-random-weights"]),
            "devices": devices,  # "cuda float16" -> partition ids
        }
        log.info("diffusion teacher %s on %s", results.teacher["model"], devices)
        if results.teacher["random-weights"]:
            log.warning(
                "the diffusion teacher has RANDOM weights: this run shows that the pipeline works "
                "(or is a control), not that FedDifRC helps"
            )
    # Each node reports its own label counts, so the plot also covers nodes with their own data-dir.
    order = sorted(setup, key=lambda n: (fed.partition_of[n], n))
    counts = np.array([list(setup[n]["info"]["label-counts"]) for n in order], dtype=np.int64)
    results.label_counts = {
        str(fed.partition_of[n]): row.tolist() for n, row in zip(order, counts, strict=True)
    }
    title = f"{cfg.dataset.name}: {cfg.partition.name} (alpha={cfg.partition.alpha}), {len(order)} clients"
    report.plot_label_distribution(counts, test.class_names, run.path / "label_distribution.png", title)
