"""The ``feddifrc`` command (console script): work done outside ``flwr run``.

    extract           fill the teacher-feature cache for a run config (resumable, per image)
    pretrain-teacher  train the tiny text-to-image teacher on the public split (``tiny-mnist``)
    make-tiny         build the embedded tiny RANDOM-weight teacher and print its folder
    fetch             download (or, offline, verify) what a run config needs on a node
    report            a run's per-round table and summary
    status            the newest runs under outputs-dir and how far they got
    sweep             conf files x grid values x seeds as real ``flwr run``s (resumable)
    table             a sweep's markdown/CSV table and accuracy curves

``feddifrc COMMAND --help`` gives each one's flags, defaults and an example (docs/cli.md is
generated from these parsers: ``python -m feddifrc_app.tools.reference``). Subcommands live in
:data:`COMMANDS` (name -> help, argument adder, runner); add a row to add one; its adder gives
every flag a help text and the parser an example (``cmd_common.examples``). The run config is
read by ``run_config`` (the app's defaults plus ``--run-config``, as ``flwr run`` reads them).
Heavy modules (torch, diffusers, datasets, Flower) are imported inside the runners, never by an
adder: ``feddifrc --help`` and every ``feddifrc COMMAND --help`` import none of them
(tests/test_cli_help.py checks it in a new process).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from feddifrc_app.tools.cmd_common import HelpFormatter, is_app_error, one_line
from feddifrc_app.tools.cmd_node import (
    add_extract,
    add_fetch,
    add_make_tiny,
    cmd_extract,
    cmd_fetch,
    cmd_make_tiny,
)
from feddifrc_app.tools.cmd_pretrain import add_pretrain, cmd_pretrain
from feddifrc_app.tools.cmd_probe import add_probe, cmd_probe
from feddifrc_app.tools.cmd_runs import add_report, add_status, cmd_report, cmd_status
from feddifrc_app.tools.cmd_sweep import add_sweep, add_table, cmd_sweep, cmd_table

COMMANDS: dict[
    str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]
] = {
    "extract": ("fill the teacher-feature cache for a run config (resumable)", add_extract, cmd_extract),
    "pretrain-teacher": (
        "train the tiny text-to-image teacher on the public split and write its diffusers folder",
        add_pretrain,
        cmd_pretrain,
    ),
    "probe-teacher": (
        "score the teacher's layers x timesteps x poolings on train/val images; recommend blocks, timestep",
        add_probe,
        cmd_probe,
    ),
    "make-tiny": (
        "build the embedded tiny random-weight teacher and print its folder",
        add_make_tiny,
        cmd_make_tiny,
    ),
    "fetch": (
        "download (or, offline, verify) the teacher weights and dataset a run config needs on a node",
        add_fetch,
        cmd_fetch,
    ),
    "report": (
        "print a run's per-round table and summary (final, best, mean of last 5)",
        add_report,
        cmd_report,
    ),
    "status": ("list the newest runs under outputs-dir with their progress", add_status, cmd_status),
    "sweep": (
        "run conf files x grid values x seeds as real flwr runs (resumable), then the table",
        add_sweep,
        cmd_sweep,
    ),
    "table": (
        "write a sweep's markdown/CSV table (mean ± std over seeds) and accuracy curves",
        add_table,
        cmd_table,
    ),
}


# What Ctrl-C keeps, by command: only these resume; any other leaves no partial output behind.
INTERRUPTED = {
    "extract": "the features extracted so far are cached; rerun to resume",
    "sweep": "finished cells are kept; rerun to resume",
    "fetch": "finished files are kept; rerun to resume",
    "pretrain-teacher": "no partial teacher is kept; a rerun starts over",
}


class _Version(argparse.Action):
    """``--version``: the installed package's version, read only when asked for."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("feddifrc-app")
        except PackageNotFoundError:
            v = "unknown (feddifrc-app is not installed: pip install -e .)"
        print(f"feddifrc {v}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="feddifrc",
        description="FedDifRC tools outside `flwr run`.",
        epilog="`feddifrc COMMAND --help` for a command's flags and an example.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action=_Version, help="print the installed version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_, add, run) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_, formatter_class=HelpFormatter)
        add(sp)
        sp.set_defaults(func=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.func(args) or 0)
    except Exception as e:
        if not is_app_error(e):
            raise  # a bug: its traceback is what to report
        logging.getLogger(__name__).debug("feddifrc %s failed", args.command, exc_info=True)  # -v
        print(f"feddifrc {args.command}: error: {one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        kept = INTERRUPTED.get(args.command, "nothing half-written is left")
        print(f"feddifrc {args.command}: interrupted ({kept})", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
