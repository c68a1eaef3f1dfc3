"""What every ``feddifrc`` command shares: its one-line error and the run-config arguments."""

from __future__ import annotations

import argparse
import contextlib
import functools
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any


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


# The app's own errors, whatever command meets them: each says in its message what is wrong (the
# key, file or flag) and what to do, so a command prints it as one line. (module, class): looked up
# only where its module is imported already (a command that never imported it cannot have raised
# it), so that no command and no --help imports a heavy module for this.
APP_ERRORS = (
    ("feddifrc_app.casting", "ConfigError"),  # a config key
    ("feddifrc_app.casting", "PathError"),  # a path argument that cannot be resolved, named
    ("feddifrc_app.tools.run_config", "RunConfigError"),  # --app, --run-config
    ("feddifrc_app.data.images", "DatasetUnavailableError"),
    ("feddifrc_app.device", "DeviceError"),
    ("feddifrc_app.diffusion.digests", "TeacherLoadError"),
    ("feddifrc_app.diffusion.family", "FamilyError"),  # a teacher folder, or a key it refuses
    ("feddifrc_app.tools.pretrain", "OutFolderError"),
    ("feddifrc_app.files", "FolderInUse"),
    ("feddifrc_app.privacy", "DPError"),
    ("feddifrc_app.tools.sweep", "SweepError"),
)


def is_app_error(e: BaseException) -> bool:
    """Whether ``e`` is a user error to print in one line (exit status 2): one of the CLI's own,
    one of ``APP_ERRORS``, or an OSError (a file or folder the system refused: its message names
    it). Anything else is a bug and keeps its traceback."""
    if isinstance(e, (CLIError, OSError)):
        return True
    loaded = (getattr(sys.modules.get(m), name, None) for m, name in APP_ERRORS)
    return any(isinstance(e, cls) for cls in loaded if isinstance(cls, type))


def one_line(e: BaseException) -> str:
    """The error's message on one line (an OSError's errno text and file name included)."""
    if isinstance(e, OSError) and e.strerror and e.filename is not None:
        return f"{e.filename}: {e.strerror}"
    return " ".join(str(e).split()) or type(e).__name__


def one_line_errors(prog: str) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """A command line's ``main`` whose app errors (``is_app_error``) end in one line on stderr,
    ``<prog>: error: ...``, exit status 2 (the benchmarks' command lines use it)."""

    def wrap(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def run(*args: Any, **kwargs: Any) -> int:
            try:
                return main(*args, **kwargs)
            except Exception as e:
                if not is_app_error(e):
                    raise
                print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
                return 2

        return run

    return wrap


@contextlib.contextmanager
def exit_on_termination() -> Iterator[None]:
    """Inside: SIGTERM (`timeout`, a CI job's cancel) and SIGHUP (a closed terminal), which end
    Python without running ``finally``, raise SystemExit (128 + the signal) instead, so the
    caller's cleanup runs, as on Ctrl-C: a local SuperLink that `flwr` started, in a session of its
    own, never sees them, and it and its simulation's Ray would live on. A second one ends the
    process at once. The previous handlers come back on leaving."""

    def leave(signum: int, _frame: object) -> None:
        signal.signal(signum, signal.SIG_DFL)
        raise SystemExit(128 + signum)

    before = {signum: signal.signal(signum, leave) for signum in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def termination_held() -> Iterator[None]:
    """Inside: SIGTERM and SIGHUP are noted, not acted on, so a cleanup runs to its end; the first
    one noted is raised again on leaving, for the handler outside (Python runs signal handlers in
    the main thread whichever thread the signal reached, so noting works where a thread mask
    would not)."""
    noted: list[int] = []
    before = {
        sig: signal.signal(sig, lambda n, _f: noted.append(n)) for sig in (signal.SIGTERM, signal.SIGHUP)
    }
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        if noted:
            signal.raise_signal(noted[0])


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
