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
    from feddifrc_app.outputs import RunDir

    run = RunDir(run_dir)
    try:
        results = run.load_results()
    except (AttributeError, TypeError) as e:  # valid JSON, not a results.json
        raise CLIError(f"{run.results_path} has an unexpected layout ({type(e).__name__}: {e})") from None
    except ValueError as e:  # not valid JSON, named
        raise CLIError(str(e)) from None
    if results is None:
        raise CLIError(
            f"{run.results_path} does not exist (is {run_dir} a feddifrc run directory? "
            "has round 0 finished?)"
        )
    return results


def cmd_report(args: argparse.Namespace) -> int:
    """Per-round table, final / best / mean-of-last-5, and where the plots and checkpoints are."""
    from feddifrc_app.tools.report import format_table, plot_accuracy

    run_dir = resolve_path(args.run_dir, "RUN_DIR")
    results = _read_results(run_dir)
    if args.plots:
        plot_accuracy(results, run_dir / "accuracy.png")
    teacher = results.teacher or {}
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
    if root.exists() and not root.is_dir():
        raise CLIError(f"--outputs-dir {args.outputs_dir}: {root} is not a folder; give a runs folder")
    # lexists, lstat: a results.json that is a broken link or a symlink loop is listed and named too.
    found = [d / "results.json" for d in (sorted(root.iterdir()) if root.is_dir() else []) if d.is_dir()]
    found = [p for p in found if not p.parent.name.startswith(".") and os.path.lexists(p)]
    runs = sorted(found, key=lambda p: p.lstat().st_mtime)[-args.last :]
    if not runs:
        print(f"no runs under {root}")
        return 0
    for path in runs:
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
