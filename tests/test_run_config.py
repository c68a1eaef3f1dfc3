"""run_config: the app's defaults plus --run-config overrides, read as `flwr run` reads them."""

from __future__ import annotations

import pytest
from conftest import ROOT

from feddifrc_app.tools.run_config import RunConfigError, load_app_config, parse_run_config


def test_parse_run_config_pairs_exactly_like_flwr():
    from flwr.common.config import parse_config_args

    line = (
        'seed=3 method="fedavg" train.lr=0.1 diffusion.blocks="1,2" '
        "train.augment=false dataset.name='cifar10'"
    )
    got = parse_run_config([line])
    assert got == {
        "seed": 3,
        "method": "fedavg",
        "train.lr": 0.1,
        "diffusion.blocks": "1,2",
        "train.augment": False,
        "dataset.name": "cifar10",
    }
    assert got == parse_config_args([line])  # Flower's own parser, so `flwr run` agrees
    assert parse_run_config(['diffusion.ndcr-prompt="a photo"']) == {"diffusion.ndcr-prompt": "a photo"}
    assert parse_run_config(["seed=1", "seed=2"]) == {"seed": 2}  # later wins
    assert parse_run_config(None) == {} and parse_run_config([""]) == {}
    # As strict as flwr: a bare word is not TOML, so it is an error, not a guess (with a hint below).
    with pytest.raises(RunConfigError, match="quote string values"):
        parse_run_config(["method=feddifrc-ssl"])
    with pytest.raises(RunConfigError, match="cannot parse"):
        parse_run_config(["seed 3"])


def test_an_unquoted_string_value_gets_a_one_line_hint_to_quote_it(capsys):
    """`method=fedavg` (or `method="fedavg"` outside the shell's quotes) was Flower's "invalid format"
    without the word to fix; the hint names each bare value and gives the line to type."""
    from feddifrc_app.tools import cli

    with pytest.raises(RunConfigError) as e:
        parse_run_config(["strategy.name=scaffold method=fedavg seed=3", "diffusion.channels=64,32,32"])
    assert str(e.value) == (
        "--run-config: quote string values (strategy.name=scaffold, method=fedavg, "
        "diffusion.channels=64,32,32: not a number or true/false), inside the shell's quotes: "
        "--run-config \"strategy.name='scaffold' method='fedavg' seed=3 diffusion.channels='64,32,32'\""
    )
    fixed = str(e.value).split("--run-config ")[-1].strip('"')
    assert parse_run_config([fixed]) == {
        "strategy.name": "scaffold",
        "method": "fedavg",
        "seed": 3,
        "diffusion.channels": "64,32,32",
    }
    assert parse_run_config(["seed=3 train.lr=1e-3 train.augment=false"]) == {
        "seed": 3,
        "train.lr": 0.001,
        "train.augment": False,
    }
    # A feddifrc command says it in one line, exit status 2, before any work.
    assert cli.main(["extract", "--check", "--app", str(ROOT), "--run-config", "method=fedavg"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "feddifrc extract: error: --run-config: quote string values (method=fedavg: not a number or "
        "true/false), inside the shell's quotes: --run-config \"method='fedavg'\"\n"
    )


def test_parse_run_config_toml_file(tmp_path, monkeypatch):
    f = tmp_path / "x.toml"
    f.write_text("seed = 5\n[diffusion]\ntimestep = 200\n[partition]\nalpha = 0.05\n")
    assert parse_run_config([str(f)]) == {"seed": 5, "diffusion.timestep": 200, "partition.alpha": 0.05}
    monkeypatch.chdir(tmp_path)  # relative to the current folder, as flwr run reads it
    assert parse_run_config(["x.toml"])["seed"] == 5
    with pytest.raises(RunConfigError, match="not found"):
        parse_run_config(["nope.toml"])
    with pytest.raises(RunConfigError, match="TOML files cannot be passed alongside"):
        parse_run_config([str(f), "seed=1"])


def test_app_config_defaults_plus_overrides():
    cfg = load_app_config(ROOT, ['diffusion.timestep=200 method="fedavg"'])
    assert cfg.diffusion.timestep == 200 and cfg.method == "fedavg" and cfg.seed == 7
    for f in sorted((ROOT / "conf").glob("*.toml")):  # every shipped override file loads the same way
        load_app_config(ROOT, [str(f)])
    with pytest.raises(RunConfigError, match="unknown config key.*diffusion.timesteps"):
        load_app_config(ROOT, ["diffusion.timesteps=200"])
    with pytest.raises(RunConfigError, match="no pyproject.toml"):
        load_app_config(ROOT / "tests", None)
