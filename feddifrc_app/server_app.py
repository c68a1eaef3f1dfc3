"""ServerApp: config -> setup exchange (node map + the methods' server halves) -> rounds -> results."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from flwr.app import Context, RecordDict
from flwr.serverapp import Grid, ServerApp

from feddifrc_app import log, methods, privacy, privacy_accounting, ray_address, tracking
from feddifrc_app.config import Config
from feddifrc_app.config_loader import load_config
from feddifrc_app.data.images import ImageData
from feddifrc_app.data.registry import load_dataset, load_validation
from feddifrc_app.device import platform_info
from feddifrc_app.federation import Federation, watch_for_stop
from feddifrc_app.files import write_json
from feddifrc_app.outputs import RunDir
from feddifrc_app.results import Results
from feddifrc_app.rounds import CentralEvaluator, RoundLoop, record_end
from feddifrc_app.tools import report

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = load_config(context.run_config)  # fails before any work on a bad value
    tracking.check(cfg)  # the tracking extra is the server's alone: checked here, not in load_config
    watch_for_stop()
    run = RunDir.for_config(cfg, context.run_id)
    log.info("run directory: %s", run.path)
    results, checkpoint = run.begin(cfg, context.run_id)  # checkpoint: None unless resume-from
    # From here the folder is this run's: however setup ends, results.json says so (the round
    # loop records its own end), and so does the tracker once started.
    tracker: tracking.Tracker = tracking.NoTracker()
    try:
        tracker = tracking.start(cfg, run.path, results)
        ray_address.check(grid)  # a simulation told to join a Ray that is gone would wait a day
        rounds = prepare(grid, cfg, run, results, checkpoint)
    except BaseException as e:
        record_end(run, results, e)
        tracker.close(results.status)
        raise
    rounds.run_all(tracker)


def prepare(
    grid: Grid, cfg: Config, run: RunDir, results: Results, checkpoint: dict[str, Any] | None
) -> RoundLoop:
    """The server's own parts, then the setup exchange: the round loop, ready to run."""
    write_json(run.path / "config.json", cfg.to_flat())
    results.privacy = private_settings(cfg)
    # Everything of the server's own that can fail (its datasets, server.device, the model, the
    # strategy) is built before the setup exchange: a wrong setting costs no node an extraction.
    # What the nodes run for the method (its models, devices and dtypes) is theirs: each node
    # checks it in setup before any work.
    test = load_dataset(cfg.dataset, "test", seed=cfg.seed)
    evaluator = CentralEvaluator(cfg, test, load_validation(cfg.dataset))
    fed = Federation(grid, cfg)
    method = methods.server_half(cfg)  # restored by the loop from a resume-from checkpoint
    rounds = RoundLoop(
        cfg, fed, run, results, evaluator, test.num_classes, method=method, checkpoint=checkpoint
    )

    # Setup exchange: node -> partition map, and what the method's server half asks of the
    # nodes and derives from their replies (once: a resumed run continues with its checkpoint).
    t0 = time.perf_counter()
    setup = fed.setup(fed.wait_for_nodes(), method.setup_work(), method.setup_nodes())
    check_classes(setup, fed, test)
    method.after_setup(setup, fed.partition_of, results)
    warn_noise(cfg, len(fed.partition_of), results)
    results.setup_seconds = time.perf_counter() - t0
    record_setup(cfg, setup, fed, test, run, results)
    return rounds


def private_settings(cfg: Config) -> dict | None:
    """results.json's privacy block: strategy.dp's settings and how its epsilon is accounted."""
    out = privacy.settings(cfg)
    if out is None:
        return None
    out |= privacy_accounting.settings(cfg)
    if out["accountant"] is None:
        log.warning("strategy.dp = %r: no epsilon is reported: %s", cfg.strategy.dp, out["not-accounted"])
    return out


def warn_noise(cfg: Config, nodes: int, results: Results) -> None:
    """strategy.dp's noise far above what a model absorbs, with the ``nodes`` known after setup:
    logged, and recorded in results.json's warnings (report, status and the sweep table show it)."""
    if warning := privacy.noise_warning(cfg, nodes):
        log.warning("%s", warning)
        results.warn(warning)


def check_classes(setup: dict[int, RecordDict], fed: Federation, test: ImageData) -> None:
    """Labels are positions in a class list: nodes with their own data-dir must share the server's."""
    for node, c in setup.items():
        if list(c["info"]["class-names"]) != list(test.class_names):
            raise ValueError(
                f"node {node} (partition-id {fed.partition_of[node]}) numbers its classes "
                f"{list(c['info']['class-names'])}, the server's test set {list(test.class_names)}; set "
                "dataset.classes to the federation's class folders in label order"
            )


def record_setup(
    cfg: Config,
    setup: dict[int, RecordDict],
    fed: Federation,
    test: ImageData,
    run: RunDir,
    results: Results,
) -> None:
    """Each node's label counts (table and plot)."""
    # Each node reports its own label counts, so the plot also covers nodes with their own data-dir.
    order = sorted(setup, key=lambda n: (fed.partition_of[n], n))
    counts = np.array([list(setup[n]["info"]["label-counts"]) for n in order], dtype=np.int64)
    results.label_counts = {
        str(fed.partition_of[n]): row.tolist() for n, row in zip(order, counts, strict=True)
    }
    title = f"{cfg.dataset.name}: {cfg.partition.name} (alpha={cfg.partition.alpha}), {len(order)} clients"
    report.plot_label_distribution(counts, test.class_names, run.path / "label_distribution.png", title)
    record_platforms(setup, fed, results)


def record_platforms(setup: dict[int, RecordDict], fed: Federation, results: Results) -> None:
    """results.json's ``platforms``: the server's (its central scores) and each distinct one of the
    nodes' with its partitions (their training). A resumed run whose platforms are not the first
    part's is warned: its numbers are not those of an uninterrupted run."""
    server = platform_info()
    groups: dict[tuple[tuple[str, str], ...], list[int]] = {}
    for node, reply in setup.items():
        info = reply["info"]
        key = tuple((k, str(info[f"platform-{k}"])) for k in server)
        groups.setdefault(key, []).append(fed.partition_of[node])
    nodes = [{**dict(k), "partitions": sorted(parts)} for k, parts in sorted(groups.items())]
    found = {"server": server, "nodes": nodes}
    if results.platforms is not None and results.platforms != found:
        warning = (
            f"resumed on other platforms ({found}) than the run's first part ({results.platforms}): "
            "its numbers are not an uninterrupted run's"
        )
        log.warning("%s", warning)
        results.warn(warning)
    results.platforms = found
