"""Does FedDifRC help? A paired benchmark on mnist-5k with a design declared before it runs.

    python benchmarks/method_effect.py pilot [--out DIR]   # lr, horizon, NDCR options, on VALIDATION
    python benchmarks/method_effect.py plan                # the declared design, its cells, reuse, budget
    python benchmarks/method_effect.py run                 # the paired comparison (resumable at any cell)
    python benchmarks/method_effect.py table [--out DIR]   # the paired table from finished + reused cells
    python benchmarks/method_effect.py recheck [--out DIR] # rerun the first reused cell: same curves?

Every cell is a real `flwr run .` in Flower's Ray simulation engine (10 simulated SuperNodes,
5 sampled per round, paper NID1 Dirichlet partitions), run through `feddifrc sweep`'s code:
judged by `flwr ls`, resumable (a finished cell is skipped, an interrupted one continues from
its last checkpoint: stop `run` at any cell and start it again), failures recorded. ``--lanes 2``
runs two sweeps side by side; on 2 cores that thrashed, so the default is one.

Declared design (issue 35; declared before any of its results; method_effect_design.py holds it
as data and `plan` prints it):
- Paired by seed: within a seed every arm sees the same partitions, initial model, sampled
  clients and batches.
- Primary endpoint (unchanged), per seed: mean TEST accuracy over the last 10 rounds, arm minus
  the other arm of the comparison; over seeds: mean, SD, 95% paired t-interval, two-sided
  paired t-test, sign count. The rounds and the window are per-partition settings: alpha 0.05,
  16 rounds, window 7-16; alpha 0.5, 30 rounds (the gain still grew at round 16), window 21-30.
- Secondary endpoint: mean TEST accuracy over the 5 rounds centred on the round of best
  VALIDATION accuracy (the first such round); near either end the window is shifted, not
  shortened, to lie within rounds 1..R (best round 1 or 2: rounds 1-5; best round R or R-1:
  rounds R-4..R). Validation and test accuracy correlated at r = 0.997 per round in the earlier
  run, so this endpoint still behaves much like "best on test": read it as such.
- Comparisons (each at both alphas): TDCL-only vs TDCL-anchors (is it the teacher's knowledge or
  fixed class anchors?), TDCL-only vs FedAvg, FedDifRC (with the chosen NDCR target) vs TDCL-only
  (what NDCR adds), FedDifRC vs FedAvg; references: TDCL-anchors vs FedAvg, FedNH vs FedAvg.
- Holm-Bonferroni over every comparison reported for an endpoint (6 comparisons x 2 alphas = 12
  per endpoint), from the paired t-tests; the adjusted p stands beside each interval. "helps" /
  "hurts" only where the adjusted primary test rejects at 0.05, else "no detectable difference".
- Seeds (from the earlier run's paired SDs: 80% power unadjusted): 11 paired seeds at alpha 0.05,
  16 at alpha 0.5, for every key arm; FedNH, rerun with its corrected defaults, on 6 as a
  reference. A cell of the earlier 72-cell run (docs/method_effect/cells.json) is reused where its
  run config equals the planned cell's (method_effect_design.py says how that is decided):
  FedAvg and TDCL-only at alpha 0.05, seeds 0-5; every other cell is new.
- Budget: about 100 s per 16-round cell and 190 s per 30-round cell on 2 idle cores; `plan`
  prints the total before anything runs (limit: about six hours); run nothing heavy beside it.
- The earlier run's design (FedAvg as the only reference, test accuracy at the validation-best
  round, an untrained-teacher control) is in git history and docs/evidence.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Callable
from operator import attrgetter
from pathlib import Path

import method_effect_design as design
import numpy as np
from method_effect_stats import endpoints, fmt_paired, holm, paired, verdict

from feddifrc_app.outputs import RunDir
from feddifrc_app.results import RoundRow
from feddifrc_app.tools.run_config import app_defaults
from feddifrc_app.tools.sweep import Cell, Flower, Sweep, make_cells, run_sweep

ROOT = design.ROOT

PILOT_SEED = 100
ALPHAS = (0.05, 0.5)
NDCR_PILOT_ROUNDS = 16
ENDPOINT_KEYS = ("primary", "secondary", "final", "best", "last5")


def conf(method: str) -> str:
    return str(ROOT / "conf" / f"mnist5k-{method}.toml")


def settings(args, out: Path) -> dict:
    """The pilot's settings beyond its grid (the comparison's are design.SETTINGS + its grid)."""
    return {
        "num-server-rounds": args.rounds,
        "train.local-epochs": args.epochs,
        "train.lr": args.lr,
        "fraction-train": 0.5,
        "min-nodes": 10,
        "keep-checkpoints": 1,
        "diffusion.cache-dir": str(out.parent / "cache"),
    }


def pilot_cells() -> list[Cell]:
    """FedAvg at two learning rates (the long horizon: --rounds); NDCR-only at two weights with the
    clean view and at weight 1 with the augmented view, over NDCR_PILOT_ROUNDS."""
    cells = make_cells(
        [conf("fedavg")], [PILOT_SEED], {"partition.alpha": list(ALPHAS), "train.lr": [0.02, 0.05]}
    )
    ndcr = {"partition.alpha": [0.5], "num-server-rounds": [NDCR_PILOT_ROUNDS]}
    cells += make_cells(
        [conf("ndcr-only")],
        [PILOT_SEED],
        {**ndcr, "loss.ndcr-weight": [0.1, 1.0], "loss.ndcr-view": ["clean"]},
    )
    cells += make_cells(
        [conf("ndcr-only")],
        [PILOT_SEED],
        {**ndcr, "loss.ndcr-weight": [1.0], "loss.ndcr-view": ["augmented"]},
    )
    return cells


def run_lanes(out: Path, cells: list[Cell], overrides: dict, lanes: int, timeout: float) -> int:
    """Cells dealt round-robin to ``lanes`` sweeps, each with its own folder and local SuperLink."""
    defaults, errors = app_defaults(ROOT), {}

    def lane(i: int) -> None:
        sweep = Sweep(out / f"lane{i}", ROOT, defaults, overrides)
        flower = Flower(
            ROOT, out / f"lane{i}" / "flwr-home", "local", "num-supernodes=10 client-resources-num-cpus=1"
        )
        try:
            errors.update(run_sweep(sweep, cells[i::lanes], flower, timeout))
        finally:
            flower.close()

    threads = [threading.Thread(target=lane, args=(i,)) for i in range(lanes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, why in errors.items():
        print(f"FAILED {name}: {why}")
    return len(errors)


# ------------------------------------------------------------------------------ reading results


def load_runs(out: Path) -> list[dict]:
    """Every finished cell under ``out``: its cell record, results.json and run config."""
    runs = []
    for state in sorted(out.glob("lane*/sweep.json")):
        for name, cell in json.loads(state.read_text())["cells"].items():
            path = state.parent / "runs" / name / "results.json"
            if cell.get("status") != "completed" or not path.is_file():
                continue
            r = RunDir(path.parent).load_results()
            if r.status == "completed":
                config = json.loads((path.parent / "config.json").read_text())
                runs.append({"cell": cell, "results": r, "config": config})
    return runs


TEST, VAL = attrgetter("test_accuracy"), attrgetter("val_accuracy")  # a row's score, for curve()


def curve(run: dict, value: Callable[[RoundRow], float | None]) -> np.ndarray:
    """One score of every trained round, e.g. ``curve(run, TEST)``; NaN for a round the server
    did not score (``server.evaluate-every`` > 1: its row holds null)."""
    return np.array([value(r) for r in run["results"].rounds if r.round >= 1], dtype=float)


def design_arm(cell: dict) -> str | None:
    """The design arm a sweep cell record belongs to (None: not one of this design's)."""
    for arm in design.arms():
        extra = {k: v for k, v in cell["grid"].items() if k not in ("partition.alpha", "num-server-rounds")}
        if Path(cell["conf"]).stem == f"mnist5k-{arm.conf}" and extra == arm.overrides:
            return arm.name
    return None


def entry(run: dict) -> dict:
    """A finished cell as cells.json holds it: enough to redo any analysis, and its identity."""
    return {
        "arm": design_arm(run["cell"]),
        "alpha": run["config"]["partition.alpha"],
        "seed": run["config"]["seed"],
        "val": curve(run, VAL).round(4).tolist(),
        "test": curve(run, TEST).round(4).tolist(),
        "config": design.identity(run["config"]),
        "platforms": run["results"].platforms,  # where it ran: cells compare on one kernel set
    }


def design_cells(new: list[dict], legacy: list[dict]) -> dict[tuple[float, str], dict[int, dict]]:
    """{(alpha, arm): {seed: endpoints}} of every planned cell that is finished or reused."""
    done = {(e["arm"], e["alpha"], e["seed"]): e for e in new}
    by: dict[tuple[float, str], dict[int, dict]] = {}
    for p in design.plan(legacy):
        e = p.reuse if p.reuse is not None else done.get((p.arm.name, p.part.alpha, p.seed))
        if e is not None:
            by.setdefault((p.part.alpha, p.arm.name), {})[p.seed] = endpoints(
                e["val"], e["test"], p.part.window
            )
    return by


def comparisons(by: dict[tuple[float, str], dict[int, dict]]) -> list[dict]:
    """Every declared comparison with its paired tests and Holm-adjusted p (one family per endpoint)."""
    rows = []
    for part in design.PARTITIONS:
        for a, b, what in design.COMPARISONS:
            x, y = by.get((part.alpha, a), {}), by.get((part.alpha, b), {})
            common = sorted(set(x) & set(y))
            row = {"alpha": part.alpha, "what": what, "seeds": common}
            for k in ("primary", "secondary"):
                row[k] = paired([x[s][k] - y[s][k] for s in common])
            rows.append(row)
    for k in ("primary", "secondary"):
        for row, p in zip(rows, holm([r[k]["p"] for r in rows]), strict=True):
            row[k]["p-holm"] = p
    for row in rows:
        row["verdict"] = verdict(row["primary"], row["primary"]["p-holm"])
    return rows


def paired_table(by: dict[tuple[float, str], dict[int, dict]]) -> tuple[str, list[dict]]:
    lines = [
        "| alpha | arm | seeds | primary: test, mean of the window | secondary: test, val-best window | "
        "final / best / mean of last 5 |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for (alpha, arm), cells in sorted(by.items()):
        ms = {k: np.array([e[k] for e in cells.values()]) for k in ENDPOINT_KEYS}
        sd = {k: f"{v.std(ddof=1):.1f}" if len(v) > 1 else "-" for k, v in ms.items()}
        m = {k: f"{v.mean():.1f} ± {sd[k]}" for k, v in ms.items()}
        lines.append(
            f"| {alpha:g} | {arm} | {len(cells)} | {m['primary']} | {m['secondary']} | "
            f"{m['final']} / {m['best']} / {m['last5']} |"
        )
    rows = comparisons(by)
    lines += [
        "",
        "| alpha | comparison | seeds | primary Delta [95% CI] (+/-) | Holm p | verdict | "
        "secondary Delta [95% CI] (+/-) | Holm p |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if len(r["seeds"]) < 2:
            continue
        pr, se = r["primary"], r["secondary"]
        lines.append(
            f"| {r['alpha']:g} | {r['what']} | {len(r['seeds'])} | {fmt_paired(pr)} | {pr['p-holm']:.3f} | "
            f"{r['verdict']} | {fmt_paired(se)} | {se['p-holm']:.3f} |"
        )
    return "\n".join(lines), rows


def plot_curves(entries: list[dict], path: Path) -> None:
    """Mean test accuracy per round of every arm, one panel per alpha (validation dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    alphas = sorted({e["alpha"] for e in entries})
    colour = {arm: f"C{i}" for i, arm in enumerate(sorted({e["arm"] for e in entries}))}
    fig, axes = plt.subplots(1, len(alphas), figsize=(6 * len(alphas), 4), squeeze=False)
    for ax, alpha in zip(axes[0], alphas, strict=True):
        arms: dict[str, list[dict]] = {}
        for e in entries:
            if e["alpha"] == alpha:
                arms.setdefault(e["arm"], []).append(e)
        for arm, es in sorted(arms.items()):
            test = 100 * np.mean([e["test"] for e in es], axis=0)
            val = 100 * np.mean([e["val"] for e in es], axis=0)
            x = np.arange(1, len(test) + 1)
            ax.plot(x, test, label=f"{arm} (n={len(es)})", color=colour[arm])
            ax.plot(x, val, ls="--", lw=0.8, color=colour[arm])
        ax.set_title(f"mnist-5k NID1 alpha={alpha:g}: test (solid), validation (dashed)", fontsize=9)
        ax.set_xlabel("round")
        ax.set_ylabel("accuracy (%), mean over seeds")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def pilot_report(runs: list[dict]) -> str:
    """Validation curves (5-round moving average) and mean validation accuracy of the last 10 rounds."""
    lines = []
    for r in sorted(runs, key=lambda r: (r["cell"]["conf"], json.dumps(r["cell"]["grid"], sort_keys=True))):
        val = 100 * curve(r, VAL)
        ma = np.convolve(val, np.ones(5) / 5, mode="valid")
        flat = next((i + 5 for i in range(len(ma) - 5) if ma[i + 5 :].max() - ma[i] < 1.0), None)
        lines.append(
            f"{Path(r['cell']['conf']).stem:28s} {json.dumps(r['cell']['grid'], sort_keys=True):90s} "
            f"val last-10 {val[-10:].mean():5.1f}  flat from round {flat}  "
            f"val MA5: {' '.join(f'{v:.0f}' for v in ma[::2])}"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ stages


class UsageError(Exception):
    """A flag or file this benchmark cannot use: one line, exit status 2."""


_LEGACY_TYPES = {"arm": (str,), "alpha": (int, float), "seed": (int,), "val": (list,), "test": (list,)}


def read_legacy(path: Path) -> list[dict]:
    """The earlier run's cells.json (``--legacy``): a list of {arm, alpha, seed, val, test} objects."""
    try:
        entries = json.loads(path.read_text())
    except OSError as e:
        raise UsageError(f"--legacy {path}: cannot read it ({e.strerror or e})") from None
    except ValueError as e:
        raise UsageError(f"--legacy {path}: not JSON ({e})") from None
    if not isinstance(entries, list):
        raise UsageError(f"--legacy {path}: expected a list of cells (as in {design.LEGACY_CELLS})")
    for i, e in enumerate(entries):
        bad = [k for k, t in _LEGACY_TYPES.items() if not isinstance(e, dict) or not isinstance(e.get(k), t)]
        if not bad and all(isinstance(x, (int, float)) for x in e["val"] + e["test"]):
            continue
        raise UsageError(
            f"--legacy {path}: cell {i} lacks a valid {', '.join(bad) or 'val/test (numbers)'} "
            f"(each cell: arm, alpha, seed, val and test accuracies, as in {design.LEGACY_CELLS})"
        )
    return entries


def show_plan(legacy: Path) -> list[design.Planned]:
    planned = design.plan(read_legacy(legacy))
    print("\n".join(design.declared_design() + design.plan_text(planned, legacy)), flush=True)
    return planned


def table(out: Path, legacy: Path) -> None:
    """paired.md / paired.json / curves.png / cells.json (this design's finished cells) in ``out``."""
    if not (out / "run").is_dir():  # a typo would print an empty table
        raise UsageError(
            f"--out {out}: no `run` stage here (no {out / 'run'} folder); pass the --out that "
            "`method_effect.py run` wrote into"
        )
    new = [e for e in map(entry, load_runs(out / "run")) if e["arm"] is not None]
    text, rows = paired_table(design_cells(new, read_legacy(legacy)))
    print(text)
    (out / "paired.md").write_text(text + "\n")
    (out / "paired.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out / "cells.json").write_text(json.dumps(new) + "\n")
    if new:
        plot_curves(new, out / "curves.png")


def recheck(args, out: Path, legacy: Path) -> int:
    """Rerun the first reused cell (the earliest seed) with today's code into ``out / recheck``:
    reuse is sound only if its test and validation curves come back as recorded."""
    earlier = next((p for p in design.plan(read_legacy(legacy)) if p.reuse is not None), None)
    if earlier is None:
        print(f"method_effect recheck: the plan reuses no cell of {legacy}; nothing to check")
        return 0
    extra = {**design.SETTINGS, "keep-checkpoints": 1, "diffusion.cache-dir": str(out / "cache")}
    if run_lanes(out / "recheck", [earlier.cell], extra, 1, args.cell_timeout):
        return 1
    again = entry(load_runs(out / "recheck")[0])
    gap = max(float(np.abs(np.subtract(again[k], earlier.reuse[k])).max()) for k in ("test", "val"))
    print(
        f"recheck {earlier.arm.name} alpha {earlier.part.alpha:g} seed {earlier.seed}: largest "
        f"per-round accuracy difference from the reused cell {100 * gap:.2f} points "
        f"({'identical' if gap == 0 else 'NOT identical'})"
    )
    return 0 if gap == 0 else 1


def run(args, out: Path, legacy: Path) -> int:
    if design.NDCR_TARGET is None:
        print(
            "method_effect run: NDCR_TARGET in benchmarks/method_effect_design.py is not set "
            "(pick NDCR's target first)"
        )
        return 2
    planned = show_plan(legacy)
    cells = [p.cell for p in planned if p.reuse is None]
    extra = {**design.SETTINGS, "keep-checkpoints": 1, "diffusion.cache-dir": str(out / "cache")}
    failed = run_lanes(out / "run", cells, extra, args.lanes, args.cell_timeout)
    table(out, legacy)
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("stage", choices=("pilot", "plan", "run", "table", "recheck"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "method_effect"))
    ap.add_argument("--legacy", default=str(design.LEGACY_CELLS), help="the earlier run's cells.json")
    ap.add_argument("--rounds", type=int, default=30, help="pilot only")
    ap.add_argument("--epochs", type=int, default=1, help="pilot only")
    ap.add_argument("--lr", type=float, default=0.05, help="pilot only")
    ap.add_argument("--lanes", type=int, default=1)
    ap.add_argument("--cell-timeout", type=float, default=1800)
    args = ap.parse_args()
    try:
        return stage(args, Path(args.out).resolve(), Path(args.legacy).resolve())
    except UsageError as e:
        print(f"method_effect {args.stage}: error: {e}", file=sys.stderr)
        return 2


def stage(args: argparse.Namespace, out: Path, legacy: Path) -> int:
    if args.stage == "plan":
        show_plan(legacy)
        return 0
    if args.stage == "table":
        table(out, legacy)
        return 0
    if args.stage == "run":
        return run(args, out, legacy)
    if args.stage == "recheck":
        return recheck(args, out, legacy)
    failed = run_lanes(
        out / "pilot", pilot_cells(), settings(args, out / "pilot"), args.lanes, args.cell_timeout
    )
    print(pilot_report(load_runs(out / "pilot")))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
