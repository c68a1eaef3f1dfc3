"""The run config as ``flwr run`` builds it, for work done outside ``flwr run`` (the CLI, the
sweep, the benchmarks): the Flower app's defaults (``[tool.flwr.app.config]`` of its
pyproject.toml) updated with ``--run-config`` overrides, then ``config_loader.load_config``.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from feddifrc_app.config import Config, ConfigError
from feddifrc_app.config_loader import load_config

# A key=value pair as Flower's parser finds it (flwr.common.config.parse_config_args).
_PAIR = re.compile(r"(\S+?)=('[^']*'|\"[^\"]*\"|\S+)")


class RunConfigError(Exception):
    """An app folder or an override that cannot be read, or a value ``load_config`` refuses: one line."""


def parse_run_config(values: Sequence[str] | None, flag: str = "--run-config") -> dict[str, Any]:
    """Overrides exactly as ``flwr run --run-config`` parses them (Flower's own parser), flat.

    One ``.toml`` file, or strings of space-separated TOML ``key=value`` pairs (strings
    quoted: ``method="fedavg"``); never both. Later pairs win. ``flag``: the command's flag
    that gave ``values`` (``feddifrc sweep --set``), named in every error.
    """
    import click
    from flwr.common.config import parse_config_args

    values = [v for v in (values or []) if v and v.strip()]
    if values and values[0].strip().endswith(".toml") and not Path(values[0]).expanduser().is_file():
        raise RunConfigError(f"{flag}: override file {values[0]!r} not found")
    for line in values:
        rest = _PAIR.sub("", line).strip()
        if rest and not line.strip().endswith(".toml"):
            raise RunConfigError(
                f"{flag}: cannot parse {rest!r} in {line!r}; expected space-separated key=value pairs"
            )
    if hint := _quote_hint(values, flag):
        raise RunConfigError(hint)
    try:
        return parse_config_args(values or None)
    except (ValueError, click.ClickException, tomllib.TOMLDecodeError) as e:
        msg = e.message if isinstance(e, click.ClickException) else str(e)
        raise RunConfigError(f"{flag} {' '.join(values)!r}: {msg}") from None


def _quote_hint(values: Sequence[str], flag: str) -> str:
    """How to quote the bare words among ``values``' pairs, "" if none: ``method=fedavg`` is not
    TOML, which Flower's parser refuses without saying why (a shell drops the quotes of
    ``method="fedavg"`` outside quotes of its own)."""
    if any(v.strip().endswith(".toml") for v in values):
        return ""  # a file: TOML itself says what is wrong in it (and a file takes no pairs)
    bare = [f"{k}={v}" for line in values for k, v in _PAIR.findall(line) if _bare(v)]
    if not bare:
        return ""
    fixed = " ".join(_PAIR.sub(lambda m: f"{m[1]}={quoted(m[2])}", x) for x in values)
    return (
        f"{flag}: quote string values ({', '.join(bare)}: not a number or true/false), "
        f'inside the shell\'s quotes: {flag} "{fixed}"'
    )


def quoted(value: str) -> str:
    """``value`` as TOML: single-quoted when it is a bare word (``fedavg`` -> ``'fedavg'``)."""
    return f"'{value}'" if _bare(value) else value


def _bare(value: str) -> bool:
    """An unquoted value that is not TOML (a word such as fedavg, a path, 64,32,32)."""
    if not value or value[0] in "'\"":
        return False
    try:
        tomllib.loads(f"v = {value}")
    except tomllib.TOMLDecodeError:
        return True
    return False


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
