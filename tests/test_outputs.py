"""Run directory: summary numbers, atomic writes, checkpoints, plots."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from conftest import make_config

from feddifrc_app.files import atomic_write, write_json
from feddifrc_app.outputs import RunDir
from feddifrc_app.results import Results, RoundRow, summarize
from feddifrc_app.tools.report import format_table, plot_accuracy, plot_label_distribution


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


def test_a_full_disk_is_named_and_loses_nothing(tmp_path):
    import errno

    target = tmp_path / "round-0001.pt"
    target.write_bytes(b"old")

    def full(f):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(
        OSError, match=r"disk full writing .*round-0001.pt; the previous version .* is intact"
    ):
        atomic_write(target, full)
    assert target.read_bytes() == b"old" and list(tmp_path.iterdir()) == [target]


def test_run_dir_results_and_checkpoints(tmp_path):
    cfg = make_config(outputs_dir=str(tmp_path), run_name="r1")
    run = RunDir.for_config(cfg, run_id=5)
    assert run.path == tmp_path / "r1"
    results = Results(
        rounds=[
            RoundRow(0, test_accuracy=0.1),
            RoundRow(1, test_accuracy=0.5),
            RoundRow(2, test_accuracy=0.4),
        ]
    )
    run.save_results(results)
    saved = json.loads(run.results_path.read_text())
    # round 0 (the untrained model) is not part of the summary
    s = saved["summary"]
    assert (s["final-accuracy"], s["best-accuracy"], s["mean-last-5-accuracy"]) == (0.4, 0.5, 0.45)
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


def test_a_run_directory_belongs_to_one_run(tmp_path):
    cfg = make_config(outputs_dir=str(tmp_path), run_name="r1")
    run = RunDir.for_config(cfg, run_id=1)
    run.save_results(Results(rounds=[RoundRow(1, test_accuracy=0.5)]))
    run.save_checkpoint(1, {"round": 1, "model": {"w": torch.zeros(1)}})
    before = {p: p.read_bytes() for p in run.path.rglob("*") if p.is_file()}
    with pytest.raises(FileExistsError, match="already holds another run.*resume-from = '.*r1'"):
        RunDir.for_config(cfg, run_id=2)
    assert {p: p.read_bytes() for p in run.path.rglob("*") if p.is_file()} == before  # nothing lost
    (tmp_path / "empty").mkdir()  # an empty folder (made by hand) is fine
    failed = RunDir.for_config(make_config(outputs_dir=str(tmp_path), run_name="failed"), 4)
    write_json(failed.path / "config.json", {})  # a run that failed in setup: its name is free again
    assert RunDir.for_config(make_config(outputs_dir=str(tmp_path), run_name="failed"), 5).path == failed.path
    assert RunDir.for_config(make_config(outputs_dir=str(tmp_path), run_name="empty"), 3).path.name == "empty"


def test_resume_checks_the_config_and_names_what_changed(tmp_path):
    cfg = make_config(outputs_dir=str(tmp_path), run_name="r1")
    run = RunDir.for_config(cfg, run_id=1)
    write_json(run.path / "config.json", cfg.to_flat())
    ok = make_config(resume_from=str(run.path), num_server_rounds=20, train__device="cpu")
    assert RunDir.for_config(ok, 2).path == run.path  # longer, elsewhere: the same computation
    bad = make_config(resume_from=str(run.path), train__lr=0.5, seed=8)
    with pytest.raises(ValueError, match=r"seed: 7 -> 8; train.lr: 0.05 -> 0.5"):
        RunDir.for_config(bad, 2)


def test_a_run_written_before_a_key_existed_resumes_at_the_value_it_computed_with(tmp_path):
    cfg = make_config(outputs_dir=str(tmp_path), run_name="old")
    run = RunDir.for_config(cfg, run_id=1)
    flat = cfg.to_flat()
    del flat["dataset.val-fraction"]  # config.json of a version that held out a fixed 10%
    write_json(run.path / "config.json", flat)
    assert RunDir.for_config(make_config(resume_from=str(run.path)), 2).path == run.path
    with pytest.raises(ValueError, match=r"dataset.val-fraction: 0.1 -> 0.0"):
        RunDir.for_config(make_config(resume_from=str(run.path), dataset__val_fraction=0.0), 2)


def test_outputs_dir_that_is_a_file_is_named(tmp_path):
    from feddifrc_app.config import ConfigError

    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="'outputs-dir' = '.*f' is invalid: .*f exists and is not a folder"):
        make_config(outputs_dir=str(tmp_path / "f"), run_name="r")
    # A folder under a file can never be created: refused at load too (issue 45 case 6), not later.
    with pytest.raises(ConfigError, match="'outputs-dir' = '.*f/sub' is invalid: .*f is a file, so no"):
        make_config(outputs_dir=str(tmp_path / "f" / "sub"), run_name="r")


def test_a_run_refuses_a_lock_file_that_links_elsewhere_and_leaves_its_target_intact(tmp_path):
    """Issue 33 case 3, its recipe: a run named 'victim' whose folder holds ``.lock`` -> someone's file."""
    from feddifrc_app.files import NotALockFile

    (tmp_path / "outs" / "victim").mkdir(parents=True)
    (tmp_path / "precious.txt").write_text("precious\n")
    (tmp_path / "outs" / "victim" / ".lock").symlink_to(tmp_path / "precious.txt")
    cfg = make_config(outputs_dir=str(tmp_path / "outs"), run_name="victim")
    lock = tmp_path / "outs" / "victim" / ".lock"
    with pytest.raises(NotALockFile, match=f"^{lock} is a symbolic link, not a lock file; refusing"):
        RunDir.for_config(cfg, 1)
    assert (tmp_path / "precious.txt").read_text() == "precious\n"


def test_partial_writes_of_a_killed_run_are_removed(tmp_path):
    cfg = make_config(outputs_dir=str(tmp_path), run_name="r1")
    run = RunDir.for_config(cfg, 1)
    write_json(run.path / "config.json", cfg.to_flat())
    (run.path / ".results.json.tmp-123-abc").write_text("{half")
    (run.ckpt_dir / ".round-0002.pt.tmp-123-abc").write_bytes(b"half")
    RunDir.for_config(make_config(resume_from=str(run.path)), 2)
    assert not list(run.path.rglob(".*tmp-*"))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol 4")  # the crafted file's own protocol
def test_checkpoints_load_weights_only_and_never_run_code(tmp_path):
    import hashlib
    import pickle

    run = RunDir.for_config(make_config(outputs_dir=str(tmp_path), run_name="r"), 1)
    run.save_checkpoint(1, {"round": 1, "model": {"w": torch.ones(2)}})
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    data = pickle.dumps({"round": 2, "model": Evil()})
    run.checkpoint_path(2).write_bytes(data)
    (run.ckpt_dir / "round-0002.pt.sha256").write_text(
        hashlib.sha256(data).hexdigest()
    )  # even with a valid digest
    rnd, payload = run.load_last_checkpoint()
    assert rnd == 1 and not marker.exists()
    # A flipped byte is caught by the digest, not by luck in the unpickler.
    raw = bytearray(run.checkpoint_path(1).read_bytes())
    raw[len(raw) // 2] ^= 1
    run.checkpoint_path(1).write_bytes(bytes(raw))
    assert run.load_last_checkpoint() is None


def test_results_json_is_strict_json_and_readable_by_others(tmp_path):
    run = RunDir.for_config(make_config(outputs_dir=str(tmp_path), run_name="r"), 1)
    old = os.umask(0o022)
    try:
        run.save_results(
            Results.from_json(
                {
                    "rounds": [{"round": 1, "test-accuracy": 0.1, "test-loss": float("nan")}],
                    "x": [float("inf")],
                }
            )
        )
    finally:
        os.umask(old)
    text = run.results_path.read_text()
    assert json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard {c}"))["x"] == [None]
    assert (run.results_path.stat().st_mode & 0o777) == 0o644  # a Docker bind mount's host user can read it


def test_corrupt_results_json_is_named_on_resume(tmp_path):
    run = RunDir.for_config(make_config(outputs_dir=str(tmp_path), run_name="r"), 1)
    run.results_path.write_text("{half")
    with pytest.raises(ValueError, match="results.json is not valid JSON"):
        run.load_results()


def test_a_resume_without_results_json_is_refused_not_a_new_history(tmp_path) -> None:
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    with pytest.raises(
        FileNotFoundError, match=r"results.json is missing or holds no rounds, so the history"
    ):
        run.resumed_results(3)
    run.results_path.write_text('{"status": "stopped"}')  # no rounds: nothing to continue
    with pytest.raises(FileNotFoundError, match="rounds 0..3 would be lost"):
        run.resumed_results(3)
    run.results_path.write_text('{"status": "stopped", "rounds": [{"round": 0}], "resumed": []}')
    assert run.resumed_results(3).rounds == [RoundRow(0)]


def test_a_resume_continues_the_results_after_the_checkpoints_round(tmp_path):
    run = RunDir.for_config(make_config(outputs_dir=str(tmp_path), run_name="r"), 1)
    rows = [RoundRow(r, test_accuracy=0.1 * r) for r in range(4)]  # round 3 saved, its checkpoint not
    run.save_results(Results(rounds=rows, resumed=[], status="failed", diverged_rounds=[1, 3], error="E: x"))
    run.save_checkpoint(2, {"round": 2, "model": {"w": torch.ones(1)}})
    fresh, none = run.begin(make_config(outputs_dir=str(tmp_path), run_name="r"), 1)
    assert none is None and (fresh.rounds, fresh.resumed, fresh.method) == ([], [], "feddifrc")
    results, checkpoint = RunDir(run.path).begin(make_config(resume_from=str(run.path)), 9)
    assert checkpoint["round"] == 2 and [r.round for r in results.rounds] == [0, 1, 2]
    assert (results.diverged_rounds, results.resumed, results.error) == (
        [1],
        [{"after-round": 2, "run-id": 9}],
        None,
    )


def test_plots_are_png(tmp_path):
    results = Results.from_json(
        {
            "method": "feddifrc",
            "strategy": "fedavg",
            "dataset": "digits",
            "teacher": {"random-weights": True},
            "rounds": [
                {"round": 0, "test-accuracy": 0.1, "test-loss": 2.3},
                {
                    "round": 1,
                    "test-accuracy": 0.6,
                    "test-loss": 1.2,
                    "failures": [],
                    "train-metrics": {"train-ce": 1.5},
                },
            ],
            "summary": summarize([RoundRow(1, test_accuracy=0.6)]),
        }
    )
    plot_accuracy(results, tmp_path / "acc.png")
    plot_label_distribution(np.array([[3, 0], [1, 2]]), ["a", "b"], tmp_path / "dist.png", "t")
    for p in ("acc.png", "dist.png"):
        assert (tmp_path / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = format_table(results)
    assert "0.6000" in table and "1.5000" in table and "final 60.00%" in table


def test_a_checkpoint_is_the_round_its_name_says_with_a_model(tmp_path, caplog):
    run = RunDir.for_config(make_config(outputs_dir=str(tmp_path), run_name="r"), 1)
    run.save_checkpoint(1, {"round": 1, "model": {"w": torch.ones(2)}})
    run.save_checkpoint(2, {"model": {"w": torch.ones(2)}})  # digest matches, no round
    with caplog.at_level("WARNING"):
        assert run.load_last_checkpoint()[0] == 1
    assert f"checkpoint {run.checkpoint_path(2)} is not loaded (it says round None, its name round 2)" in (
        caplog.text
    )
    run.save_checkpoint(3, {"round": 9, "model": {"w": torch.ones(2)}})  # would resume at round 9
    run.save_checkpoint(4, {"round": 4, "model": "not a state"})
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert run.load_last_checkpoint()[0] == 1
    assert "it says round 9, its name round 3" in caplog.text and "it holds no model state" in caplog.text
