"""Real `flwr run .` in Flower's Ray simulation engine (no mocks, isolated FLWR_HOME).

Runs are submitted without --stream (which exits 0 even on failure) and their status is
read with `flwr ls --run-id ID --format json`; every process started is killed by PID by
the `flower_procs` fixture, also when a test fails. The stop/resume runs are in
test_simulation_resume.py, the variants in test_simulation_variants.py and the robust/private
strategies in test_simulation_strategies.py: separate files, so the workers share the waits.
"""

from __future__ import annotations

import pytest
from conftest import ROOT
from simulation_runs import EVAL, FED, QUICK, assert_reference, results, run_ok

pytestmark = pytest.mark.slow

ONE_CPU = "num-supernodes=2 client-resources-num-cpus=1 init-args-num-cpus=1"


def test_feddifrc_simulation_end_to_end(flower_procs_own_ray, tmp_path):
    """The user's path: each run starts its own Ray, as `flwr run .` does (the other simulation
    tests join one cluster per test session), here sized by the run's federation config."""
    flower_procs = flower_procs_own_ray
    out, cache = tmp_path / "runs", tmp_path / "cache"
    base = f"{QUICK} outputs-dir='{out}' diffusion.cache-dir='{cache}'"
    # One actor of 1 CPU in a Ray told its size (init-args-num-cpus): the third layout whose numbers
    # must be the reference's, beside test_ray_cluster.py's one actor of 2 CPUs and two of 1 CPU.
    first = run_ok(flower_procs, base + " run-name='cold'", fed=ONE_CPU)
    r = results(out / "cold")
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
    from feddifrc_app.device import platform_info

    here = platform_info()  # the server and both nodes: this machine
    assert r["platforms"] == {"server": here, "nodes": [{**here, "partitions": [0, 1]}]}
    assert r["setup-cache-misses"] == 120  # every training image extracted once, during setup
    assert sum(sum(c) for c in r["label-counts"].values()) == 120
    for name in ("accuracy.png", "label_distribution.png", "config.json"):
        assert (out / "cold" / name).is_file()
    assert len(list((out / "cold" / "checkpoints").glob("round-*.pt"))) == 2
    assert "loaded diffusion teacher" in first["log"]
    # A run on a cache filled by `feddifrc extract` (no teacher loaded, nothing extracted) is
    # test_ray_cluster.py's one-machine reference.
    # This cold run (its cache filled by the actor, as it trained) gives the numbers the warm runs
    # of test_ray_cluster.py give too, on one raylet and two (test_determinism.py).
    assert_reference(r)


def _failed_run(procs, run_config: str) -> dict:
    run_id = procs.submit_run(ROOT, "local", run_config=run_config, federation_config=FED)
    info = procs.wait_for_run(run_id, "local", timeout=600)
    assert info["status"] == "finished:failed", f"{info}\n{procs.run_log(run_id, 'local')[-4000:]}"
    return info


def test_train_device_cuda_without_a_gpu_fails_at_the_nodes_in_round_1(flower_procs, tmp_path):
    """train.device = 'cuda' on this CPU-only machine (the paper confs pin it): the ServerApp never
    needs CUDA (its evaluation runs on server.device), so setup completes (the nodes extract on
    diffusion.device 'auto' = the CPU, the basis is fitted), the server scores round 0, and round 1
    fails at the nodes, each node's own reason in results.json and the first in `flwr ls`.

    This run replaced one that failed in setup (diffusion.cache-dir a file): a node's error still
    reaches `flwr ls` here; the nodes' setup errors ending the run, each named, are test_server_app's
    (a recording Grid), and the cache-dir check is test_client_app's."""
    out = tmp_path / "runs"
    info = _failed_run(
        flower_procs,
        f"num-server-rounds=2 dataset.train-limit=40 {EVAL} outputs-dir='{out}' run-name='cuda' "
        f"diffusion.cache-dir='{tmp_path / 'cache'}' train.device='cuda'",
    )
    r = results(out / "cuda")
    assert r["basis"]["nodes"] == 2 and r["setup-cache-misses"] == 40  # setup completed
    assert r["teacher"]["devices"] == {"cpu float32": [0, 1]}
    assert [x["round"] for x in r["rounds"]] == [0, 1]  # round 1 ended the run
    assert 0.0 <= r["rounds"][0]["test-accuracy"] <= 1.0  # the server's own evaluation, on its CPU
    failures = r["rounds"][1]["failures"]
    assert sorted(f["partition-id"] for f in failures) == [0, 1]
    for f in failures:
        assert "train.device = 'cuda', but " in f["reason"], f
    assert r["status"] == "failed" and r["error"].startswith(
        "NoUpdateError: round 1: no node returned a usable update (2 of 2 nodes failed; first failure: "
    )
    assert "train.device = 'cuda', but " in info["status-details"], info


# Every Flower strategy this app added, each under one of the four DP modes: 1 round, no teacher,
# 40 images, run one after the other on the module's SuperLink: 146 s alone, SuperLink start
# included (submitting all four at once: 142 s, so not worth the interleaved logs).
