"""One line, exit status 2, for the app's own errors: every `feddifrc` command and every
benchmark's command line (issue 45); a damaged teacher folder without feddifrc.json (case 8)."""

from __future__ import annotations

import importlib
import shutil
import sys

import pytest
from conftest import ROOT

from feddifrc_app.tools import cli
from feddifrc_app.tools.cmd_common import APP_ERRORS, is_app_error

sys.path.insert(0, str(ROOT / "benchmarks"))


def one_line(capsys: pytest.CaptureFixture[str], prefix: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith(f"{prefix}: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    ("content", "said"),
    [
        ("{not json", "unet/config.json is unreadable (JSONDecodeError: Expecting property name"),
        ("{}", "unet/config.json has no usable 'up_block_types' (None)"),
    ],
)
def test_a_damaged_unet_config_is_one_line_naming_the_file(tmp_path, capsys, content, said) -> None:
    """Issue 45 case 8: in a teacher folder without feddifrc.json (nothing checksums it) a corrupt
    unet/config.json was a JSONDecodeError or KeyError traceback, and `fetch` said it was fine."""
    from feddifrc_app.diffusion.pipeline import teacher_identity

    folder = tmp_path / "copy"
    shutil.copytree(teacher_identity("tiny-mnist", tmp_path).folder, folder)
    (folder / "feddifrc.json").unlink()  # a plain diffusers folder
    (folder / "unet" / "config.json").write_text(content)
    argv = ["--app", str(ROOT), "--cache-dir", str(tmp_path), "--run-config", f"diffusion.model='{folder}'"]
    for command in (["fetch", "--split", "test"], ["extract", "--check", "--split", "test"]):
        assert cli.main([*command, *argv]) == 2, command
        err = one_line(capsys, f"feddifrc {command[0]}")
        assert f"teacher folder {folder}: {said}" in err, err


def test_fetch_refuses_the_layers_a_node_would_refuse(tmp_path, capsys) -> None:
    """Issue 45 case 8: `fetch` of tiny-sdxl with diffusion.blocks it lacks exited 0."""
    keys = "diffusion.model='tiny-sdxl' diffusion.blocks='3' diffusion.channels='128'"
    argv = ["--app", str(ROOT), "--cache-dir", str(tmp_path), "--split", "test", "--run-config", keys]
    assert cli.main(["fetch", *argv]) == 2
    assert "diffusion.blocks (3,) must be distinct unet.up_blocks indices in 0..2" in one_line(
        capsys, "feddifrc fetch"
    )


def test_every_command_says_an_app_error_in_one_line(tmp_path, capsys) -> None:
    """Each `feddifrc` command meets an error of the app's own (a refused path, a bad flag) and
    says it in one line, exit status 2 (make-tiny, extract and fetch were tracebacks; status
    listed nothing with exit status 0)."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    app = ["--app", str(ROOT)]
    cases = {
        "make-tiny": (["--cache-dir", f"{afile}/c"], f"{afile}/c/models: Not a directory"),
        "extract": ([*app, "--check", "--cache-dir", f"{afile}/c"], f"{afile}/c: Not a directory"),
        "fetch": ([*app, "--split", "test", "--cache-dir", f"{afile}/c"], f"{afile}/c: Not a directory"),
        "probe-teacher": ([*app, "--cache-dir", f"{afile}/c"], f"{afile}/c: Not a directory"),
        "status": (["--outputs-dir", str(afile)], f"--outputs-dir {afile}: {afile} is not a folder"),
        "report": ([str(tmp_path / "none")], f"{tmp_path / 'none'} does not exist; give a run folder"),
        "table": ([str(tmp_path / "none")], "has no sweep.json"),
        "sweep": ([*app, "--out", f"{afile}/s"], f"{afile} is a file, so no folder can be created"),
    }
    assert set(cases) == set(cli.COMMANDS) - {"pretrain-teacher"}  # its own: tests/test_pretrain.py
    for command, (argv, said) in cases.items():
        assert cli.main([command, *argv]) == 2, command
        assert said in one_line(capsys, f"feddifrc {command}"), command
    assert cli.main(["status", "--outputs-dir", str(tmp_path), "--last", "0"]) == 2
    assert "--last 0: expected >= 1" in one_line(capsys, "feddifrc status")


def test_app_errors_are_real_classes_and_a_bug_keeps_its_traceback(monkeypatch, capsys) -> None:
    for module, name in APP_ERRORS:
        cls = getattr(importlib.import_module(module), name)
        assert issubclass(cls, Exception) and is_app_error(cls.__new__(cls)), name
    assert not is_app_error(KeyError("x")) and not is_app_error(ZeroDivisionError())

    def bug(_args):
        raise ZeroDivisionError("a bug")

    monkeypatch.setitem(cli.COMMANDS, "status", (*cli.COMMANDS["status"][:2], bug))
    with pytest.raises(ZeroDivisionError):
        cli.main(["status"])


def test_each_benchmark_says_a_bad_argument_in_one_line(tmp_path, capsys, monkeypatch) -> None:
    """The benchmarks' command lines: a flag that names an unusable file or teacher, or a bad
    config value, ends in one line and exit status 2 (they were tracebacks, or failed only after
    starting Flower or a GPU section)."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    cases = {
        "featurizer": (["--model", str(tmp_path / "nope"), "--images", "2"], "does not exist"),
        "gpu_check": (["--dry-run", "--out", str(afile)], f"--out {afile} is a file; --out names a folder"),
        "dit_vs_unet": (["--unet", "u", "--dit", "d", "--out", f"{afile}/o"], f"{afile}/o: Not a directory"),
        "teacher_quality": (["--out", f"{afile}/o"], f"{afile}/o: Not a directory"),
        "round_overhead": (["--set", "train.lr=-1"], "config key 'train.lr' = -1"),
        "deploy_vs_sim": (["--method", "nope"], "config key 'method' = 'nope' is invalid"),
    }
    for name, (argv, said) in cases.items():
        main = importlib.import_module(name).main
        if name in ("dit_vs_unet", "teacher_quality"):  # they read sys.argv
            monkeypatch.setattr(sys, "argv", [name, *argv])
            rc = main()
        else:
            rc = main(argv)
        assert rc == 2, name
        err = one_line(capsys, f"benchmarks/{name}.py")
        assert said in err, err


def test_every_command_that_takes_run_config_values_says_to_quote_a_bare_word(tmp_path, capsys) -> None:
    """`method=fedavg` is not TOML: each flag of each `feddifrc` command that takes run-config
    values says, in one line, how to quote it, naming that flag (sweep --set said --run-config;
    --grid showed 'a','b'), before anything is written."""
    from feddifrc_app.tools.reference import subparsers
    from feddifrc_app.tools.run_config import parse_run_config

    app, out = ["--app", str(ROOT)], str(tmp_path / "out")
    rc = ["--run-config", "seed=3 method=fedavg"]
    fixed_rc = "--run-config \"seed=3 method='fedavg'\""
    cases = [
        (["extract", *app, "--check", *rc], fixed_rc),
        (["fetch", *app, *rc], fixed_rc),
        (["probe-teacher", *app, *rc], fixed_rc),
        (["pretrain-teacher", *app, "--out", out, *rc], fixed_rc),
        (["sweep", *app, "--out", out, "--set", "num-server-rounds=2", "--set", "method=fedavg"],
         "--set \"num-server-rounds=2 method='fedavg'\""),
        (["sweep", *app, "--out", out, "--grid", "method=fedavg,'feddifrc',fedprox"],
         "--grid \"method='fedavg','feddifrc','fedprox'\""),
        (["sweep", *app, "--out", out, "--federation-config", "num-supernodes=2 backend=ray"],
         "--federation-config \"num-supernodes=2 backend='ray'\""),
    ]  # fmt: skip
    flags = {"--run-config", "--set", "--grid", "--federation-config"}
    takes = {  # every command and flag that takes run-config values is a case
        (name, flag) for name, p in subparsers(cli.build_parser()).items() for a in p._actions
        for flag in set(a.option_strings) & flags
    }  # fmt: skip
    assert takes == {(argv[0], next(a for a in argv if a in flags)) for argv, _ in cases}
    for argv, fixed in cases:
        assert cli.main(argv) == 2, argv
        err = one_line(capsys, f"feddifrc {argv[0]}")
        assert "quote string values" in err and err.endswith(f"inside the shell's quotes: {fixed}\n"), err
    assert list(tmp_path.iterdir()) == []  # refused before any work
    # The line given is the fix: it parses.
    assert parse_run_config(["seed=3 method='fedavg'"]) == {"seed": 3, "method": "fedavg"}
    from feddifrc_app.tools.cmd_sweep import _grid

    assert _grid(["method='fedavg','feddifrc','fedprox'"]) == {"method": ["fedavg", "feddifrc", "fedprox"]}
