"""Shared by the simulation test files: one `flwr run` in Flower's Ray engine, judged by `flwr ls`."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import ROOT

# Two nodes, one Ray actor (2 CPUs each, of the 2 a cluster here has): the actor serves both nodes
# in turn. A second actor would pay another process start and torch import (~15 CPU-seconds per
# run) for no speed on 2 cores.
FED = "num-supernodes=2 client-resources-num-cpus=2"
# The server scores every round on val and test: 200 of each (stratified) keeps that cheap.
EVAL = "dataset.eval-limit=200"


def run_ok(procs, run_config: str, timeout: float = 600) -> dict:
    """Submit, wait, and require ``finished:completed``; the run id and its ServerApp log."""
    run_id = procs.submit_run(ROOT, "local", run_config=run_config, federation_config=FED)
    info = procs.wait_for_run(run_id, "local", timeout=timeout)
    log = procs.run_log(run_id, "local")
    assert info["status"] == "finished:completed", f"{info}\n{log[-4000:]}\n{procs.report()}"
    return {"id": run_id, "log": log}


def results(run_dir: Path) -> dict:
    return json.loads((run_dir / "results.json").read_text())
