"""Folder ownership (issue 20): a run or sweep folder belongs to one live process; Ctrl-C on a
sweep stops its Flower run. No Flower process is started here."""

from __future__ import annotations

import json
import signal
import subprocess

import pytest
from conftest import ROOT, make_config

from feddifrc_app.files import FolderInUse, folder_holder, lock_folder, release_folder
from feddifrc_app.tools import cli
from feddifrc_app.tools.run_config import app_defaults


def test_a_folder_is_owned_by_one_live_process_and_freed_when_it_dies(tmp_path, holder):
    folder = tmp_path / "f"
    p = holder(folder)
    who = folder_holder(folder)
    assert who is not None and who.startswith(f"pid {p.pid} on ") and "(a test holder," in who
    with pytest.raises(FolderInUse, match=f"{folder} is in use by pid {p.pid} on "):
        lock_folder(folder, "me")
    p.send_signal(signal.SIGKILL)  # however it dies, the kernel drops its lock
    p.wait()
    assert folder_holder(folder) is None
    lock_folder(folder, "me")
    lock_folder(folder, "me")  # re-entrant in one process
    assert folder_holder(folder) is None  # this process's own lock does not block it
    release_folder(folder)


def test_a_live_run_directory_cannot_be_started_resumed_or_deleted(tmp_path, holder):
    from feddifrc_app.outputs import RunDir
    from feddifrc_app.tools.sweep import Cell, Sweep, SweepError

    cfg = make_config(outputs_dir=str(tmp_path / "runs"), run_name="defaults-s0")
    run_dir = tmp_path / "runs" / "defaults-s0"
    p = holder(run_dir)
    (run_dir / "config.json").write_text(json.dumps(cfg.to_flat()))
    for c in (cfg, make_config(resume_from=str(run_dir))):
        with pytest.raises(FolderInUse, match=f"run directory {run_dir} is in use by pid {p.pid} on "):
            RunDir.for_config(c, 1)
    # The sweep neither deletes nor resumes into it.
    sweep = Sweep(tmp_path, ROOT, app_defaults(ROOT), {})
    sweep.runs = tmp_path / "runs"
    with pytest.raises(SweepError, match=f"{run_dir} is in use by pid {p.pid} on .*flwr stop"):
        sweep.submit_file(Cell("", 0))
    assert (run_dir / "config.json").is_file()
    # The run directory lock file is not "another run" once its owner is gone.
    p.kill()
    p.wait()
    (run_dir / "config.json").unlink()
    assert RunDir.for_config(cfg, 1).path == run_dir


def test_one_sweep_per_out_folder(tmp_path, holder, capsys):
    p = holder(tmp_path / "sw")
    assert cli.main(["sweep", "--app", str(ROOT), "--out", str(tmp_path / "sw")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"feddifrc sweep: error: sweep folder {tmp_path / 'sw'} is in use by pid {p.pid}")
    assert err.rstrip().endswith("one sweep per --out") and err.count("\n") == 1


def test_status_tells_a_dead_running_run_from_a_live_one(tmp_path, holder, capsys):
    run_dir = tmp_path / "r"
    p = holder(run_dir)
    (run_dir / "results.json").write_text(
        json.dumps({"status": "running", "rounds": [], "process": {"pid": p.pid, "host": "h"}})
    )
    assert cli.main(["status", "--outputs-dir", str(tmp_path)]) == 0
    assert f"running (pid {p.pid} on " in capsys.readouterr().out
    p.kill()
    p.wait()
    assert cli.main(["status", "--outputs-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"DEAD: results.json says running but no process holds the folder (last pid {p.pid} on h)" in out


def test_ctrl_c_stops_the_cells_flower_run_before_the_sweep_exits(tmp_path, monkeypatch):
    from feddifrc_app.tools import sweep as sw

    calls: list[list[str]] = []

    def fake_json(self, *args, timeout=300):
        calls.append(["flwr", *args])
        if args[0] == "run":
            return {"success": True, "run-id": 42}
        return {"runs": [{"status": "finished:stopped"}]}

    def fake_run(argv, **kw):
        calls.append(list(argv))
        if argv[1] == "log":
            raise KeyboardInterrupt  # Ctrl-C while the run streams
        return subprocess.CompletedProcess(argv, 0, b"", b"")

    monkeypatch.setattr(sw.Flower, "json", fake_json)
    monkeypatch.setattr(sw.subprocess, "run", fake_run)
    flower = sw.Flower(ROOT, tmp_path / "home", "local", "")
    sweep = sw.Sweep(tmp_path / "sw", ROOT, app_defaults(ROOT), {})
    cell = sw.Cell("", 0)
    with pytest.raises(KeyboardInterrupt):
        sw.run_sweep(sweep, [cell], flower, 100)
    stop = calls.index(["flwr", "stop", "42", "local"])
    assert calls.index(["flwr", "ls", "local", "--run-id", "42"]) > stop  # waited for it to finish
    state = json.loads((tmp_path / "sw" / "sweep.json").read_text())["cells"][cell.name]
    assert state["status"] == "stopped" and "rerun the sweep to resume" in state["reason"]
