"""`feddifrc --help`: fast (no torch, diffusers, transformers or Flower imported, checked in a new
process), every flag with a help text, defaults shown, an example per command, ``--version``."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from importlib.metadata import version

import pytest
from conftest import ROOT

from feddifrc_app.tools import cli
from feddifrc_app.tools.cmd_common import shown_default
from feddifrc_app.tools.reference import subparsers

HEAVY = ("torch", "diffusers", "transformers", "flwr", "datasets", "ray", "matplotlib", "numpy")

# One new interpreter parses every --help in turn and says, after each, which heavy packages are
# loaded: the first command that pulls one in is named.
PROBE = """
import json, sys
from feddifrc_app.tools import cli
heavy, out = json.loads(sys.argv[1]), {}
for argv in json.loads(sys.argv[2]):
    try:
        cli.main(argv)
    except SystemExit:
        pass
    out[" ".join(argv)] = sorted(h for h in heavy if h in sys.modules)
print(json.dumps(out))
"""


def test_help_of_feddifrc_and_of_every_command_imports_no_heavy_package():
    argvs = [["--help"], ["--version"]] + [[name, "--help"] for name in cli.COMMANDS]
    cp = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(HEAVY), json.dumps(argvs)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=True,
    )
    loaded = json.loads(cp.stdout.splitlines()[-1])
    assert list(loaded) == [" ".join(a) for a in argvs]
    assert loaded == {k: [] for k in loaded}, f"heavy packages imported by --help: {loaded}"


def test_every_flag_of_every_command_has_a_help_text_and_every_command_an_example():
    parser = cli.build_parser()
    subs = subparsers(parser)
    assert list(subs) == list(cli.COMMANDS)
    missing = [
        f"{name} {'/'.join(a.option_strings) or a.dest}"
        for name, p in [("feddifrc", parser), *subs.items()]
        for a in p._actions
        if not isinstance(a, argparse._SubParsersAction) and not (a.help or "").strip()
    ]
    assert missing == []
    for name, p in subs.items():
        lines = (p.epilog or "").splitlines()
        assert lines[0] == "examples:", name
        assert lines[1:] and all(
            line.strip().split("#")[0].count(f"feddifrc {name}") == 1 for line in lines[1:]
        )


def test_help_shows_defaults_but_not_unset_ones_flags_or_ones_the_help_states(capsys):
    def action(**kw) -> argparse.Action:
        return argparse.ArgumentParser().add_argument("--x", **kw)

    assert shown_default(action(type=int, default=10, help="n")) == "10"
    assert shown_default(action(default=".", help="folder")) == "."
    assert shown_default(action(default=None, help="n")) == ""
    assert shown_default(action(action="store_true", help="flag")) == ""
    assert shown_default(action(action="append", default=[], help="repeat")) == ""
    assert shown_default(action(default="a", help="x (default: all)")) == ""
    with pytest.raises(SystemExit):
        cli.main(["extract", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # help wraps lines at the terminal width
    assert "clients the training set is split into (default: 10)" in out
    assert "only these partition ids, e.g. 0,3 (default: all)" in out  # said once, by the help
    assert "--no-progress no progress bar --check" in out and "(default: False)" not in out


def test_version_is_the_installed_package_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"feddifrc {version('feddifrc-app')}\n"
