"""Real `flwr run .` of the strategies Flower ships for robustness and fairness (Krum, MultiKrum,
Bulyan, QFedAvg), each with one differential-privacy mode, and of FedTrimmedAvg: one file of its
own, so pytest-xdist (--dist loadfile) runs it beside the other simulation files.
"""

from __future__ import annotations

import math

import pytest
from conftest import ROOT
from simulation_runs import EVAL, FED, results

from feddifrc_app.privacy import Release
from feddifrc_app.privacy_accounting import accounted_multiplier, epsilon

pytestmark = pytest.mark.slow


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
    # Without DP, the one FedAvg-family strategy no other simulation test runs (FedAvgM,
    # FedAdagrad, FedMedian: test_simulation_teachers.py; FedYogi: the resume test; FedAdam and
    # FedProx: the FedDifRC variants; FedAvg: everywhere).
    ("fedtrimmedavg-none", FED, "strategy.name='fedtrimmedavg' min-nodes=2"),
]


def test_strategies_run_in_simulation(flower_procs, tmp_path):
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
        assert r["strategy"] == strategy
        assert r.get("privacy", {"mode": "none"})["mode"] == mode  # no privacy block without DP
        row = r["rounds"][1]
        assert row["failures"] == [] and len(row["nodes"]) == (3 if strategy == "bulyan" else 2)
        assert 0.0 <= row["test-accuracy"] <= 1.0
        if mode == "client-adaptive":
            assert 0.0 <= row["train-metrics"]["norm_bit"] <= 1.0  # each node said whether it clipped
        if mode == "none":
            assert "epsilon" not in row and "dp-release" not in row
        else:
            check_epsilon(r, strategy, len(row["nodes"]))


def check_epsilon(r: dict, strategy: str, m: int) -> None:
    """Krum and MultiKrum release one clipped update or a mean of them: accounted, with every
    node of the round (N = m) and Flower's noise multiplier 0.001; Bulyan and QFedAvg are not."""
    row, p = r["rounds"][1], r["privacy"]
    assert p["delta"] == 1e-5 and p["weighting"].startswith("uniform")
    if strategy in ("bulyan", "qfedavg"):
        assert p["accountant"] is None and strategy in p["not-accounted"] and "epsilon" not in row
        return
    assert row["dp-release"] == {
        "population": m,
        "sampled": m,
        "aggregated": m,
        "update-multiplier": 0.001,
        "count-stddev": None,
    }
    sigma = accounted_multiplier(strategy, Release(m, m, m, 0.001, None))
    assert sigma == 0.001 / (2 * m)  # std z C / m on a point of the C-ball (sensitivity 2C)
    assert math.isfinite(row["epsilon"]) and row["epsilon"] > 0
    assert row["epsilon"] == pytest.approx(epsilon([(m, m, sigma)], 1e-5, amplified=False), rel=1e-12)
    assert row["epsilon-if-sample-secret"] == row["epsilon"]  # m = N: nothing to amplify
