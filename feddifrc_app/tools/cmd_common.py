"""What every ``feddifrc`` command shares: its one-line error and the run-config arguments."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every flag's default after its help (unless there is none, or the help says it); the
    description and the examples keep their lines."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return (action.help or "") + (" (default: %(default)s)" if shown_default(action) else "")


def shown_default(action: argparse.Action) -> str:
    """The default ``--help`` shows for ``action`` ("" = none worth showing: unset, a flag, an
    empty list, or a help text that says the default itself)."""
    d = action.default
    if (
        d is None
        or d is argparse.SUPPRESS
        or isinstance(d, bool)
        or d == []
        or "(default" in (action.help or "")
    ):
        return ""
    return str(d)


def examples(p: argparse.ArgumentParser, *commands: str) -> None:
    """The command's examples, shown by ``--help`` and docs/cli.md."""
    p.epilog = "examples:\n" + "\n".join(f"  {c}" for c in commands)


class CLIError(Exception):
    """A user error: printed as one line, exit status 2."""


def int_list(flag: str, s: str | None) -> list[int] | None:
    if s is None or not s.strip():
        return None
    try:
        return [int(p) for p in s.split(",") if p.strip()]
    except ValueError:
        raise CLIError(f"{flag} {s!r}: expected comma-separated integers, e.g. 0,3") from None


def split_names(s: str) -> list[str]:
    out = [p.strip() for p in s.split(",") if p.strip()]
    bad = [p for p in out if p not in ("train", "test")]
    if not out or bad:
        raise CLIError(f"--split {s!r}: expected train, test or train,test")
    return list(dict.fromkeys(out))


def add_run_config_args(p: argparse.ArgumentParser) -> None:
    """--app, --run-config and --cache-dir: the run config and node cache a command works on."""
    p.add_argument("--app", default=".", help="Flower app folder (its pyproject.toml holds the defaults)")
    p.add_argument(
        "--run-config",
        action="append",
        metavar="FILE_OR_PAIRS",
        help='overrides, like flwr run: conf/X.toml or "key=value key2=value2" (repeatable)',
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help="node cache folder (default: diffusion.cache-dir or ~/.cache/feddifrc)",
    )
