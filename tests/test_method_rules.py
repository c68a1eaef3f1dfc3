"""Each method declares its own config rules (methods.hooks); config.py runs them and names none."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from conftest import ROOT, default_run_config, make_config

from feddifrc_app import methods
from feddifrc_app.casting import invalid
from feddifrc_app.config import ConfigError
from feddifrc_app.config_loader import load_config, resumable
from feddifrc_app.methods import fednh, fednova, moon, scaffold
from feddifrc_app.methods.feddifrc import rules as feddifrc_rules
from feddifrc_app.tools.run_config import app_defaults, parse_run_config

NAMES = ("feddifrc", "moon", "fednh", "fedprox", "scaffold", "fednova")


def test_config_py_names_no_method_or_strategy_in_its_rules():
    """The choice lists name them (they are the keys' allowed values); no rule does."""
    tree = ast.parse(Path(ROOT, "feddifrc_app", "config.py").read_text())
    named = []
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
        doc = ast.get_docstring(fn, clean=False)
        for c in ast.walk(fn):
            if isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value != doc:
                named += [(fn.name, c.value) for n in NAMES if n in c.value]
    assert named == []


def test_every_methods_rules_are_found_in_module_order():
    assert methods.hooks("node_state") == [moon.node_state, scaffold.node_state]
    assert methods.hooks("dp_refusal") == [fednh.dp_refusal, fednova.dp_refusal, scaffold.dp_refusal]
    # FedDifRC's from its package's rules module
    assert methods.hooks("check_config") == [
        feddifrc_rules.check_config,
        fednh.check_config,
        fednova.check_config,
        scaffold.check_config,
    ]
    assert methods.hooks("own_strategy") == [fednh.own_strategy]


def test_what_each_method_declares():
    v = make_config(method="fedavg").to_flat()
    assert [f(v) for f in methods.hooks("node_state")] == ["", ""]
    assert moon.node_state(v | {"method": "moon"}) == "method = 'moon'"
    assert scaffold.node_state(v | {"strategy.name": "scaffold"}) == "strategy.name = 'scaffold'"
    assert fednh.dp_refusal(v | {"method": "fednh"}).startswith("method = 'fednh' replies with a second")
    assert fednova.dp_refusal(v | {"strategy.name": "fednova"}).endswith("use fedavg or fedprox")
    assert not resumable(make_config(method="moon")) and resumable(make_config(method="fedavg"))


def test_two_refusals_name_the_first_method_as_before():
    # FedNH's reply is refused before SCAFFOLD's (and before FedNH's own strategy rule).
    with pytest.raises(
        ConfigError, match=r"'strategy.dp' = 'server-fixed' is invalid: method = 'fednh' replies"
    ):
        make_config(method="fednh", strategy__name="scaffold", strategy__dp="server-fixed")
    with pytest.raises(ConfigError, match=r"'strategy.name' = 'fedprox' is invalid: method 'fednh' brings"):
        make_config(method="fednh", strategy__name="fedprox")
    with pytest.raises(
        ConfigError, match=r"'train.keep-momentum' = True is invalid: not with strategy.name = 'fednova'"
    ):
        make_config(method="fedavg", strategy__name="fednova", train__keep_momentum=True)


def test_fednh_clips_once():
    """FedNH's own clipping and every method's are two keys for one step: one of them, never both."""
    with pytest.raises(
        ConfigError, match=r"'fednh.max-grad-norm' = 10 and 'train.max-grad-norm' = 5 both clip"
    ):
        make_config(method="fednh", train__max_grad_norm=5.0)
    assert (
        make_config(method="fednh", train__max_grad_norm=5.0, fednh__max_grad_norm=0.0).train.max_grad_norm
        == 5.0
    )
    assert make_config(method="fedavg", train__max_grad_norm=5.0).fednh.max_grad_norm == 10.0  # never read


def test_a_new_methods_rules_need_no_edit_of_config_py(monkeypatch):
    """A method module's three rules, and load_config / resumable applying them."""
    dummy = types.ModuleType("feddifrc_app.methods.dummy")

    def check_config(v, raw):
        if v["seed"] == 1008:
            raise invalid("seed", 1008, "the dummy method refuses it")

    dummy.check_config = check_config
    dummy.node_state = lambda v: "seed = 1007" if v["seed"] == 1007 else ""
    dummy.dp_refusal = lambda v: "seed = 1007 cannot be clipped" if v["seed"] == 1007 else ""
    found = methods.modules()
    monkeypatch.setattr(methods, "modules", lambda: (*found, dummy))

    rc = default_run_config() | {"method": "fedavg"}
    with pytest.raises(ConfigError, match=r"'seed' = 1008 is invalid: the dummy method refuses it"):
        load_config(rc | {"seed": 1008})
    assert not resumable(load_config(rc | {"seed": 1007})) and resumable(load_config(rc))
    with pytest.raises(
        ConfigError, match=r"'resume-from' = '/tmp/r' is invalid: seed = 1007 keeps per-node state"
    ):
        load_config(rc | {"seed": 1007, "resume-from": "/tmp/r"})
    with pytest.raises(
        ConfigError, match=r"'strategy.dp' = 'server-fixed' is invalid: seed = 1007 cannot be clipped"
    ):
        load_config(rc | {"seed": 1007, "strategy.dp": "server-fixed"})


# A config that breaks several rules reports the same first error as before the rules moved into
# the method modules (texts taken from the code before the move).
FIRST_ERRORS = [
    (
        {"diffusion__blocks": "0,0", "run_name": "a/b"},
        "'diffusion.blocks' = '0,0' and 'diffusion.channels' = '256,128,128' must have the same length",
    ),
    (
        {"diffusion__prompt_template": "x", "evaluate_holdout": 0.1},
        "'diffusion.prompt-template' = 'x' is invalid: must contain '{}' where the class name goes",
    ),
    (
        {"method": "moon", "strategy__name": "scaffold", "resume_from": "/tmp/x"},
        "is invalid: strategy.name = 'scaffold' keeps per-node state that a new run lacks",
    ),
    (
        {
            "diffusion__condition": "global-model",
            "diffusion__projection": "per-batch",
            "strategy__dp": "server-fixed",
            "strategy__name": "scaffold",
        },
        "'diffusion.condition' = 'global-model' is invalid: needs a shared basis",
    ),
    (
        {"strategy__name": "krum", "strategy__num_malicious_nodes": 5, "diffusion__channels": "1,2"},
        "'diffusion.blocks' = '1,2,3' and 'diffusion.channels' = '1,2' must have the same length",
    ),
]


@pytest.mark.parametrize(("overrides", "first"), FIRST_ERRORS)
def test_a_config_breaking_several_rules_reports_the_same_first_error(overrides, first):
    with pytest.raises(ConfigError) as e:
        load_config(default_run_config(**overrides))
    assert first in str(e.value)


# A process where Flower (and ray) cannot be imported, as on a bare GPU host: every import of them
# raises, so the failure names the import chain that reached Flower.
_WITHOUT_FLOWER = """
import json, sys

class NoFlower:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("flwr", "ray"):
            raise ImportError(f"{name} is blocked: config loading must not import Flower")
        return None

sys.meta_path.insert(0, NoFlower())
from feddifrc_app import methods
from feddifrc_app.config import ConfigError
from feddifrc_app.config_loader import load_config

out = {}
for name, rc in json.load(sys.stdin).items():
    try:
        out[name] = load_config(rc).to_flat()
    except ConfigError as e:
        out[name] = str(e)
found = [m.__name__.rsplit(".", 1)[1] for m in methods.modules()]
imported = sorted(m for m in sys.modules if m.partition(".")[0] in ("flwr", "ray"))
print(json.dumps({"configs": out, "methods": found, "imported": imported}, default=str))
"""


def test_every_run_config_loads_without_flower():
    """The default run config, every conf/*.toml and configs that break rules (strategy, DP,
    methods), loaded in a new process that cannot import Flower: every method is found, none of
    Flower is imported, and each config gives the same values or the same error as with Flower
    (built as ``flwr run`` builds it). benchmarks/gpu_check.py's section F relies on this."""
    configs = {"default": app_defaults(ROOT)}
    for conf in sorted(Path(ROOT, "conf").glob("*.toml")):
        configs[conf.name] = app_defaults(ROOT) | parse_run_config([str(conf)])
    refused = [o for o, _ in FIRST_ERRORS] + [
        {"method": "fednh", "strategy__dp": "server-fixed"},
        {"strategy__name": "fednova", "strategy__dp": "client-fixed"},
        {"strategy__name": "scaffold", "train__keep_momentum": True},
        {"method": "moon", "resume_from": "/tmp/x"},
    ]
    configs |= {f"refused {i}": default_run_config(**o) for i, o in enumerate(refused)}
    want = {}
    for name, rc in configs.items():
        try:
            want[name] = load_config(rc).to_flat()
        except ConfigError as e:
            want[name] = str(e)
    assert len([w for w in want.values() if isinstance(w, str)]) == len(refused)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cp = subprocess.run(
        [sys.executable, "-c", _WITHOUT_FLOWER],
        input=json.dumps(configs),
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert cp.returncode == 0, cp.stderr[-4000:]
    got = json.loads(cp.stdout.strip().splitlines()[-1])
    assert got["imported"] == []
    assert set(NAMES) <= set(got["methods"])
    assert got["configs"] == json.loads(json.dumps(want, default=str))


def test_a_basis_sample_without_a_federated_basis_is_refused():
    with pytest.raises(ConfigError, match=r"'diffusion.basis-nodes' = 5.*projection = 'random' fits none"):
        make_config(diffusion__basis_nodes=5, diffusion__projection="random")
    assert make_config(diffusion__basis_nodes=5).diffusion.basis_nodes == 5  # federated-pca: the default
