"""The generated reference pages (tools/reference.py): committed = generated now, every config key
commented, and the page says what config.py checks."""

from __future__ import annotations

import shutil

import pytest
from conftest import ROOT

from feddifrc_app import config_loader
from feddifrc_app.tools import reference
from feddifrc_app.tools.reference import allowed, config_lines, configuration_page

REGENERATE = "python -m feddifrc_app.tools.reference"


def _uncommented(pyproject: str) -> list[str]:
    return [k.key for k in config_lines(pyproject)[1] if not k.comment]


@pytest.mark.parametrize("page", reference.PAGES)
def test_each_committed_page_is_what_the_generator_writes_now(page):
    assert (ROOT / page).read_text() == reference.pages(ROOT)[page], f"{page} is stale: run `{REGENERATE}`"


def test_every_config_key_has_a_comment_in_pyproject():
    text = (ROOT / "pyproject.toml").read_text()
    assert _uncommented(text) == [], "keys without a comment in [tool.flwr.app.config]"
    # The check can fail: the same file with one comment removed names that key.
    bare = text.replace("moon.tau = 0.5                       # temperature", "moon.tau = 0.5\n# temperature")
    assert _uncommented(bare) == ["moon.tau"]


def test_key_lines_are_split_at_the_first_comment_outside_a_string():
    text = (
        "# above the table\n[tool.flwr.app.config]\n"
        'a.x = "one # two"   # why # still why\n'
        "# a group's note\n"
        "b = 3\n"
        "[tool.other]\nc = 1  # not ours\n"
    )
    intro, keys = config_lines(text)
    assert intro == ["above the table"]
    assert [(k.key, k.default, k.comment, k.note) for k in keys] == [
        ("a.x", '"one # two"', "why # still why", ""),
        ("b", "3", "", "a group's note"),
    ]


def test_allowed_values_are_the_ones_load_config_checks():
    assert allowed(*config_loader.keys()["partition.imb-factor"]) == "number in (0, 1]"
    assert allowed(*config_loader.keys()["seed"]) == "integer in [0, 4294967295]"
    assert (
        allowed(*config_loader.keys()["num-server-rounds"]) == "integer in [1, 2147483647]"
    )  # casting.MAX_INT
    assert allowed(*config_loader.keys()["train.lr"]) == "number in (0, 1e+09]"  # casting.MAX_FLOAT
    assert allowed(*config_loader.keys()["strategy.trim-beta"]) == "number in [0, 0.5)"
    assert allowed(*config_loader.keys()["train.augment"]) == "true or false"
    assert allowed(*config_loader.keys()["loss.ndcr-space"]) == "one of `unit`, `raw`"
    assert allowed(*config_loader.keys()["diffusion.blocks"]) == "comma-separated integers"
    assert allowed(*config_loader.keys()["outputs-dir"]) == 'folder path ("" = `~/feddifrc-runs`)'
    assert allowed(*config_loader.keys()["diffusion.prompt-template"]) == "text"
    # ... and the page's row holds the default, the rule, the comment and the resume rule.
    page = configuration_page((ROOT / "pyproject.toml").read_text())
    assert (
        "| `strategy.trim-beta` | `0.2` | number in [0, 0.5) | fedtrimmedavg | must match |\n"
        "| `strategy.num-malicious-nodes` |"
    ) in page
    assert (
        "| `num-server-rounds` | `10` | integer in [1, 2147483647] | federated rounds | may change |" in page
    )


def test_a_key_in_only_one_of_pyproject_and_config_is_named():
    text = (ROOT / "pyproject.toml").read_text()
    only = "only in the config classes"
    with pytest.raises(ValueError, match=rf"only in pyproject.toml \['train.lrr'\], {only} \[\]"):
        configuration_page(text.replace("train.momentum = 0.9", "train.lrr = 1\ntrain.momentum = 0.9"))
    with pytest.raises(ValueError, match=rf"only in pyproject.toml \[\], {only} \['moon.tau'\]"):
        configuration_page(text.replace("\nmoon.tau = 0.5", "\n#"))


def test_check_names_a_stale_page_and_regenerating_fixes_it(tmp_path, capsys):
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs", ignore=shutil.ignore_patterns("method_effect"))
    assert reference.main(["--check", "--app", str(tmp_path)]) == 0
    assert capsys.readouterr().out == "up to date: docs/configuration.md, docs/cli.md\n"
    text = (tmp_path / "pyproject.toml").read_text().replace("seed = 7 ", "seed = 8 ")
    (tmp_path / "pyproject.toml").write_text(text)
    assert reference.main(["--check", "--app", str(tmp_path)]) == 1
    assert capsys.readouterr().out == "out of date: docs/configuration.md\n"
    assert reference.main(["--app", str(tmp_path)]) == 0
    assert "| `seed` | `8` |" in (tmp_path / "docs" / "configuration.md").read_text()
    assert reference.main(["--check", "--app", str(tmp_path)]) == 0
