"""Run directory: summary numbers, atomic writes, checkpoints, plots."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import make_config
from feddifrc_app.outputs import RunDir, atomic_write, summarize
from feddifrc_app.report import format_table, plot_accuracy, plot_label_distribution


def test_summary_final_best_mean_last5():
    s = summarize([0.1, 0.5, 0.3, 0.4, 0.2, 0.6, 0.35])
    assert s["final-accuracy"] == 0.35
    assert s["best-accuracy"] == 0.6
    assert s["mean-last-5-accuracy"] == pytest.approx((0.3 + 0.4 + 0.2 + 0.6 + 0.35) / 5)
    assert summarize([0.2]) == {"final-accuracy": 0.2, "best-accuracy": 0.2, "mean-last-5-accuracy": 0.2}


def test_atomic_write_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "results.json"
    target.write_text("old")

    def boom(f):
        f.write("half")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        atomic_write(target, boom, mode="w")
    assert target.read_text() == "old"
    assert list(tmp_path.iterdir()) == [target]


def test_run_dir_results_and_checkpoints(tmp_path):
    cfg = make_config(outputs_dir=str(tmp_path), run_name="r1")
    run = RunDir.for_config(cfg, run_id=5)
    assert run.path == tmp_path / "r1"
    results = {"rounds": [{"round": 0, "test-accuracy": 0.1}, {"round": 1, "test-accuracy": 0.5},
                          {"round": 2, "test-accuracy": 0.4}]}
    run.save_results(results)
    saved = json.loads(run.results_path.read_text())
    # round 0 (the untrained model) is not part of the summary
    assert saved["summary"] == {"final-accuracy": 0.4, "best-accuracy": 0.5, "mean-last-5-accuracy": 0.45}
    for r in (1, 2, 3):
        run.save_checkpoint(r, {"round": r, "model": {"w": torch.full((2,), float(r))}}, keep=2)
    assert [p.name for p in run.checkpoints()] == ["round-0002.pt", "round-0003.pt"]
    rnd, payload = run.load_last_checkpoint()
    assert rnd == 3 and payload["model"]["w"][0] == 3.0
    # a corrupt newest checkpoint is skipped, not fatal
    run.checkpoint_path(3).write_bytes(b"\x00garbage")
    rnd, _ = run.load_last_checkpoint()
    assert rnd == 2


def test_resume_from_missing_dir_is_clear(tmp_path):
    cfg = make_config(resume_from=str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="resume-from"):
        RunDir.for_config(cfg, 1)


def test_plots_are_png(tmp_path):
    results = {"method": "feddifrc", "strategy": "fedavg", "dataset": "digits",
               "teacher": {"random-weights": True},
               "rounds": [{"round": 0, "test-accuracy": 0.1, "test-loss": 2.3},
                          {"round": 1, "test-accuracy": 0.6, "test-loss": 1.2, "failures": [],
                           "train-metrics": {"train-ce": 1.5}}],
               "summary": summarize([0.6])}
    plot_accuracy(results, tmp_path / "acc.png")
    plot_label_distribution(np.array([[3, 0], [1, 2]]), ["a", "b"], tmp_path / "dist.png", "t")
    for p in ("acc.png", "dist.png"):
        assert (tmp_path / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = format_table(results)
    assert "0.6000" in table and "1.5000" in table and "final 60.00%" in table
