"""Real `flwr run .` of FedDifRC with a tiny random teacher of every other diffusers family
(SDXL's UNet, PixArt's and SD3's transformers), each with one of Flower's FedAvg-family strategies
no other simulation test runs: one file of its own, so pytest-xdist (--dist loadfile) runs it
beside the other simulation files. Random teachers: these runs show the plumbing, not the method.
"""

from __future__ import annotations

import pytest
from simulation_runs import EVAL, results, run_ok

pytestmark = pytest.mark.slow

TEACHER_RUNS = [
    ("sdxl-fedavgm", "diffusion.model='tiny-sdxl' diffusion.blocks='0,1,2' strategy.name='fedavgm'"),
    (
        "pixart-fedadagrad",
        "diffusion.model='tiny-pixart' diffusion.blocks='1,2,3' strategy.name='fedadagrad'",
    ),
    # ... and the TDCL-anchors control: the server's class anchors ride in every train message.
    (
        "sd3-fedmedian",
        "diffusion.model='tiny-sd3' diffusion.blocks='1,2,3' strategy.name='fedmedian' "
        "loss.tdcl-targets='anchors'",
    ),
]


def test_every_teacher_family_runs_in_simulation(flower_procs, tmp_path):
    out, cache = tmp_path / "runs", tmp_path / "cache"
    base = (
        f"num-server-rounds=1 dataset.train-limit=40 {EVAL} diffusion.resolution=16 min-nodes=2 "
        f"outputs-dir='{out}' diffusion.cache-dir='{cache}'"
    )
    for name, overrides in TEACHER_RUNS:
        run_ok(flower_procs, f"{base} run-name='{name}' {overrides}")
        r = results(out / name)
        family, strategy = name.split("-")
        assert r["strategy"] == strategy and r["teacher"]["model"] == f"tiny-{family}-seed0"  # built, seed 0
        assert r["teacher"]["random-weights"] is True
        row = r["rounds"][1]
        assert row["failures"] == [] and sorted(row["nodes"]) == [0, 1]
        m = row["train-metrics"]
        assert m["train-tdcl"] > 0 and m["train-ndcr"] > 0 and -1.0 <= m["train-ndcr-cosine"] <= 1.0
        assert r["basis"]["mode"] == "federated-pca" and r["setup-cache-misses"] == 40
        if family == "sd3":  # the anchors: one per class prompt of mnist-5k
            assert r["basis"]["anchors"] == {"prompts": 10, "width": 128}  # 8 x model.width
        else:
            assert "anchors" not in r["basis"]
