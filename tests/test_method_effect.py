"""benchmarks/method_effect*.py: Holm's adjustment, the endpoints' windows, the paired test, the
verdict words, and the `plan` stage's reuse of earlier cells (no Flower run: plan runs nothing)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import method_effect as me  # noqa: E402
import method_effect_design as design  # noqa: E402
from method_effect_stats import endpoints, holm, paired, val_best_window, verdict, window_mean  # noqa: E402


def test_holm_hand_computed():
    # sorted 0.01, 0.03, 0.04 -> x3, x2, x1 = 0.03, 0.06, 0.04 -> non-decreasing: 0.03, 0.06, 0.06
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    # capped at 1; a NaN (no test) keeps its place and does not count in m (m = 2 here)
    adj = holm([0.6, math.nan, 0.02])
    assert adj[0] == pytest.approx(0.6) and math.isnan(adj[1]) and adj[2] == pytest.approx(0.04)
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])
    assert holm([]) == []


def test_secondary_window_centred_and_shifted_at_the_ends():
    test = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]  # round i: i / 10
    assert window_mean(test, 7, 8) == pytest.approx(75.0)
    val = [0.1, 0.2, 0.3, 0.4, 0.9, 0.5, 0.5, 0.5]  # best round 5: rounds 3-7
    assert val_best_window(val) == (3, 7)
    assert endpoints(val, test, (4, 8)) == pytest.approx(
        {"primary": 60.0, "secondary": 50.0, "final": 80.0, "best": 80.0, "last5": 60.0}
    )
    assert val_best_window([0.1, 0.9, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]) == (1, 5)  # best 2: shifted
    assert val_best_window([0.9, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]) == (1, 5)  # best 1
    assert val_best_window([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.9, 0.7]) == (4, 8)  # best R - 1
    assert val_best_window([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.9]) == (4, 8)  # best R
    assert val_best_window([0.1, 0.9, 0.3, 0.4, 0.5, 0.6, 0.9, 0.7]) == (1, 5)  # tie: the first
    assert val_best_window([0.3, 0.1, 0.2]) == (1, 3)  # fewer rounds than the window: all
    with pytest.raises(ValueError, match="outside"):
        window_mean(test, 0, 3)


def test_paired_t_test_and_verdicts():
    # deltas 1, 2, 3: mean 2, SD 1, t = 2 sqrt(3); df 2: p = 1 - t / sqrt(t^2 + 2) = 1 - sqrt(12 / 14)
    t = paired([1.0, 2.0, 3.0])
    assert (t["mean"], t["sd"], t["pos"], t["neg"]) == pytest.approx((2.0, 1.0, 3, 0))
    assert t["p"] == pytest.approx(1 - math.sqrt(12 / 14), rel=1e-9)
    assert verdict(t, 0.049) == "helps"
    assert verdict(t, 0.05) == "no detectable difference"
    assert verdict(paired([-1.0, -2.0, -3.0]), 0.01) == "hurts"
    assert verdict(paired([1.0]), math.nan) == "n < 2"


def test_comparisons_adjust_over_the_family():
    by = {
        (0.05, "fedavg"): {s: {"primary": 10.0, "secondary": 10.0} for s in range(3)},
        (0.05, "tdcl-only"): {s: {"primary": 20.0 + s, "secondary": 11.0 + s} for s in range(3)},
    }
    rows = me.comparisons(by)
    assert len(rows) == len(design.COMPARISONS) * len(design.PARTITIONS)
    (row,) = [r for r in rows if r["seeds"]]  # the one comparison with cells: a family of one
    assert row["what"] == "TDCL-only vs FedAvg" and row["alpha"] == 0.05
    assert row["secondary"]["p-holm"] == pytest.approx(1 - math.sqrt(12 / 14), rel=1e-9)
    assert row["secondary"]["p-holm"] == row["secondary"]["p"]
    assert row["verdict"] == "helps"  # deltas 10, 11, 12
    assert all(r["verdict"] == "n < 2" for r in rows if r is not row)


def test_identity_ignores_what_a_method_never_reads():
    part = design.PARTITIONS[0]
    arm = {a.name: a for a in design.arms()}
    fedavg = design.current_config(arm["fedavg"], part, 0)
    other = {**fedavg, "fednh.scale": 3.0, "diffusion.timestep": 7, "outputs-dir": "/x"}
    assert design.differences(fedavg, other) == []
    assert design.differences(fedavg, {**fedavg, "train.lr": 0.02}) == ["train.lr: 0.05 -> 0.02"]
    tdcl = design.current_config(arm["tdcl-only"], part, 0)
    assert design.differences(tdcl, {**tdcl, "diffusion.timestep": 7}) == ["diffusion.timestep: 25 -> 7"]
    old = {k: v for k, v in tdcl.items() if k != "loss.tdcl-targets"}
    assert design.differences(old, {**old, "loss.tdcl-targets": "image"}) == []  # neutral value
    assert design.differences(old, {**old, "loss.tdcl-targets": "anchors"}) == [
        "loss.tdcl-targets = 'anchors' is new and not declared neutral at that value"
    ]


def fake_cells(tmp_path):
    """An earlier run of 5 cells: 2 reusable, 3 not (other lr, other rounds, other temperature)."""
    arm = {a.name: a for a in design.arms()}
    p05, p5 = design.PARTITIONS

    def cell(name, label, part, seed, **change):
        cfg = {**design.current_config(arm[name], part, seed), **change}
        return {"arm": label, "alpha": part.alpha, "seed": seed, "val": [], "test": [], "config": cfg}

    cells = [
        cell("fedavg", "fedavg", p05, 0),
        cell("fedavg", "fedavg", p05, 1),
        cell("fedavg", "fedavg", p05, 2, **{"train.lr": 0.02}),
        cell("fedavg", "fedavg", p5, 0, **{"num-server-rounds": 16}),
        cell("tdcl-only", "tdcl-only [tiny-mnist]", p05, 0, **{"loss.temperature": 0.1}),
    ]
    path = tmp_path / "cells.json"
    path.write_text(json.dumps(cells))
    return path


def test_plan_reuses_exactly_the_identical_cells(tmp_path, monkeypatch):
    monkeypatch.setattr(design, "NDCR_TARGET", None)
    planned = design.plan(json.loads(fake_cells(tmp_path).read_text()))
    reused = {(p.arm.name, p.part.alpha, p.seed) for p in planned if p.reuse is not None}
    assert reused == {("fedavg", 0.05, 0), ("fedavg", 0.05, 1)}
    why = {(p.arm.name, p.part.alpha, p.seed): p.why_not for p in planned}
    assert why[("fedavg", 0.05, 2)] == "train.lr: 0.02 -> 0.05"
    assert why[("fedavg", 0.5, 0)] == "num-server-rounds: 16 -> 30"
    assert why[("tdcl-only", 0.05, 0)] == "NDCR target not chosen yet (NDCR_TARGET)"
    assert why[("fednh", 0.05, 0)] == "no earlier cell"
    # 4 key arms x 11 + FedNH x 6 at alpha 0.05, 4 x 16 + 6 at alpha 0.5
    assert len(planned) == 50 + 70
    assert design.budget_seconds(planned) == pytest.approx(48 * 100 + 70 * 190)


def test_plan_stage_prints_design_cells_reuse_and_budget(tmp_path):
    """The CLI's plan: runs nothing, lists the reused cells and the budget total (the teacher arms'
    fake cells differ from the plan's whether or not NDCR_TARGET is set)."""
    cp = subprocess.run(
        [sys.executable, "benchmarks/method_effect.py", "plan", "--legacy", str(fake_cells(tmp_path))],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert cp.returncode == 0, cp.stderr
    out = cp.stdout.splitlines()
    assert out[0] == "Declared design (before any new result):"
    assert [line for line in out if line.startswith("  reuse")] == [
        "  reuse  fedavg alpha 0.05 seed 0 (earlier arm 'fedavg')",
        "  reuse  fedavg alpha 0.05 seed 1 (earlier arm 'fedavg')",
    ]
    assert sum(line.startswith("  run ") for line in out) == 118
    assert out[-1].startswith("Budget: 118 cells to run, 2 reused; ~5.03 h")  # 18,100 s


def test_earlier_cells_rebuilt_from_their_commit(monkeypatch):
    """The committed 72 cells carry no config: it is rebuilt from LEGACY_COMMIT (git history)."""
    monkeypatch.setattr(design, "NDCR_TARGET", None)
    planned = design.plan(json.loads(design.LEGACY_CELLS.read_text()))
    reused = sorted((p.arm.name, p.part.alpha, p.seed) for p in planned if p.reuse is not None)
    assert reused == [("fedavg", 0.05, s) for s in range(6)]  # teacher arms wait for NDCR_TARGET
    fednh = next(p for p in planned if p.arm.name == "fednh" and p.part.alpha == 0.05)
    assert "fednh.scale: 1.0 -> 20.0" in fednh.why_not
    # The earlier teacher arms drew the teacher's noise from the run seed: reused at that noise only.
    monkeypatch.setattr(design, "NDCR_TARGET", {"diffusion.noise-seed": -1})
    planned = design.plan(json.loads(design.LEGACY_CELLS.read_text()))
    reused = sorted((p.arm.name, p.part.alpha, p.seed) for p in planned if p.reuse is not None)
    assert reused == sorted((a, 0.05, s) for a in ("fedavg", "feddifrc", "tdcl-only") for s in range(6))
    assert next(p for p in planned if p.arm.name == "tdcl-anchors").why_not == "new arm"
    monkeypatch.setattr(design, "NDCR_TARGET", {})  # today's default noise (diffusion.noise-seed = 0)
    planned = design.plan(json.loads(design.LEGACY_CELLS.read_text()))
    tdcl = next(p for p in planned if p.arm.name == "tdcl-only" and p.part.alpha == 0.05)
    assert (
        tdcl.reuse is None
        and tdcl.why_not == "diffusion.noise-seed = 0 is new and not declared neutral at that value"
    )
    monkeypatch.setattr(design, "NDCR_TARGET", {"diffusion.pooling": "grid", "diffusion.noise-seed": -1})
    planned = design.plan(json.loads(design.LEGACY_CELLS.read_text()))
    tdcl = next(p for p in planned if p.arm.name == "tdcl-only")
    assert (
        tdcl.reuse is None
        and tdcl.why_not == "diffusion.pooling = 'grid' is new and not declared neutral at that value"
    )


def test_sweep_cells_map_back_to_their_arm():
    """`table` labels a finished sweep cell by its conf file and grid, as the plan built it."""
    for p in design.plan([]):
        record = {"conf": p.cell.conf, "grid": p.cell.grid}
        assert me.design_arm(record) == p.arm.name
    assert me.design_arm({"conf": "conf/mnist5k-fedprox.toml", "grid": {"partition.alpha": 0.5}}) is None


def test_run_refuses_before_the_ndcr_target_is_chosen(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(design, "NDCR_TARGET", None)
    assert me.run(None, tmp_path, design.LEGACY_CELLS) == 2
    assert "NDCR_TARGET" in capsys.readouterr().out and not any(tmp_path.iterdir())


def test_a_typo_in_out_or_a_bad_legacy_file_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
    """Issue 45 case 10: `table --out <typo>` printed an empty table with rc 0 (and created the
    folder); a bad --legacy file was a traceback."""

    def main(*argv: str) -> str:
        monkeypatch.setattr(sys, "argv", ["method_effect.py", *argv])
        assert me.main() == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        return err

    typo = tmp_path / "no-such-out"
    assert main("table", "--out", str(typo)) == (
        f"method_effect table: error: --out {typo}: no `run` stage here (no {typo / 'run'} folder); "
        "pass the --out that `method_effect.py run` wrote into\n"
    )
    assert not typo.exists()
    (tmp_path / "out" / "run").mkdir(parents=True)
    bad = {"missing.json": None, "text.json": "{not json", "object.json": '{"cells": []}'}
    bad |= {"short.json": json.dumps([{"arm": "fedavg", "alpha": 0.05, "seed": 0, "val": []}])}
    bad |= {
        "strings.json": json.dumps([{"arm": "fedavg", "alpha": 0.05, "seed": 0, "val": ["x"], "test": []}])
    }
    said = {
        "missing.json": "cannot read it (No such file or directory)",
        "text.json": "not JSON (Expecting property name",
        "object.json": "expected a list of cells",
        "short.json": "cell 0 lacks a valid test (each cell",
        "strings.json": "cell 0 lacks a valid val/test (numbers)",
    }
    for name, text in bad.items():
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        for stage in ("plan", "table"):
            err = main(stage, "--out", str(tmp_path / "out"), "--legacy", str(path))
            assert err.startswith(f"method_effect {stage}: error: --legacy {path}: {said[name]}"), err
