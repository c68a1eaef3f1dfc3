"""Real `flwr run .` in Flower's Ray simulation engine (no mocks, isolated FLWR_HOME).

Runs are submitted without --stream (which exits 0 even on failure) and their status is
read with `flwr ls --run-id ID --format json`; every process started is killed by PID by
the `flower_procs` fixture, also when a test fails. The stop/resume runs are in
test_simulation_resume.py: two files, so two workers share the waits.
"""

from __future__ import annotations

import pytest
from conftest import ROOT
from flower_procs import flower_procs  # noqa: F401  (pytest fixture)
from simulation_runs import EVAL, FED, results, run_ok

pytestmark = pytest.mark.slow


def test_feddifrc_simulation_end_to_end_and_warm_cache(flower_procs, tmp_path):  # noqa: F811
    out, cache = tmp_path / "runs", tmp_path / "cache"
    base = (
        f"num-server-rounds=2 dataset.train-limit=120 {EVAL} outputs-dir='{out}' "
        f"diffusion.cache-dir='{cache}'"
    )
    first = run_ok(flower_procs, base + " run-name='cold'")
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
    second = run_ok(flower_procs, base + " run-name='warm'")
    w = results(out / "warm")
    assert w["setup-cache-misses"] == 0
    assert all(row["train-metrics"]["teacher-cache-misses"] == 0 for row in w["rounds"][1:])
    assert "loaded diffusion teacher" not in second["log"]


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        # FedDifRC composes with other strategies by changing `strategy.name` only.
        ("ssl-fedadam", "method='feddifrc-ssl' strategy.name='fedadam'"),
        # ... and with federated evaluation (each node scores the global model on its held-out 20%).
        (
            "conditioned-fedprox",
            "diffusion.condition='global-model' strategy.name='fedprox' "
            "fraction-evaluate=1.0 evaluate-holdout=0.2",
        ),
    ],
)
def test_variants_run_in_simulation(flower_procs, tmp_path, name, overrides):  # noqa: F811
    out = tmp_path / "runs"
    run_ok(
        flower_procs,
        f"num-server-rounds=1 dataset.train-limit=60 {EVAL} outputs-dir='{out}' run-name='{name}' "
        f"diffusion.cache-dir='{tmp_path / 'cache'}' {overrides}",
    )
    r = results(out / name)
    row = r["rounds"][1]
    assert row["failures"] == []
    assert 0.0 <= row["test-accuracy"] <= 1.0
    m = row["train-metrics"]
    if name.startswith("ssl"):
        assert "train-ce" not in m and m["train-tdcl"] > 0  # no labels, no CE
        assert row["test-loss"] is None  # linear-probe accuracy only
    else:
        assert m["condition-seconds"] > 0 and m["train-prox"] >= 0
        assert_federated_evaluation(r, total=60)


def assert_federated_evaluation(r: dict, total: int) -> None:
    """Every trained round has both nodes' scores on their held-out 20% and their example-weighted
    mean; the nodes trained on the other 80% (label counts) of their ``total`` examples."""
    for row in r["rounds"][1:]:
        nodes = row["evaluate-nodes"]
        assert [n["partition-id"] for n in nodes] == [0, 1] and row["evaluate-failures"] == []
        held = sum(n["num-examples"] for n in nodes)
        weighted = sum(n["num-examples"] * n["accuracy"] for n in nodes) / held
        assert 0.0 <= row["federated-accuracy"] <= 1.0 and row["federated-accuracy"] == pytest.approx(
            weighted
        )
        assert row["federated-loss"] == pytest.approx(
            sum(n["num-examples"] * n["loss"] for n in nodes) / held
        )
        trained = sum(sum(c) for c in r["label-counts"].values())
        assert trained + held == total and held == sum(round(0.2 * c) for c in partition_sizes(r, nodes))
    assert r["summary"]["final-federated-accuracy"] == r["rounds"][-1]["federated-accuracy"]


def partition_sizes(r: dict, nodes: list[dict]) -> list[int]:
    """Each evaluated node's whole partition: its training examples plus its held-out ones."""
    return [sum(r["label-counts"][str(n["partition-id"])]) + n["num-examples"] for n in nodes]


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


# Every Flower strategy this app added, each under one of the four DP modes: 1 round, no teacher,
# 40 images, run one after the other on the module's SuperLink: 146 s alone, SuperLink start
# included (submitting all four at once: 142 s, so not worth the interleaved logs).
STRATEGY_RUNS = [
    ("krum-server-fixed", FED, "strategy.name='krum' strategy.dp='server-fixed' min-nodes=2"),
    (
        "multikrum-client-fixed",
        FED,
        "strategy.name='multikrum' strategy.num-nodes-to-select=2 strategy.dp='client-fixed' min-nodes=2",
    ),
    (
        "bulyan-server-adaptive",  # Bulyan needs 4f + 3 = 3 nodes
        FED.replace("num-supernodes=2", "num-supernodes=3"),
        "strategy.name='bulyan' strategy.dp='server-adaptive' min-nodes=3",
    ),
    (
        "qfedavg-client-adaptive",
        FED,
        "strategy.name='qfedavg' strategy.dp='client-adaptive' min-nodes=2",
    ),
]


def test_robust_fair_and_private_strategies_run_in_simulation(flower_procs, tmp_path):  # noqa: F811
    out = tmp_path / "runs"
    # Tiny noise (std 0.001 x clipping norm / nodes): the noise lands on BatchNorm's running
    # variances too, and a large one would make them negative.
    base = (
        f"method='fedavg' num-server-rounds=1 dataset.train-limit=40 {EVAL} outputs-dir='{out}' "
        "strategy.dp-noise-multiplier=0.001 strategy.dp-clipped-count-stddev=1.0"
    )
    for name, fed, overrides in STRATEGY_RUNS:
        run_id = flower_procs.submit_run(
            ROOT, "local", run_config=f"{base} run-name='{name}' {overrides}", federation_config=fed
        )
        info = flower_procs.wait_for_run(run_id, "local", timeout=600)
        assert info["status"] == "finished:completed", (
            f"{name}: {info}\n{flower_procs.run_log(run_id, 'local')[-4000:]}"
        )
        r = results(out / name)
        strategy, mode = name.split("-", 1)
        assert r["strategy"] == strategy and r["privacy"]["mode"] == mode
        row = r["rounds"][1]
        assert row["failures"] == [] and len(row["nodes"]) == (3 if strategy == "bulyan" else 2)
        assert 0.0 <= row["test-accuracy"] <= 1.0
        if mode == "client-adaptive":
            assert 0.0 <= row["train-metrics"]["norm_bit"] <= 1.0  # each node said whether it clipped
