"""Real `flwr run .` in Flower's Ray simulation engine (no mocks, isolated FLWR_HOME).

Runs are submitted without --stream (which exits 0 even on failure) and their status is
read with `flwr ls --run-id ID --format json`; every process started is killed by PID by
the `flower_procs` fixture, also when a test fails. Resume after `flwr stop`.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from flower_procs import cmdline, descendants
from simulation_runs import EVAL, FED, results, run_ok
from tracking_stores import expected, f32, read_tensorboard

pytestmark = pytest.mark.slow


# A hang guard, not a speed bound: each wait below ends as soon as its condition holds; this only
# turns a hang into a failure that says what never happened (run_ok's guard for a whole run).
HANG = 600


def _wait_until(done, what) -> None:
    """Poll ``done()`` every 0.5 s until it holds; after HANG seconds, fail with ``what()``."""
    deadline = time.monotonic() + HANG
    while not done():
        if time.monotonic() > deadline:
            pytest.fail(f"{what()} (waited {HANG} s: hung)")
        time.sleep(0.5)


def _stop_after_round_1(procs, run_config: str, run_dir: Path) -> int:
    """Submit, `flwr stop` once round 1 is saved; the last round saved (after the process is gone)."""
    run_id = procs.submit_run(ROOT, "local", run_config=run_config, federation_config=FED)

    def round_1_saved() -> bool:
        saved = (run_dir / "results.json").is_file() and results(run_dir)["rounds"]
        return bool(saved) and max(r["round"] for r in saved) >= 1

    def simulation_gone() -> bool:  # Flower forces the process out 5 s after the stop at the latest
        pids = [d for p in procs.local_superlink_pids() for d in descendants(p)]
        return not any("flwr-simulation" in cmdline(d) for d in pids)

    _wait_until(round_1_saved, lambda: f"no round 1 saved\n{procs.run_log(run_id, 'local')[-4000:]}")
    procs.flwr(["stop", str(run_id), "local"])
    assert procs.wait_for_run(run_id, "local", timeout=HANG, poll=0.5)["status"] == "finished:stopped"
    _wait_until(simulation_gone, lambda: "the simulation process still runs after flwr stop")
    return max(r["round"] for r in results(run_dir)["rounds"])  # final: no process is left to save one


def test_a_stopped_run_says_so_and_resumes_like_an_uninterrupted_one(flower_procs, tmp_path):
    out = tmp_path / "runs"
    base = (
        f"method='fedavg' dataset.train-limit=100 {EVAL} outputs-dir='{out}' "
        # FedYogi: the server's own state (Adam-style moments m_t, v_t) must survive the resume
        # too, or the resumed rounds step differently from the uninterrupted ones.
        "partition.name='dirichlet' partition.alpha=0.5 strategy.name='fedyogi' "
        "tracking.backend='tensorboard'"  # its event files mirror results.json across the resume
    )
    # `flwr stop`: no round is run or saved once the ServerApp knows (it used to run on to the
    # forced exit, saving rounds after the stop, and results.json never said "stopped").
    last = _stop_after_round_1(flower_procs, base + " num-server-rounds=500 run-name='part'", out / "part")
    stopped = results(out / "part")
    assert stopped["status"] == "stopped" and "RunStopped" in stopped["error"], stopped
    assert [x["round"] for x in stopped["rounds"]] == list(range(last + 1))
    ckpts = sorted(p.name for p in (out / "part" / "checkpoints").glob("round-*.pt"))
    assert ckpts[-1] == f"round-{last:04d}.pt", ckpts
    assert not [p for p in (out / "part").rglob("*") if ".tmp" in p.name], "a partial file was left"
    assert read_tensorboard(out / "part") == expected(out / "part", f32)  # every saved row, once

    # Resumed to one round more, it matches a run that was never stopped.
    rounds = last + 1
    run_ok(flower_procs, base + f" num-server-rounds={rounds} run-name='full'")
    run_ok(flower_procs, base + f" num-server-rounds={rounds} resume-from='{out / 'part'}'")
    full, resumed = results(out / "full"), results(out / "part")
    assert resumed["status"] == "completed" and "error" not in resumed
    assert [x["round"] for x in resumed["rounds"]] == list(range(rounds + 1))
    assert resumed["resumed"][0]["after-round"] == last
    # Tracking: one event per number and round over both processes, equal to results.json's rows.
    assert read_tensorboard(out / "part") == expected(out / "part", f32)
    for a, b in zip(full["rounds"], resumed["rounds"], strict=True):
        assert a.get("nodes") == b.get("nodes")
        assert a["test-accuracy"] == pytest.approx(b["test-accuracy"], abs=1e-9)
        assert a["test-loss"] == pytest.approx(b["test-loss"], rel=1e-5)
    ckpt = f"round-{rounds:04d}.pt"
    ca = torch.load(out / "full" / "checkpoints" / ckpt, weights_only=False)
    cb = torch.load(out / "part" / "checkpoints" / ckpt, weights_only=False)
    for k in ca["model"]:
        torch.testing.assert_close(ca["model"][k], cb["model"][k], rtol=1e-5, atol=1e-6)
    assert full["strategy"] == "fedyogi" and {"m_t", "v_t"} <= set(ca["strategy"]), ca["strategy"].keys()
