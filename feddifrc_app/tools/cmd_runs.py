"""``feddifrc report`` and ``feddifrc status``: one run's table, and how far the newest runs got."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Any

from feddifrc_app.casting import resolve_path
from feddifrc_app.config import DEFAULT_OUTPUTS_DIR
from feddifrc_app.results import Results
from feddifrc_app.tools.cmd_common import CLIError, examples


def add_report(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a run directory (<outputs-dir>/<run-name>) holding results.json")
    p.add_argument("--plots", action="store_true", help="(re)draw accuracy.png from results.json")
    examples(
        p, "feddifrc report ~/feddifrc-runs/<run-name>", "feddifrc report ~/feddifrc-runs/<run-name> --plots"
    )


def _read_results(run_dir: Path) -> Results:
    """A run directory's results.json, read as the ServerApp reads it to resume."""
    if not os.path.lexists(run_dir / "results.json"):  # said before outputs (and numpy) is imported
        raise CLIError(_no_results(run_dir))
    from feddifrc_app.outputs import RunDir

    run = RunDir(run_dir)
    try:
        results = run.load_results()
    except (AttributeError, TypeError) as e:  # valid JSON, not a results.json
        raise CLIError(f"{run.results_path} has an unexpected layout ({type(e).__name__}: {e})") from None
    except ValueError as e:  # not valid JSON, named
        raise CLIError(str(e)) from None
    if results is None:
        raise CLIError(_no_results(run_dir))
    return results


def _no_results(run_dir: Path) -> str:
    """Why ``run_dir`` has no results.json to read, in words: no such folder, a file, a runs
    folder, a folder that is no run, or a run that has not recorded round 0 (still setting up,
    e.g. waiting for min-nodes, or killed before it)."""
    see = "`feddifrc status --outputs-dir <outputs-dir>` lists the runs"
    if not run_dir.exists():
        return f"{run_dir} does not exist; give a run folder, <outputs-dir>/<run-name> ({see})"
    if not run_dir.is_dir():
        return f"{run_dir} is a file, not a run folder; give a run folder, <outputs-dir>/<run-name> ({see})"
    if runs := _run_folders(run_dir):
        return (
            f"{run_dir} is a runs folder ({len(runs)} runs), not a run: `feddifrc report "
            f"{runs[-1]}` (its newest), or `feddifrc status --outputs-dir {run_dir}`"
        )
    if not (run_dir / "config.json").is_file():
        return (
            f"{run_dir} is not a feddifrc run folder: it holds neither results.json nor config.json "
            f"(a run writes both in <outputs-dir>/<run-name>; {see})"
        )
    return f"{run_dir / 'results.json'} does not exist yet: {_setting_up(run_dir)}"


def _setting_up(run_dir: Path) -> str:
    """A run folder with config.json and no results.json (written once round 0 is scored): its
    ServerApp is setting up (loading data, waiting for min-nodes), or ended before round 0."""
    from feddifrc_app.files import folder_holder

    if who := folder_holder(run_dir):
        return f"its run is setting up (waiting for min-nodes, or before round 0) in {who}"
    return (
        "its run ended before round 0 was recorded and no process holds the folder (killed during "
        f"setup? `flwr log <run-id> <connection>` says why); a new run may reuse the folder "
        f"(the same outputs-dir and run-name = '{run_dir.name}')"
    )


def _run_folders(root: Path, starting: bool = False) -> list[Path]:
    """The folders in ``root`` that hold a results.json (a broken link or a symlink loop counts, to
    be named) and, with ``starting``, those holding only config.json (a run before round 0),
    oldest first by that file's time; hidden folders are left out."""
    found = []
    for d in sorted(root.iterdir()):
        if d.name.startswith(".") or not d.is_dir():
            continue
        if os.path.lexists(d / "results.json"):
            found.append(((d / "results.json").lstat().st_mtime, d))
        elif starting and (d / "config.json").is_file():
            found.append(((d / "config.json").stat().st_mtime, d))
    return [d for _, d in sorted(found, key=lambda t: t[0])]


def cmd_report(args: argparse.Namespace) -> int:
    """Per-round table, final / best / mean-of-last-5, and where the plots and checkpoints are."""
    run_dir = resolve_path(args.run_dir, "RUN_DIR")
    results = _read_results(run_dir)  # first: a folder that is no run is refused before any import
    from feddifrc_app.tools.report import format_table, platforms_text, plot_accuracy, teacher_of

    if args.plots:
        plot_accuracy(results, run_dir / "accuracy.png")
    teacher = teacher_of(results)
    print(
        f"{run_dir}: {results.method} / {results.strategy} on {results.dataset} ({results.partition})"
        + (f"; teacher {teacher.get('model')}" if teacher else "")
        + (f" (weights {teacher['weights-sha256'][:12]})" if teacher.get("weights-sha256") else "")
        + (
            "  [RANDOM-weight teacher: not evidence that FedDifRC helps]"
            if teacher.get("random-weights")
            else ""
        )
    )
    print(f"status: {_ending(run_dir, results) or results.status or 'unknown (results.json has none)'}")
    if where := platforms_text(results):
        print(where)
    for warning in results.warnings or []:  # each in full (status shows the newest)
        print(f"WARNING: {warning}")
    if bad := _non_finite(results):  # printed as nan/inf below: not measurements
        print(f"NOT FINITE (nan/inf below are not measurements): {'; '.join(bad)}")
    print(format_table(results))
    for name in ("accuracy.png", "label_distribution.png", "config.json"):
        if (run_dir / name).is_file():
            print(f"{name}: {run_dir / name}")
    ckpts = sorted((run_dir / "checkpoints").glob("round-*.pt"))
    if ckpts:
        print(
            f"checkpoints: {len(ckpts)} (last {ckpts[-1].name}); "
            f"resume with --run-config \"resume-from='{run_dir}'\""
        )
    return 0


def add_status(p: argparse.ArgumentParser) -> None:
    p.add_argument("--outputs-dir", default=DEFAULT_OUTPUTS_DIR, help="the run config's outputs-dir")
    p.add_argument("--last", type=int, default=10, help="show the newest N runs")
    examples(p, "feddifrc status", "feddifrc status --outputs-dir sweeps/mnist/runs --last 30")


def cmd_status(args: argparse.Namespace) -> int:
    """The newest runs under outputs-dir: rounds done, latest and best accuracy, failures."""
    root = resolve_path(args.outputs_dir, "--outputs-dir")
    if args.last < 1:
        raise CLIError(f"--last {args.last}: expected >= 1 (how many of the newest runs to show)")
    if not root.exists():
        raise CLIError(
            f"--outputs-dir {args.outputs_dir}: {root} does not exist (no run has written there yet, "
            "or the runs write elsewhere: give the run config's outputs-dir)"
        )
    if not root.is_dir():
        raise CLIError(f"--outputs-dir {args.outputs_dir}: {root} is not a folder; give a runs folder")
    runs = _run_folders(root, starting=True)[-args.last :]
    if not runs:
        if os.path.lexists(root / "results.json"):
            raise CLIError(
                f"--outputs-dir {args.outputs_dir}: {root} is one run's folder, not a runs folder: "
                f"`feddifrc report {root}`, or `feddifrc status --outputs-dir {root.parent}`"
            )
        print(f"no runs under {root} (no folder in it holds a results.json or config.json)")
        return 0
    for d in runs:
        path = d / "results.json"
        if not os.path.lexists(path):
            print(f"{d.name}: no results.json yet: {_setting_up(d)}")
            continue
        try:
            r = _read_results(path.parent)
        except CLIError as e:
            print(f"{path.parent.name}: {e}")
            continue
        try:
            print(_status_line(path, r))
        except (AttributeError, KeyError, TypeError, ValueError) as e:  # a hand-edited or foreign file
            print(f"{path.parent.name}: {path} has an unexpected layout ({type(e).__name__}: {e})")
    print("live Flower status: `flwr ls <connection>`; logs: `flwr log <run-id> <connection>`")
    return 0


def _status_line(path: Path, r: Results) -> str:
    """One run of `feddifrc status`: progress, accuracy, failures, and how it ended or if it lives."""
    import json

    rounds = [x for x in r.rounds if x.round >= 1]
    cfg_rounds: Any = "?"
    cfg_path = path.parent / "config.json"
    if cfg_path.is_file():
        try:
            cfg_rounds = json.loads(cfg_path.read_text()).get("num-server-rounds", "?")
        except (OSError, ValueError, AttributeError) as e:
            cfg_rounds = f"? ({cfg_path} unreadable: {type(e).__name__})"
    s = r.summary or {}
    fails = sum(len(x.failures or []) for x in rounds)
    scored = [x for x in r.evaluated() if x.round >= 1 and x.test_accuracy is not None]
    acc = (  # latest: the last round the server scored (server.evaluate-every)
        f"latest {100 * scored[-1].test_accuracy:.2f}%  best {100 * s['best-accuracy']:.2f}%"
        if scored and s.get("best-accuracy") is not None
        else "no round finished yet"
    )
    ending = _ending(path.parent, r)
    return (
        f"{path.parent.name}: {r.method}/{r.strategy} {r.dataset}  "
        f"round {len(rounds)}/{cfg_rounds}  {acc}  failures {fails}" + (f"  {ending}" if ending else "")
    )


def _ending(run_dir: Path, r: Results) -> str:
    """How a run ended, or who runs it ("" when it completed unwarned): its status and the first
    line of its error or its newest warning, or, for a "running" one, its live holder or that its
    process is gone."""
    if r.status == "running":
        from feddifrc_app.files import folder_holder

        who = folder_holder(run_dir)
        proc = r.process or {}
        return (
            f"running ({who})"
            if who
            else f"DEAD: results.json says running but no process holds the folder (last pid "
            f"{proc.get('pid', '?')} on {proc.get('host', '?')}); resume with resume-from='{run_dir}'"
        )
    if r.status == "completed" and r.warnings:  # e.g. a model that learned nothing (rounds.no_learning)
        more = f" (+{len(r.warnings) - 1} more: feddifrc report)" if len(r.warnings) > 1 else ""
        return f"completed, WARNED: {str(r.warnings[-1])[:200]}{more}"
    if r.status in (None, "completed"):
        return ""
    first = r.error.splitlines()[0][:200] if isinstance(r.error, str) and r.error.strip() else ""
    return f"{r.status}" + (f": {first}" if first else "")


def _non_finite(r: Results) -> list[str]:
    """Where results.json holds NaN or inf (strict JSON never does: a hand-edited or foreign file)."""

    def bad(v: Any) -> bool:
        return isinstance(v, float) and not math.isfinite(v)

    out = [f"summary {k} = {v}" for k, v in (r.summary or {}).items() if bad(v)]
    for row in r.rounds:
        values = row.to_json() | (row.train_metrics or {})
        out += [f"round {row.round} {k} = {v}" for k, v in values.items() if bad(v)]
    return out
