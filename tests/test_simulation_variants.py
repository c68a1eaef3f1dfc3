"""Real `flwr run .` of FedDifRC composed with other strategies and options (self-supervised +
FedAdam; global-model conditioning + FedProx + federated evaluation): a file of its own, so
pytest-xdist (--dist loadfile) runs it beside the other simulation files.
"""

from __future__ import annotations

import pytest
from simulation_runs import EVAL, results, run_ok

pytestmark = pytest.mark.slow


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
def test_variants_run_in_simulation(flower_procs, tmp_path, name, overrides):
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
