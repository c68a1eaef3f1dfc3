"""The run config as ``flwr run`` builds it, for work done outside ``flwr run`` (the CLI, the
sweep, the benchmarks): the Flower app's defaults (``[tool.flwr.app.config]`` of its
pyproject.toml) updated with ``--run-config`` overrides, then ``config.load_config``.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from feddifrc_app.config import Config, ConfigError, load_config


class RunConfigError(Exception):
    """An app folder or an override that cannot be read, or a value ``load_config`` refuses: one line."""


def parse_run_config(values: Sequence[str] | None) -> dict[str, Any]:
    """Overrides exactly as ``flwr run --run-config`` parses them (Flower's own parser), flat.

    One ``.toml`` file, or strings of space-separated TOML ``key=value`` pairs (strings
    quoted: ``method="fedavg"``); never both. Later pairs win.
    """
    import click
    from flwr.common.config import parse_config_args

    values = [v for v in (values or []) if v and v.strip()]
    if values and values[0].strip().endswith(".toml") and not Path(values[0]).expanduser().is_file():
        raise RunConfigError(f"--run-config: override file {values[0]!r} not found")
    for line in values:
        rest = re.sub(r"(\S+?)=('[^']*'|\"[^\"]*\"|\S+)", "", line).strip()
        if rest and not line.strip().endswith(".toml"):
            raise RunConfigError(
                f"--run-config: cannot parse {rest!r} in {line!r}; expected space-separated key=value pairs"
            )
    try:
        return parse_config_args(values or None)
    except (ValueError, click.ClickException, tomllib.TOMLDecodeError) as e:
        msg = e.message if isinstance(e, click.ClickException) else str(e)
        raise RunConfigError(f"--run-config {' '.join(values)!r}: {msg}") from None


def app_defaults(app: str | Path) -> dict[str, Any]:
    """``[tool.flwr.app.config]`` of the Flower app folder ``app``, flat (as Flower reads it)."""
    from flwr.common.config import flatten_dict, get_project_config

    if not (Path(app).expanduser() / "pyproject.toml").is_file():
        raise RunConfigError(f"--app {app}: no pyproject.toml there (pass the Flower app folder)")
    return flatten_dict(get_project_config(Path(app).expanduser())["tool"]["flwr"]["app"]["config"])


def load_app_config(app: str | Path, overrides: Sequence[str] | None) -> Config:
    """The app's defaults updated with ``--run-config`` overrides, validated (unknown keys named)."""
    try:
        return load_config({**app_defaults(app), **parse_run_config(overrides)})
    except ConfigError as e:
        raise RunConfigError(str(e)) from None
