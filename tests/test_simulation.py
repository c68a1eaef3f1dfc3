"""Real `flwr run .` in Flower's Ray simulation engine (no mocks, isolated FLWR_HOME).

Runs are submitted without --stream (which exits 0 even on failure) and their status is
read with `flwr ls --run-id ID --format json`; every process started is killed by PID by
the `flower_procs` fixture, also when a test fails.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from flower_procs import cmdline, descendants, flower_procs  # noqa: F401  (pytest fixture)

pytestmark = pytest.mark.slow

FED = "num-supernodes=2 client-resources-num-cpus=1"
# The server scores every round on val and test: 200 of each (stratified) keeps that cheap.
EVAL = "dataset.eval-limit=200"


def _run(procs, run_config: str, timeout: float = 600) -> dict:
    run_id = procs.submit_run(ROOT, "local", run_config=run_config, federation_config=FED)
    info = procs.wait_for_run(run_id, "local", timeout=timeout)
    log = procs.run_log(run_id, "local")
    assert info["status"] == "finished:completed", f"{info}\n{log[-4000:]}\n{procs.report()}"
    return {"id": run_id, "log": log}


def _results(run_dir: Path) -> dict:
    return json.loads((run_dir / "results.json").read_text())


def test_feddifrc_simulation_end_to_end_and_warm_cache(flower_procs, tmp_path):  # noqa: F811
    out, cache = tmp_path / "runs", tmp_path / "cache"
    base = (
        f"num-server-rounds=2 dataset.train-limit=120 {EVAL} outputs-dir='{out}' "
        f"diffusion.cache-dir='{cache}'"
    )
    first = _run(flower_procs, base + " run-name='cold'")
    r = _results(out / "cold")
    assert [x["round"] for x in r["rounds"]] == [0, 1, 2]
    for row in r["rounds"][1:]:
        m = row["train-metrics"]
        assert m["train-tdcl"] > 0 and m["train-ndcr"] > 0 and m["train-ce"] > 0
        assert -1.0 <= m["train-ndcr-cosine"] <= 1.0
        assert row["failures"] == [] and sorted(row["nodes"]) == [0, 1]
        assert 0.0 <= row["test-accuracy"] <= 1.0 and row["seconds"] > 0
        assert 0.0 <= row["val-accuracy"] <= 1.0 and row["val-loss"] > 0  # mnist-5k's public split
    s = r["summary"]
    assert s["final-accuracy"] == r["rounds"][-1]["test-accuracy"]
    assert s["best-accuracy"] == max(x["test-accuracy"] for x in r["rounds"][1:])
    chosen = max(r["rounds"][1:], key=lambda x: x["val-accuracy"])  # the checkpoint round, read off val
    assert (s["val-best-round"], s["test-at-val-best-accuracy"]) == (chosen["round"], chosen["test-accuracy"])
    from feddifrc_app.diffusion.pipeline import teacher_identity

    assert r["teacher"] == {
        "model": "tiny-mnist",
        "weights-sha256": teacher_identity("tiny-mnist", tmp_path / "ident").weights_hash,
        "random-weights": False,
        "devices": {"cpu float32": [0, 1]},  # 'auto' on a machine without CUDA
    }  # the packaged teacher, found from the FAB
    assert r["basis"]["mode"] == "federated-pca" and r["basis"]["nodes"] == 2
    assert r["setup-cache-misses"] == 120  # every training image extracted once, during setup
    assert sum(sum(c) for c in r["label-counts"].values()) == 120
    for name in ("accuracy.png", "label_distribution.png", "config.json"):
        assert (out / "cold" / name).is_file()
    assert len(list((out / "cold" / "checkpoints").glob("round-*.pt"))) == 2
    assert "loaded diffusion teacher" in first["log"]

    # `feddifrc extract` with the run's config fills a cache under the same keys: a run on that
    # cache never loads the teacher and extracts nothing, in setup or in any round.
    from feddifrc_app import cli

    filled = tmp_path / "extracted"
    extract = ["extract", "--app", str(ROOT), "--cache-dir", str(filled), "--num-partitions", "2"]
    assert cli.main([*extract, "--no-progress", "--run-config", "dataset.train-limit=120"]) == 0
    base = base.replace(f"diffusion.cache-dir='{cache}'", f"diffusion.cache-dir='{filled}'")
    second = _run(flower_procs, base + " run-name='warm'")
    w = _results(out / "warm")
    assert w["setup-cache-misses"] == 0
    assert all(row["train-metrics"]["teacher-cache-misses"] == 0 for row in w["rounds"][1:])
    assert "loaded diffusion teacher" not in second["log"]


def _stop_after_round_1(procs, run_config: str, run_dir: Path) -> int:
    """Submit, `flwr stop` once round 1 is saved; the last round saved (after the process is gone)."""
    run_id = procs.submit_run(ROOT, "local", run_config=run_config, federation_config=FED)
    deadline = time.monotonic() + 420
    while (
        not (run_dir / "results.json").is_file() or max(r["round"] for r in _results(run_dir)["rounds"]) < 1
    ):
        assert time.monotonic() < deadline, f"no round 1\n{procs.run_log(run_id, 'local')[-4000:]}"
        time.sleep(0.5)
    procs.flwr(["stop", str(run_id), "local"])
    assert procs.wait_for_run(run_id, "local", timeout=120, poll=0.5)["status"] == "finished:stopped"
    deadline = time.monotonic() + 60
    while any(
        "flwr-simulation" in cmdline(d) for p in procs.local_superlink_pids() for d in descendants(p)
    ):  # Flower forces the process out 5 s after the stop at the latest
        assert time.monotonic() < deadline, "the simulation process outlived flwr stop by a minute"
        time.sleep(0.5)
    return max(r["round"] for r in _results(run_dir)["rounds"])


def test_a_stopped_run_says_so_and_resumes_like_an_uninterrupted_one(flower_procs, tmp_path):  # noqa: F811
    out = tmp_path / "runs"
    base = (
        f"method='fedavg' dataset.train-limit=100 {EVAL} outputs-dir='{out}' "
        "partition.name='dirichlet' partition.alpha=0.5"
    )
    # `flwr stop`: no round is run or saved once the ServerApp knows (it used to run on to the
    # forced exit, saving rounds after the stop, and results.json never said "stopped").
    last = _stop_after_round_1(flower_procs, base + " num-server-rounds=500 run-name='part'", out / "part")
    stopped = _results(out / "part")
    assert stopped["status"] == "stopped" and "RunStopped" in stopped["error"], stopped
    assert [x["round"] for x in stopped["rounds"]] == list(range(last + 1))
    ckpts = sorted(p.name for p in (out / "part" / "checkpoints").glob("round-*.pt"))
    assert ckpts[-1] == f"round-{last:04d}.pt", ckpts
    assert not [p for p in (out / "part").rglob("*") if ".tmp" in p.name], "a partial file was left"

    # Resumed to one round more, it matches a run that was never stopped.
    rounds = last + 1
    _run(flower_procs, base + f" num-server-rounds={rounds} run-name='full'")
    _run(flower_procs, base + f" num-server-rounds={rounds} resume-from='{out / 'part'}'")
    full, resumed = _results(out / "full"), _results(out / "part")
    assert resumed["status"] == "completed" and "error" not in resumed
    assert [x["round"] for x in resumed["rounds"]] == list(range(rounds + 1))
    assert resumed["resumed"][0]["after-round"] == last
    for a, b in zip(full["rounds"], resumed["rounds"], strict=True):
        assert a.get("nodes") == b.get("nodes")
        assert a["test-accuracy"] == pytest.approx(b["test-accuracy"], abs=1e-9)
        assert a["test-loss"] == pytest.approx(b["test-loss"], rel=1e-5)
    ckpt = f"round-{rounds:04d}.pt"
    wa = torch.load(out / "full" / "checkpoints" / ckpt, weights_only=False)["model"]
    wb = torch.load(out / "part" / "checkpoints" / ckpt, weights_only=False)["model"]
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        # FedDifRC composes with other strategies by changing `strategy.name` only.
        ("ssl-fedadam", "method='feddifrc-ssl' strategy.name='fedadam'"),
        ("conditioned-fedprox", "diffusion.condition='global-model' strategy.name='fedprox'"),
    ],
)
def test_variants_run_in_simulation(flower_procs, tmp_path, name, overrides):  # noqa: F811
    out = tmp_path / "runs"
    _run(
        flower_procs,
        f"num-server-rounds=1 dataset.train-limit=60 {EVAL} outputs-dir='{out}' run-name='{name}' "
        f"diffusion.cache-dir='{tmp_path / 'cache'}' {overrides}",
    )
    r = _results(out / name)
    row = r["rounds"][1]
    assert row["failures"] == []
    assert 0.0 <= row["test-accuracy"] <= 1.0
    m = row["train-metrics"]
    if name.startswith("ssl"):
        assert "train-ce" not in m and m["train-tdcl"] > 0  # no labels, no CE
        assert row["test-loss"] is None  # linear-probe accuracy only
    else:
        assert m["condition-seconds"] > 0 and m["train-prox"] >= 0


def _failed_run(procs, run_config: str) -> dict:
    run_id = procs.submit_run(ROOT, "local", run_config=run_config, federation_config=FED)
    info = procs.wait_for_run(run_id, "local", timeout=600)
    assert info["status"] == "finished:failed", f"{info}\n{procs.run_log(run_id, 'local')[-4000:]}"
    return info


def test_a_node_setup_error_reaches_flwr_ls(flower_procs, tmp_path):  # noqa: F811
    (tmp_path / "file").write_text("not a folder")
    info = _failed_run(
        flower_procs,
        f"num-server-rounds=1 dataset.train-limit=60 {EVAL} outputs-dir='{tmp_path / 'runs'}' "
        f"diffusion.cache-dir='{tmp_path / 'file'}'",
    )
    assert "is not a folder" in info["status-details"], info
