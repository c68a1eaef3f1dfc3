"""`feddifrc report` and `feddifrc status` on folders that are not runs (issue 48): each says what
the folder is instead, in one line, and neither command imports torch to say it (nor to print a
real run's table), checked in a new process."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT
from fakes import fake_run

from feddifrc_app.tools import cli

# Loaded by no `report` without --plots and no `status` (numpy is: files.py reads archives with it).
HEAVY = ("torch", "torchvision", "diffusers", "transformers", "flwr", "datasets", "ray", "matplotlib")

# A new interpreter runs each command line in turn: its exit status, its stderr, and which heavy
# packages are loaded after it (a command that pulls one in is named, since they stay loaded).
PROBE = """
import contextlib, io, json, sys
from feddifrc_app.tools import cli
heavy, out = json.loads(sys.argv[1]), []
for argv in json.loads(sys.argv[2]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = cli.main(argv)
    out.append([rc, err.getvalue(), sorted(h for h in heavy if h in sys.modules)])
print(json.dumps(out))
"""


@pytest.fixture
def folders(tmp_path: Path) -> dict[str, Path]:
    """One of each thing that is not a run, and a runs folder holding one real run ("runs/a")."""
    (tmp_path / "afile").write_text("x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "results.json").write_text("{not json")
    (tmp_path / "setup").mkdir()
    (tmp_path / "setup" / "config.json").write_text('{"num-server-rounds": 3}')
    fake_run(tmp_path / "runs" / "a")
    names = ("missing", "afile", "empty", "corrupt", "setup", "runs")
    return {n: tmp_path / n for n in names}


def _said(capsys: pytest.CaptureFixture[str], prefix: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith(f"{prefix}: error: ") and err.count("\n") == 1, err
    return err


def test_report_says_what_a_folder_that_is_not_a_run_is(folders, capsys) -> None:
    f = folders
    see = "(`feddifrc status --outputs-dir <outputs-dir>` lists the runs)"
    cases = {
        "missing": f"{f['missing']} does not exist; give a run folder, <outputs-dir>/<run-name> {see}",
        "afile": f"{f['afile']} is a file, not a run folder; give a run folder, "
        f"<outputs-dir>/<run-name> {see}",
        "empty": f"{f['empty']} is not a feddifrc run folder: it holds neither results.json nor config.json",
        "corrupt": f"{f['corrupt'] / 'results.json'} is not valid JSON (Expecting property name",
        "setup": f"{f['setup'] / 'results.json'} does not exist yet: its run ended before round 0 was "
        "recorded and no process holds the folder",
        "runs": f"{f['runs']} is a runs folder (1 runs), not a run: `feddifrc report {f['runs'] / 'a'}` "
        f"(its newest), or `feddifrc status --outputs-dir {f['runs']}`",
    }
    for name, said in cases.items():
        assert cli.main(["report", str(f[name])]) == 2, name
        err = _said(capsys, "feddifrc report")
        assert said in err, name
        if name == "setup":
            assert "a new run may reuse the folder (the same outputs-dir and run-name = 'setup')" in err


def test_status_is_not_silent_about_a_missing_folder_and_names_a_run_given_as_outputs_dir(
    folders, capsys
) -> None:
    f = folders
    assert cli.main(["status", "--outputs-dir", str(f["missing"])]) == 2
    assert f"--outputs-dir {f['missing']}: {f['missing']} does not exist (no run has written there yet" in (
        _said(capsys, "feddifrc status")
    )
    assert cli.main(["status", "--outputs-dir", str(f["runs"] / "a")]) == 2
    assert (
        f"{f['runs'] / 'a'} is one run's folder, not a runs folder: `feddifrc report {f['runs'] / 'a'}`"
        in (_said(capsys, "feddifrc status"))
    )
    assert cli.main(["status", "--outputs-dir", str(f["empty"])]) == 0
    assert capsys.readouterr().out == (
        f"no runs under {f['empty']} (no folder in it holds a results.json or config.json)\n"
    )
    # The tmp folder as outputs-dir: the real run, the damaged one, and the one with config.json only.
    assert cli.main(["status", "--outputs-dir", str(f["runs"].parent)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines[:-1]] == ["corrupt", "setup"]
    assert lines[1].startswith("setup: no results.json yet: its run ended before round 0 was recorded")


def test_a_run_still_in_setup_is_named_with_the_process_that_holds_it(tmp_path, holder, capsys) -> None:
    run_dir = tmp_path / "r"
    p = holder(run_dir)  # a ServerApp waiting for its min-nodes holds its folder like this
    (run_dir / "config.json").write_text('{"num-server-rounds": 3}')
    assert cli.main(["report", str(run_dir)]) == 2
    assert (
        f"{run_dir / 'results.json'} does not exist yet: its run is setting up (waiting for min-nodes, "
        f"or before round 0) in pid {p.pid} on "
    ) in _said(capsys, "feddifrc report")
    assert cli.main(["status", "--outputs-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith(
        "r: no results.json yet: its run is setting up (waiting for min-nodes, or before round 0) "
        f"in pid {p.pid} on "
    )


def test_report_and_status_import_no_torch_in_a_new_process(folders) -> None:
    f = folders
    argvs = [["report", str(f[n])] for n in ("missing", "afile", "empty", "setup", "runs", "corrupt")]
    argvs += [["status", "--outputs-dir", str(f["missing"])], ["status", "--outputs-dir", str(f["runs"])]]
    argvs += [["report", str(f["runs"] / "a")]]  # a real run's table reads JSON only
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cp = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(HEAVY), json.dumps(argvs)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    results = json.loads(cp.stdout.splitlines()[-1])
    assert [rc for rc, _, _ in results] == [2] * 7 + [0] * 2
    assert f"feddifrc report: error: {f['missing']} does not exist; give a run folder" in results[0][1]
    assert f"{f['missing']} does not exist (no run has written there yet" in results[6][1]
    assert results[-1][1] == ""
    assert [loaded for _, _, loaded in results] == [[]] * len(argvs), cp.stdout


def test_report_plots_still_draw_after_matplotlib_became_a_lazy_import(folders, capsys) -> None:
    with contextlib.suppress(FileNotFoundError):
        (folders["runs"] / "a" / "accuracy.png").unlink()
    assert cli.main(["report", str(folders["runs"] / "a"), "--plots"]) == 0
    assert (folders["runs"] / "a" / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"accuracy.png: {folders['runs'] / 'a' / 'accuracy.png'}" in capsys.readouterr().out
