"""Shared by the simulation test files: one `flwr run` in Flower's Ray engine, judged by `flwr ls`."""

from __future__ import annotations

import json
from pathlib import Path

import platform_refs
from conftest import ROOT

# Two nodes, one Ray actor (2 CPUs each, of the 2 a cluster here has): the actor serves both nodes
# in turn. A second actor would pay another process start and torch import (~15 CPU-seconds per
# run) for no speed on 2 cores.
FED = "num-supernodes=2 client-resources-num-cpus=2"
# The server scores every round on val and test: 200 of each (stratified) keeps that cheap.
EVAL = "dataset.eval-limit=200"


def run_ok(procs, run_config: str, timeout: float = 600, fed: str = FED) -> dict:
    """Submit, wait, and require ``finished:completed``; the run id and its ServerApp log."""
    run_id = procs.submit_run(ROOT, "local", run_config=run_config, federation_config=fed)
    info = procs.wait_for_run(run_id, "local", timeout=timeout)
    log = procs.run_log(run_id, "local")
    assert info["status"] == "finished:completed", f"{info}\n{log[-4000:]}\n{procs.report()}"
    return {"id": run_id, "log": log}


def results(run_dir: Path) -> dict:
    return json.loads((run_dir / "results.json").read_text())


# The numbers of the suite's quickstart run (QUICK, 2 nodes, seed 7): every run of it, whatever its
# layout (one actor or two, one raylet or two) and whoever filled its feature cache, must give them.
QUICK = f"num-server-rounds=2 dataset.train-limit=120 {EVAL}"
REFERENCE = Path(__file__).parent / "reference" / "suite-quickstart.json"


def numbers(r: dict) -> dict:
    """What a layout must not change in a results.json: the basis, the summary and every round's
    row, less the wall times and the replies' machines."""

    def row(x: dict) -> dict:
        out = {k: v for k, v in x.items() if k not in ("seconds", "origins")}
        if "train-metrics" in out:
            out["train-metrics"] = {k: v for k, v in x["train-metrics"].items() if not k.endswith("-seconds")}
        return out

    return {"basis": r["basis"], "summary": r["summary"], "rounds": [row(x) for x in r["rounds"]]}


def assert_reference(r: dict) -> None:
    """``r`` (a run of QUICK) has the reference's numbers for this platform (torch version, CPU
    kernels), bit for bit; on a platform the file has no entry for, the test is skipped, saying
    which it has. FEDDIFRC_WRITE_REFERENCE=1 (re)writes this platform's entry from ``r``, for a
    change meant to move the numbers (rewrite every platform's, or drop the others)."""
    import os

    import pytest

    from feddifrc_app.device import platform_info

    here = platform_info()
    if os.environ.get("FEDDIFRC_WRITE_REFERENCE") == "1":
        platform_refs.store(REFERENCE, here, numbers(r))
    ref = platform_refs.entry(REFERENCE, here)
    if ref is None:
        pytest.skip(f"{REFERENCE.name} has numbers for {platform_refs.platforms(REFERENCE)}, this is {here}")
    assert numbers(r) == ref, (
        f"the numbers differ from {REFERENCE.name}'s for {here}; if a change is meant to move them, "
        "rerun with FEDDIFRC_WRITE_REFERENCE=1 (and say why in the commit)"
    )
