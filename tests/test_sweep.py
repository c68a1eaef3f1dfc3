"""`feddifrc sweep` and `feddifrc table`: cells, run configs, resume, the table, one real sweep."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest
from conftest import ROOT
from simulation_runs import FED

from feddifrc_app.config import ConfigError
from feddifrc_app.tools import cli, cmd_sweep
from feddifrc_app.tools.cmd_common import CLIError
from feddifrc_app.tools.report import write_sweep_table
from feddifrc_app.tools.run_config import app_defaults
from feddifrc_app.tools.sweep import Cell, Flower, Sweep, SweepError, _processes_of, make_cells, run_sweep


def sweep_in(tmp_path: Path, **overrides) -> Sweep:
    return Sweep(tmp_path / "sw", ROOT, app_defaults(ROOT), overrides)


def test_cells_are_confs_x_grid_x_seeds_with_the_paper_number():
    confs = [str(ROOT / "conf" / "cifar10-nid1-a0.05-moon.toml"), str(ROOT / "conf" / "mnist5k-fedavg.toml")]
    cells = make_cells(confs, [0, 1], {"partition.alpha": [0.05, 0.5]})
    assert len(cells) == 8 and len({c.name for c in cells}) == 8
    assert cells[0].name == "cifar10-nid1-a0.05-moon-alpha0.05-s0" and cells[0].paper == 80.79
    assert cells[-1].name == "mnist5k-fedavg-alpha0.5-s1" and cells[-1].paper is None


def test_cell_run_config_round_trips_through_flowers_parser(tmp_path):
    from flwr.common.config import parse_config_args

    sweep = sweep_in(tmp_path, **{"num-server-rounds": 3})
    cell = Cell(str(ROOT / "conf" / "mnist5k-moon.toml"), 1, {"partition.alpha": 0.05})
    path = sweep.submit_file(cell)
    flat = parse_config_args([str(path)])
    assert flat == {
        "method": "moon",
        "moon.mu": 1.0,
        "moon.tau": 0.5,
        "num-server-rounds": 3,
        "partition.alpha": 0.05,
        "seed": 1,
        "outputs-dir": str(tmp_path / "sw" / "runs"),
        "run-name": "mnist5k-moon-alpha0.05-s1",
    }


def test_every_cell_is_validated_before_any_run(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("train.lr = -1.0\n")
    sweep = sweep_in(tmp_path)
    with pytest.raises(ConfigError, match="'train.lr' = -1.0"):
        sweep.validate(make_cells([str(ROOT / "conf" / "mnist5k-fedavg.toml"), str(bad)], [0], {}))


def test_an_interrupted_cell_resumes_and_an_unstarted_one_starts_over(tmp_path):
    sweep = sweep_in(tmp_path)
    cell = Cell("", 0)
    ckpt = sweep.runs / cell.name / "checkpoints"
    ckpt.mkdir(parents=True)
    (ckpt / "round-0002.pt.sha256").write_text("x")
    assert f"resume-from = {json.dumps(str(sweep.runs / cell.name))}" in sweep.submit_file(cell).read_text()
    (ckpt / "round-0002.pt.sha256").unlink()
    assert "resume-from" not in sweep.submit_file(cell).read_text()
    assert not (sweep.runs / cell.name).exists()  # no finished round: removed, so the run starts clean


def test_a_finished_cell_from_before_a_key_existed_is_done_unless_the_cell_asks_another_value(tmp_path):
    """config_changes.KEYS_ADDED_SINCE: a run folder predating a key computed with that key's listed value."""
    sweep = sweep_in(tmp_path, **{"num-server-rounds": 2})
    cell = Cell("", 0)
    run = sweep.runs / cell.name
    run.mkdir(parents=True)
    old = sweep.validate([cell])[cell.name].to_flat()
    del old["diffusion.dit-features"], old["loss.tdcl-targets"]
    (run / "config.json").write_text(json.dumps(old))
    rounds = [{"round": r, "test-accuracy": 0.5} for r in range(3)]
    summary = {"final-accuracy": 0.5, "best-accuracy": 0.5, "mean-last-5-accuracy": 0.5}
    results = {"rounds": rounds, "summary": summary, "status": "completed"}
    (run / "results.json").write_text(json.dumps(results))
    cfg = sweep.validate([cell])[cell.name]
    assert sweep.stale(cell, cfg) == ""
    assert sweep.finished(cell, cfg).summary["final-accuracy"] == 0.5

    adaln = sweep_in(tmp_path / "b", **{"num-server-rounds": 2, "diffusion.dit-features": "adaln"})
    adaln.runs.mkdir(parents=True)
    (adaln.runs / cell.name).symlink_to(run)
    cfg = adaln.validate([cell])[cell.name]
    assert "diffusion.dit-features: 'raw' -> 'adaln'" in adaln.stale(cell, cfg)
    assert adaln.finished(cell, cfg) is None


def test_a_resumed_sweep_reuses_cells_written_before_loss_ndcr_view(tmp_path, capsys):
    """A cell written before e53e94c lacks loss.ndcr-view and every key added since (an older
    sweep folder): rerunning the sweep reuses it, runs nothing, and its table shows it."""
    sweep = sweep_in(tmp_path, **{"num-server-rounds": 2})
    cell = Cell("", 0)
    flat = sweep.validate([cell])[cell.name].to_flat()
    since = {"loss.ndcr-view", "dataset.eval-limit", "dataset.val-fraction", "evaluate-holdout", "strategy.q"}
    since |= {
        "loss.tdcl-targets",
        "fednh.max-grad-norm",
        "strategy.num-malicious-nodes",
        "strategy.num-nodes-to-select",
    }
    since |= {
        k for k in flat if k.startswith(("strategy.dp", "diffusion.pool", "diffusion.dit", "tracking."))
    }
    since |= {"server.device", "max-frozen-rounds", "min-nodes-timeout", "strategy.setup-timeout"}
    old = {k: v for k, v in flat.items() if k not in since}
    sweep.runs.joinpath(cell.name).mkdir(parents=True)
    (sweep.runs / cell.name / "config.json").write_text(json.dumps(old))
    rounds = [{"round": r, "test-accuracy": 0.5 + r / 10} for r in range(3)]
    summary = {"final-accuracy": 0.7, "best-accuracy": 0.7, "mean-last-5-accuracy": 0.65}
    results = {"rounds": rounds, "summary": summary, "status": "completed"}
    (sweep.runs / cell.name / "results.json").write_text(json.dumps(results))
    sweep.record(cell, status="completed", reason="")

    class NoFlower:
        def run(self, *_a):
            raise AssertionError("a reused cell must not run again")

    assert run_sweep(sweep, [cell], NoFlower(), 60) == {}
    assert "1 cells, 1 already done, 0 to run" in capsys.readouterr().out
    assert json.loads(sweep.state_path.read_text())["cells"][cell.name]["status"] == "completed"
    assert "| defaults | 70.00 ± 0.00 / 70.00 ± 0.00 / 65.00 ± 0.00 (n=1) |" in write_sweep_table(sweep.out)
    # The same folder asked for the clean view: the old run used the augmented one.
    clean = sweep_in(tmp_path / "b", **{"num-server-rounds": 2, "loss.ndcr-view": "clean"})
    cfg = clean.validate([cell])[cell.name]
    clean.runs.mkdir(parents=True)
    (clean.runs / cell.name).symlink_to(sweep.runs / cell.name)
    assert "loss.ndcr-view: 'augmented' -> 'clean'" in clean.stale(cell, cfg)


def _fake_cell(out: Path, name: str, conf: str, alpha: float, final: float, best: float, paper=None) -> dict:
    run = out / "runs" / name
    run.mkdir(parents=True)
    rounds = [
        {"round": 0, "test-accuracy": 0.1},
        {"round": 1, "test-accuracy": best},
        {"round": 2, "test-accuracy": final},
    ]
    summary = {"final-accuracy": final, "best-accuracy": best, "mean-last-5-accuracy": (best + final) / 2}
    (run / "results.json").write_text(
        json.dumps({"rounds": rounds, "summary": summary, "status": "completed"})
    )
    config = {
        "dataset.name": "mnist-5k",
        "partition.name": "dirichlet",
        "partition.alpha": alpha,
        "num-server-rounds": 2,
    }
    (run / "config.json").write_text(json.dumps(config))
    return {"conf": conf, "seed": 0, "grid": {}, "paper": paper, "status": "completed", "reason": ""}


def test_table_is_mean_and_std_over_seeds_with_the_paper_number(tmp_path):
    out = tmp_path / "sw"
    cells = {
        "a": _fake_cell(out, "a", "conf/mnist5k-moon.toml", 0.05, 0.50, 0.60, paper=80.79),
        "b": _fake_cell(out, "b", "conf/mnist5k-moon.toml", 0.05, 0.70, 0.80, paper=80.79),
        "c": _fake_cell(out, "c", "conf/cifar10-nid1-a0.05-fedavg.toml", 0.5, 0.40, 0.40),
    }
    cells["d"] = {**cells["c"], "status": "failed"}  # failed cells are not in the table
    (out / "sweep.json").write_text(json.dumps({"cells": cells}))
    md = write_sweep_table(out)
    # moon over 2 seeds: final 60 +- 14.14 (std of 50, 70), best 70 +- 14.14, last-5 65 +- 14.14
    assert "| moon | 60.00 ± 14.14 / 70.00 ± 14.14 / 65.00 ± 14.14 (n=2) (paper 80.79) | – |" in md
    assert "| fedavg | – | 40.00 ± 0.00 / 40.00 ± 0.00 / 40.00 ± 0.00 (n=1) |" in md
    assert md.index("| fedavg") < md.index("| moon")  # the baseline first
    # The paper's number is a max over rounds: the table names which of its three stands beside it.
    assert md.startswith(
        "final / best (max over rounds, the paper's endpoint) / mean of last 5 test accuracy (%), "
        "mean ± std over seeds; (paper X) is the paper's number, the maximum test accuracy over rounds"
    )
    csv_rows = (out / "table.csv").read_text().splitlines()
    assert csv_rows[0].startswith("method,setting,seeds,final") and len(csv_rows) == 3
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"


BASELINES = ("moon", "fednh", "scaffold", "fednova")


@pytest.mark.slow
def test_sweep_of_every_baseline_and_a_diverging_run(tmp_path, capsys, monkeypatch, ray_cluster):
    """One real sweep, which is also each baseline's simulation test and the divergence test:
    every Flower run costs ~25 s of start-up on 2 cores, so each run here serves two purposes."""
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster)  # the runs join the session's Ray cluster
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # on loopback (flower_procs.flower_env)
    diverge = tmp_path / "diverge.toml"
    diverge.write_text('method = "fedavg"\ntrain.lr = 1e6\ntrain.local-epochs = 10\ntrain.batch-size = 5\n')
    confs = [str(ROOT / "conf" / f"mnist5k-{m}.toml") for m in BASELINES]
    out = tmp_path / "sw"
    argv = [
        "sweep",
        *confs,
        str(diverge),
        "--seeds",
        "1",
        "--app",
        str(ROOT),
        "--out",
        str(out),
        "--set",
        "num-server-rounds=2 dataset.train-limit=60 dataset.eval-limit=200 train.batch-size=8",
        "--federation-config",
        FED,
    ]
    assert cli.main(argv) == 1  # a failed cell fails the sweep, after every cell ran
    printed = capsys.readouterr().out
    assert "[5/5]" in printed and "FAILED diverge-s0: finished:failed" in printed
    state = json.loads((out / "sweep.json").read_text())["cells"]

    # Each baseline completed both rounds (round 2: MOON has previous models, SCAFFOLD non-zero c).
    for m in BASELINES:
        assert state[f"mnist5k-{m}-s0"]["status"] == "completed", state[f"mnist5k-{m}-s0"]
        r = json.loads((out / "runs" / f"mnist5k-{m}-s0" / "results.json").read_text())
        last = r["rounds"][-1]
        assert r["status"] == "completed" and last["round"] == 2 and last["failures"] == []
        metrics = last["train-metrics"]
        assert 0.0 <= last["test-accuracy"] <= 1.0 and metrics["train-ce"] > 0 and metrics["local-steps"] >= 2
        if m == "moon":
            assert metrics["train-moon"] > 0
        if m == "fednova":
            assert metrics["fednova-a"] > metrics["local-steps"]  # momentum 0.9: a_i > tau_i
    assert "| moon | " in (out / "table.md").read_text()
    # Each cell's ServerApp log is kept beside its run config.
    cell_log = (out / "cells" / f"mnist5k-{BASELINES[0]}-s0.log").read_text()
    assert f"run directory: {out / 'runs' / f'mnist5k-{BASELINES[0]}-s0'}" in cell_log, cell_log[-3000:]

    # The diverged run: reported failed by flwr ls, strict JSON, the last finite model kept.
    assert "diverged" in state["diverge-s0"]["reason"]
    text = (out / "runs" / "diverge-s0" / "results.json").read_text()
    r = json.loads(text, parse_constant=lambda c: pytest.fail(f"results.json holds {c}"))
    assert r["status"] == "diverged" and r["diverged-rounds"] == [1, 2]
    assert all("diverged:" in f["reason"] for row in r["rounds"][1:] for f in row["failures"])
    assert {row["test-accuracy"] for row in r["rounds"]} == {r["rounds"][0]["test-accuracy"]}

    # Again, without the failing conf: every cell is done and nothing runs.
    argv.remove(str(diverge))
    assert cli.main(argv) == 0
    assert "4 cells, 4 already done, 0 to run" in capsys.readouterr().out

    # A ghost: a run submitted to this folder's SuperLink, which then went down without stopping
    # it; its state (<FLWR_HOME>/local-superlink/state.db) keeps the run unfinished, and the next
    # SuperLink on this folder would launch it beside a new cell's run. The next sweep stops it.
    ghost = tmp_path / "ghost.toml"
    ghost.write_text(
        f'method = "fedavg"\nnum-server-rounds = 1000\ndataset.train-limit = 60\nrun-name = "ghost"\n'
        f"outputs-dir = {json.dumps(str(tmp_path / 'ghost-runs'))}\n"
    )
    first = Flower(ROOT, out / "flwr-home", "local", FED)
    submitted = first.json("run", ".", "local", "--run-config", str(ghost), "--federation-config", FED)
    assert submitted["success"], submitted
    # The machine goes down: every process of this folder's Flower dies at once (SIGKILL), so none
    # can record anything about the run, which stays as it was in the state.
    mark = f"FLWR_HOME={first.home}".encode()
    for pid in _processes_of(mark, set()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 300  # a hang guard: SIGKILL'd processes end at once
    while _processes_of(mark, set()) and time.monotonic() < deadline:
        time.sleep(0.5)
    second = Flower(ROOT, out / "flwr-home", "local", FED)
    try:
        assert second.stop_leftovers() == [str(submitted["run-id"])]
        runs = second.json("ls", "local", "--run-id", str(submitted["run-id"]))["runs"]
        assert runs[0]["status"] == "finished:stopped", runs
        assert second.stop_leftovers() == []  # nothing left
    finally:
        second.close()
        first.close()


def test_table_of_a_sweep_with_no_finished_cell_says_so(tmp_path):
    (tmp_path / "sweep.json").write_text(json.dumps({"cells": {"a": {"conf": "", "status": "failed"}}}))
    assert write_sweep_table(tmp_path) == (
        "no cell of this sweep has completed yet\nskipped a: sweep.json status 'failed'\n"
    )


def test_method_labels_drop_setting_tags_and_keep_other_grid_values():
    from feddifrc_app.tools.report import method_label

    assert method_label("conf/cifar10-nid1-a0.05-feddifrc-block-2-only.toml", {}) == "feddifrc-block-2-only"
    assert method_label("conf/cifar10-nid2-moon.toml", {}) == "moon"
    grid = {"partition.alpha": 0.05, "diffusion.model": "/runs/tiny-mnist-untrained"}
    assert method_label("conf/mnist5k-feddifrc.toml", grid) == "feddifrc [model=tiny-mnist-untrained]"


@pytest.mark.parametrize("key", ["seed", "outputs-dir", "run-name", "resume-from"])
def test_keys_the_sweep_sets_are_refused_in_grid_set_and_conf_files(tmp_path, key, capsys):
    with pytest.raises(SweepError, match=f"--grid: key '{key}' is set by the sweep"):
        make_cells([], [0], {key: ["1", "2"]})
    with pytest.raises(SweepError, match=f"--set: key '{key}' is set by the sweep"):
        sweep_in(tmp_path, **{key: "x"})
    conf = tmp_path / "c.toml"
    conf.write_text(f'{key} = "x"\n')
    with pytest.raises(SweepError, match=f"{conf}: key '{key}' is set by the sweep"):
        sweep_in(tmp_path).validate(make_cells([str(conf)], [0], {}))
    # From the command line: one line, exit 2, before any Flower process starts.
    value = "1,2" if key == "seed" else "'a','b'"
    argv = ["sweep", "--app", str(ROOT), "--out", str(tmp_path / "sw"), "--grid", f"{key}={value}"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(f"feddifrc sweep: error: --grid: key '{key}' is set by the sweep")
        and err.count("\n") == 1
    )
    if key == "seed":
        assert "use --seeds N" in err
    assert not (tmp_path / "sw" / "flwr-home").exists()


def test_sweep_out_that_is_a_file_or_holds_a_corrupt_sweep_json_is_one_line(tmp_path, capsys):
    f = tmp_path / "f"
    f.write_text("x")
    assert cli.main(["sweep", "--app", str(ROOT), "--out", str(f)]) == 2
    err = capsys.readouterr().err
    assert err == f"feddifrc sweep: error: --out {f} is a file; pass a folder for the sweep " + (
        "(new, or an earlier sweep's)\n"
    )
    assert f.read_text() == "x"
    assert cli.main(["sweep", "--app", str(ROOT), "--out", str(f / "sub")]) == 2
    err = capsys.readouterr().err
    assert err == f"feddifrc sweep: error: --out {f / 'sub'}: {f} is a file, so no folder can be " + (
        "created under it\n"
    )
    (tmp_path / "sw").mkdir()
    (tmp_path / "sw" / "sweep.json").write_text('{"cells": {"a"')
    with pytest.raises(SweepError, match=f"{tmp_path / 'sw' / 'sweep.json'} is unreadable"):
        sweep_in(tmp_path)
    assert cli.main(["table", str(tmp_path / "sw")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("feddifrc table: error: ") and str(tmp_path / "sw" / "sweep.json") in err
    assert err.count("\n") == 1


def test_a_folder_in_place_of_sweep_json_is_refused_before_any_run(tmp_path, capsys):
    """Issue 45 case 9: the sweep ran its first cell, then crashed writing sweep.json."""
    (tmp_path / "sw" / "sweep.json").mkdir(parents=True)
    with pytest.raises(SweepError, match=r"sweep.json is not a file \(a folder\?\); .* move it aside"):
        sweep_in(tmp_path)
    assert cli.main(["table", str(tmp_path / "sw")]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"feddifrc table: error: {tmp_path / 'sw' / 'sweep.json'} is not a file (a folder?); move it "
        "aside and rerun the sweep\n"
    )


def test_closing_the_local_federation_stops_what_its_flwr_commands_started_and_nothing_else(tmp_path):
    """Issue 45: after an interrupted sweep, two Ray agents of its simulation (children of a gone
    raylet, so no SuperLink's descendants) lived on for minutes; close() now stops every process
    started with the sweep's own FLWR_HOME, and no other."""
    import os
    import subprocess
    import sys

    flower = Flower(ROOT, tmp_path / "home", "local", "")
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    ours = subprocess.Popen(sleeper, env=flower.env)
    other = subprocess.Popen(sleeper, env={**os.environ, "FLWR_HOME": str(tmp_path / "home2")})
    try:
        flower.close(grace=0)
        assert ours.wait(timeout=10) == -15  # SIGTERM
        assert other.poll() is None
    finally:
        for p in (ours, other):
            p.kill()
            p.wait()


def test_closing_the_local_federation_stops_its_superlinks_session_and_no_other(tmp_path):
    """`flwr` starts the local SuperLink in a session of its own; its simulation's processes share
    it whatever their environment. close() stops the SuperLink (found by its --log-file in our
    FLWR_HOME), then every process in its session, never another session's."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from flower_procs import _exists

    flower = Flower(ROOT, tmp_path / "home", "local", "")
    fake = tmp_path / "bin" / "flower-superlink"  # our SuperLink, spelled as flwr starts it
    fake.parent.mkdir()
    fake.write_text(
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], env={})\n"
        "open(sys.argv[-1], 'w').write(str(child.pid))\n"
        "time.sleep(600)\n"
    )
    pidfile = tmp_path / "child.pid"
    argv = [sys.executable, str(fake), "--log-file", str(flower.home / "superlink.log"), str(pidfile)]
    link = subprocess.Popen(argv, start_new_session=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        while not pidfile.exists() or not pidfile.read_text():
            assert link.poll() is None, "the stand-in SuperLink died before starting its child"
            time.sleep(0.1)
        child = int(pidfile.read_text())
        assert b"FLWR_HOME" not in Path(f"/proc/{child}/environ").read_bytes()  # found by session only
        flower.close(grace=0)
        assert link.wait(timeout=30) == -signal.SIGTERM
        deadline = time.monotonic() + 60  # SIGTERM'd: gone at once; 60 s only bounds a failure
        while _exists(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _exists(child), "the SuperLink's session outlived close()"
        assert other.poll() is None
    finally:
        for p in (link, other):
            p.kill()
            p.wait()
        if pidfile.exists() and pidfile.read_text() and _exists(int(pidfile.read_text())):
            os.kill(int(pidfile.read_text()), signal.SIGKILL)


def test_sigterm_inside_exit_on_termination_is_a_system_exit_and_the_handlers_come_back():
    import os
    import signal

    from feddifrc_app.tools.cmd_common import exit_on_termination, termination_held

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as e, exit_on_termination():
        os.kill(os.getpid(), signal.SIGTERM)
    assert e.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before

    # A cleanup holds the signal: it runs to its end, then the signal ends the program.
    steps = []
    with pytest.raises(SystemExit) as e, exit_on_termination():
        with termination_held():
            os.kill(os.getpid(), signal.SIGTERM)
            steps.append("cleaned up")
        steps.append("not reached")
    assert steps == ["cleaned up"] and e.value.code == 128 + signal.SIGTERM


def test_table_uses_only_completed_runs_of_the_configured_rounds_and_names_each_skipped_cell(tmp_path):
    out = tmp_path / "sw"
    conf = "conf/mnist5k-moon.toml"
    cells = {n: _fake_cell(out, n, conf, 0.05, 0.5, 0.6) for n in ("ok", "running", "short", "bad", "nocfg")}
    cells["flagged"] = {**_fake_cell(out, "flagged", conf, 0.05, 0.9, 0.9), "status": "failed"}
    cells["gone"] = dict(cells["ok"])  # sweep.json lists it, its run folder is missing
    r = json.loads((out / "runs" / "running" / "results.json").read_text())
    (out / "runs" / "running" / "results.json").write_text(json.dumps({**r, "status": "running"}))
    (out / "runs" / "short" / "results.json").write_text(json.dumps({**r, "rounds": r["rounds"][:2]}))
    (out / "runs" / "bad" / "results.json").write_text('{"rounds": [')
    (out / "runs" / "nocfg" / "config.json").unlink()
    (out / "sweep.json").write_text(json.dumps({"cells": cells}))
    md = write_sweep_table(out)
    assert "| moon | 50.00 ± 0.00 / 60.00 ± 0.00 / 55.00 ± 0.00 (n=1) |" in md  # "ok" alone
    runs = out / "runs"
    assert "skipped running: results.json status is 'running', not 'completed'" in md
    assert "skipped short: results.json ends at round 1, the config asks for 2" in md
    assert f"skipped bad: {runs / 'bad' / 'results.json'} is unreadable (JSONDecodeError" in md
    assert f"skipped nocfg: no config.json ({runs / 'nocfg' / 'config.json'})" in md
    assert "skipped flagged: sweep.json status 'failed'" in md
    assert f"skipped gone: no config.json ({runs / 'gone' / 'config.json'})" in md
    assert md.count("skipped ") == 6 and md == (out / "table.md").read_text()
    assert len((out / "table.csv").read_text().splitlines()) == 2


def test_cells_that_would_share_a_run_folder_are_refused(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for d in ("a", "b"):
        (tmp_path / d / "x.toml").write_text('method = "fedavg"\n')
    a, b = str(tmp_path / "a" / "x.toml"), str(tmp_path / "b" / "x.toml")
    with pytest.raises(
        SweepError, match=f"conf files {a} and {b} give cells the same name 'x-s0'.*rename one"
    ):
        make_cells([a, b], [0], {})
    with pytest.raises(SweepError, match="cell 'x-alpha0.5-s0' is asked for twice"):
        make_cells([a], [0], {"partition.alpha": [0.5, 0.5]})


def test_an_unquoted_string_in_grid_says_how_to_quote_it():
    with pytest.raises(CLIError) as e:
        cmd_sweep._grid(["method=fedavg,moon"])
    assert str(e.value) == (
        "--grid 'method=fedavg,moon': quote string values (TOML: a number, true/false, or a quoted "
        """string), inside the shell's quotes: --grid "method='fedavg','moon'\""""
    )
    assert cmd_sweep._grid(["method='fedavg','moon'"]) == {"method": ["fedavg", "moon"]}


def test_a_simulation_without_enough_supernodes_is_refused_before_any_run(tmp_path, capsys):
    base = ["sweep", "--app", str(ROOT), "--out", str(tmp_path / "sw")]
    assert cli.main([*base, "--federation-config", "num-supernodes=0"]) == 2
    assert "num-supernodes = 0: expected an integer >= 1" in capsys.readouterr().err
    argv = [*base, "--set", "min-nodes=3", "--federation-config", "num-supernodes=2"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "cell defaults-s0: min-nodes = 3 but --federation-config starts num-supernodes = 2" in err
    assert err.count("\n") == 1 and not (tmp_path / "sw" / "flwr-home").exists()


def test_a_deployed_federation_is_reached_through_the_users_flower_config(tmp_path, monkeypatch):
    """`--federation lab` uses the user's FLWR_HOME (where `lab` and its credentials live), not the
    sweep's own: real `flwr ls` gets as far as connecting (a closed loopback port), where the sweep's
    home would have said "'lab' not found". The local simulation keeps its own home and ports."""
    user = tmp_path / "user-flwr"
    user.mkdir()
    (user / "config.toml").write_text(
        '[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\n\n'
        '[superlink.lab]\naddress = "127.0.0.1:9"\ninsecure = true\n'
    )
    monkeypatch.setenv("FLWR_HOME", str(user))
    local = Flower(ROOT, tmp_path / "sweep-home", "local", "")
    assert local.env["FLWR_HOME"] == str(tmp_path / "sweep-home")
    assert "FLWR_LOCAL_CONTROL_API_PORT" in local.env
    lab = Flower(ROOT, tmp_path / "sweep-home-2", "lab", "")
    assert lab.env["FLWR_HOME"] == str(user) and "FLWR_LOCAL_CONTROL_API_PORT" not in lab.env
    assert not (tmp_path / "sweep-home-2").exists()
    ans = lab.json("ls", "lab", timeout=600)  # a hang guard only
    assert ans["success"] is False
    assert "unavailable" in ans["error-message"] and "not found" not in ans["error-message"]


def test_a_local_superlink_that_did_not_start_in_time_is_asked_for_again_then_the_cell_fails(
    tmp_path, monkeypatch, capsys
):
    """`flwr run` gives the local SuperLink it starts 15 s; on a loaded machine that can pass with no
    run submitted, so the sweep asks again (LOCAL_START_TRIES in all) before failing the cell. Any
    other refusal fails the cell at once."""
    from feddifrc_app.tools import sweep as sw

    late = {"success": False, "error-message": "Failed to start local SuperLink within 15s. See logs"}
    answers = [late, late, {"success": False, "error-message": "run config refused"}]
    flower = Flower(ROOT, tmp_path / "home", "local", "")
    asked = []

    def json_of(*args, timeout=300):
        asked.append(args[0])
        return answers.pop(0)

    monkeypatch.setattr(flower, "json", json_of)
    status, why = flower.run(tmp_path / "cell.toml", timeout=60)
    assert (status, asked) == ("submit-failed", ["run"] * 3) and "run config refused" in why
    assert capsys.readouterr().out.count("did not start within flwr's 15 s; trying again") == 2
    answers[:] = [late] * sw.LOCAL_START_TRIES + [{"success": True, "run-id": 1}]
    asked.clear()
    status, why = flower.run(tmp_path / "cell.toml", timeout=60)
    assert status == "submit-failed" and asked == ["run"] * sw.LOCAL_START_TRIES and "within 15s" in why
    answers[:] = [{"success": False, "error-message": "no such federation"}]
    asked.clear()
    assert flower.run(tmp_path / "cell.toml", timeout=60)[0] == "submit-failed" and asked == ["run"]
