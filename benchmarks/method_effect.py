"""Does FedDifRC help? A paired benchmark on mnist-5k with a pre-declared endpoint.

    python benchmarks/method_effect.py pilot [--out DIR]   # lr, horizon, NDCR options, on VALIDATION
    python benchmarks/method_effect.py run --rounds R [--seeds 6]  # the paired comparison
    python benchmarks/method_effect.py table [--out DIR]           # the paired table from finished cells

Every cell is a real `flwr run .` in Flower's Ray simulation engine (10 simulated SuperNodes,
5 sampled per round, paper NID1 Dirichlet partitions), run through `feddifrc sweep`'s code:
judged by `flwr ls`, resumable, failures recorded. ``--lanes 2`` runs two sweeps side by side
(separate folders and SuperLinks); on 2 cores that thrashed (an NDCR-only cell: 80 s alone,
about 370 s beside another lane), so the default is one.

Design (declared before running):
- Within a seed, every arm sees the same partitions, initial model, sampled clients and
  batches: the comparison is PAIRED by seed.
- Primary endpoint, per seed: Delta = mean TEST accuracy over the last 10 rounds, arm minus
  FedAvg. Reported over seeds as mean, SD, 95% t-interval and sign count. Secondary: test
  accuracy at the round of best VALIDATION accuracy. No best-on-test endpoint.
- "helps" / "hurts" only where the 95% interval excludes 0; otherwise "unresolved".
- Everything chosen (lr, horizon, NDCR weight and view) is read off the validation split
  (mnist-5k's public split) in the pilot, on a seed (100) that the comparison does not use.
- Arms: FedAvg, FedProx, FedNH (fixed class prototypes: the "anchors" control), TDCL-only,
  NDCR-only, FedDifRC with the trained tiny-mnist teacher, and FedDifRC with the untrained
  control teacher. The control and FedProx run on the first 3 seeds (budget); every other arm
  on all of them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
from collections.abc import Callable
from operator import attrgetter
from pathlib import Path

import numpy as np

from feddifrc_app.outputs import RunDir
from feddifrc_app.results import RoundRow
from feddifrc_app.tools.run_config import app_defaults, load_app_config
from feddifrc_app.tools.sweep import Cell, Flower, Sweep, make_cells, run_sweep

ROOT = Path(__file__).resolve().parents[1]

PILOT_SEED = 100
ALPHAS = (0.05, 0.5)
ENDPOINT_ROUNDS = 10  # the primary endpoint averages the last 10 rounds' test accuracy
NDCR_PILOT_ROUNDS = 16


def conf(method: str) -> str:
    return str(ROOT / "conf" / f"mnist5k-{method}.toml")


def settings(args, out: Path) -> dict:
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
    clean view and at weight 1 with the augmented view, over NDCR_PILOT_ROUNDS (what the budget
    of the comparison allows)."""
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


def comparison_cells(seeds: int, control: Path) -> list[Cell]:
    """The core arms (FedAvg, TDCL-only, NDCR-only, FedDifRC) on every seed first, seed by seed,
    then the control teacher on the first 3 seeds, FedNH on every seed and FedProx (a reference
    baseline, not part of the question) on the first 3: a run cut short keeps whole paired seeds
    of the core question."""
    full, half = list(range(seeds)), list(range(min(seeds, 3)))
    alphas = {"partition.alpha": list(ALPHAS)}
    trained = {**alphas, "diffusion.model": ["tiny-mnist"]}
    core = make_cells([conf("fedavg")], full, alphas)
    core += make_cells([conf(m) for m in ("tdcl-only", "ndcr-only", "feddifrc")], full, trained)
    rest = make_cells([conf("feddifrc")], half, {**alphas, "diffusion.model": [str(control)]})
    rest += make_cells([conf("fednh")], full, alphas)
    rest += make_cells([conf("fedprox")], half, alphas)
    return sorted(core, key=lambda c: c.seed) + rest  # stable sorts keep the arm order


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
    """Every finished cell under ``out``: its cell record and results.json."""
    runs = []
    for state in sorted(out.glob("lane*/sweep.json")):
        for name, cell in json.loads(state.read_text())["cells"].items():
            path = state.parent / "runs" / name / "results.json"
            if cell.get("status") != "completed" or not path.is_file():
                continue
            r = RunDir(path.parent).load_results()
            if r.status == "completed":
                runs.append(
                    {
                        "cell": cell,
                        "results": r,
                        "config": json.loads((path.parent / "config.json").read_text()),
                    }
                )
    return runs


def arm_of(run: dict) -> str:
    c = run["config"]
    method = Path(run["cell"]["conf"]).stem.removeprefix("mnist5k-")
    if c["method"] in ("feddifrc", "feddifrc-ssl"):
        teacher = "tiny-mnist" if c["diffusion.model"] == "tiny-mnist" else "control"
        return f"{method} [{teacher}]"
    return method


TEST, VAL = attrgetter("test_accuracy"), attrgetter("val_accuracy")  # a row's score, for curve()


def curve(run: dict, value: Callable[[RoundRow], float | None]) -> np.ndarray:
    """One score of every trained round, e.g. ``curve(run, TEST)``."""
    return np.array([value(r) for r in run["results"].rounds if r.round >= 1], dtype=float)


def endpoints(run: dict) -> dict[str, float]:
    test, s = curve(run, TEST), run["results"].summary
    return {
        "last10": 100 * float(test[-ENDPOINT_ROUNDS:].mean()),
        "at-val-best": 100 * s["test-at-val-best-accuracy"],
        "final": 100 * s["final-accuracy"],
        "best": 100 * s["best-accuracy"],
        "last5": 100 * s["mean-last-5-accuracy"],
    }


def paired(deltas: list[float]) -> dict[str, float]:
    """Mean, SD, 95% t-interval and sign counts of per-seed differences."""
    from scipy import stats

    d = np.asarray(deltas, dtype=float)
    n, mean = len(d), float(d.mean())
    sd = float(d.std(ddof=1)) if n > 1 else math.nan
    half = float(stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)) if n > 1 else math.nan
    return {
        "n": n,
        "mean": mean,
        "sd": sd,
        "lo": mean - half,
        "hi": mean + half,
        "pos": int((d > 0).sum()),
        "neg": int((d < 0).sum()),
    }


def fmt_paired(p: dict[str, float]) -> str:
    return f"{p['mean']:+.1f} [{p['lo']:+.1f}, {p['hi']:+.1f}] ({p['pos']}/{p['neg']})"


def verdict(p: dict[str, float]) -> str:
    if p["n"] < 2 or math.isnan(p["lo"]):
        return "n < 2"
    return "helps" if p["lo"] > 0 else "hurts" if p["hi"] < 0 else "unresolved"


def paired_table(runs: list[dict]) -> tuple[str, dict]:
    by: dict[tuple[float, str], dict[int, dict]] = {}
    for r in runs:
        by.setdefault((r["config"]["partition.alpha"], arm_of(r)), {})[r["config"]["seed"]] = endpoints(r)
    lines = [
        "| alpha | arm | seeds | test, mean of last 10 | final / best / mean of last 5 | "
        "Delta last-10 vs FedAvg [95% CI] (+/-) | verdict | Delta test at val-best [95% CI] (+/-) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    summary: dict = {}
    order = [
        "fedavg",
        "fedprox",
        "fednh",
        "tdcl-only [tiny-mnist]",
        "ndcr-only [tiny-mnist]",
        "feddifrc [tiny-mnist]",
        "feddifrc [control]",
    ]
    for alpha in sorted({a for a, _ in by}):
        base = by.get((alpha, "fedavg"), {})
        for arm in sorted(
            {m for a, m in by if a == alpha}, key=lambda m: (order.index(m) if m in order else 99, m)
        ):
            cells = by[(alpha, arm)]
            ms = {k: np.array([e[k] for e in cells.values()]) for k in ("last10", "final", "best", "last5")}
            sd = lambda v: f"{v.std(ddof=1):.1f}" if len(v) > 1 else "-"  # noqa: E731
            row = [
                f"{alpha:g}",
                arm,
                str(len(cells)),
                f"{ms['last10'].mean():.1f} ± {sd(ms['last10'])}",
                " / ".join(f"{ms[k].mean():.1f} ± {sd(ms[k])}" for k in ("final", "best", "last5")),
            ]
            entry = {"seeds": sorted(cells), **{k: float(v.mean()) for k, v in ms.items()}}
            if arm != "fedavg" and base:
                common = sorted(set(cells) & set(base))
                p1 = paired([cells[s]["last10"] - base[s]["last10"] for s in common])
                p2 = paired([cells[s]["at-val-best"] - base[s]["at-val-best"] for s in common])
                row += [fmt_paired(p1), verdict(p1), fmt_paired(p2)]
                entry |= {"delta-last10": p1, "delta-at-val-best": p2, "verdict": verdict(p1)}
            else:
                row += ["(reference)", "", ""]
            lines.append("| " + " | ".join(row) + " |")
            summary[f"{alpha:g} {arm}"] = entry
    lines += ["", *contrasts_table(by, summary)]
    return "\n".join(lines), summary


# The two questions FedAvg as the reference cannot answer: is the gain the teacher's knowledge
# (trained vs untrained teacher, same method), and is it more than fixed class anchors (FedNH)?
CONTRASTS = (
    ("feddifrc [tiny-mnist]", "feddifrc [control]", "trained vs untrained teacher, FedDifRC"),
    ("tdcl-only [tiny-mnist]", "fednh", "TDCL-only vs fixed class anchors (FedNH)"),
    ("feddifrc [tiny-mnist]", "tdcl-only [tiny-mnist]", "what NDCR adds to TDCL"),
)


def contrasts_table(by: dict[tuple[float, str], dict[int, dict]], summary: dict) -> list[str]:
    """Paired differences between two arms on the seeds both ran (same endpoints as above)."""
    lines = [
        "| alpha | contrast | seeds | Delta last-10 [95% CI] (+/-) | verdict | "
        "Delta test at val-best [95% CI] (+/-) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for alpha in sorted({a for a, _ in by}):
        for a, b, what in CONTRASTS:
            x, y = by.get((alpha, a), {}), by.get((alpha, b), {})
            common = sorted(set(x) & set(y))
            if len(common) < 2:
                continue
            p1 = paired([x[s]["last10"] - y[s]["last10"] for s in common])
            p2 = paired([x[s]["at-val-best"] - y[s]["at-val-best"] for s in common])
            row = [f"{alpha:g}", what, str(len(common)), fmt_paired(p1), verdict(p1), fmt_paired(p2)]
            lines.append("| " + " | ".join(row) + " |")
            summary[f"{alpha:g} {a} - {b}"] = {
                "delta-last10": p1,
                "delta-at-val-best": p2,
                "verdict": verdict(p1),
            }
    return lines


def plot_curves(runs: list[dict], path: Path) -> None:
    """Mean test accuracy per round of every arm, one panel per alpha (validation dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    alphas = sorted({r["config"]["partition.alpha"] for r in runs})
    colour = {arm: f"C{i}" for i, arm in enumerate(sorted({arm_of(r) for r in runs}))}  # same in each panel
    fig, axes = plt.subplots(1, len(alphas), figsize=(6 * len(alphas), 4), squeeze=False)
    for ax, alpha in zip(axes[0], alphas, strict=True):
        arms: dict[str, list[dict]] = {}
        for r in runs:
            if r["config"]["partition.alpha"] == alpha:
                arms.setdefault(arm_of(r), []).append(r)
        for arm, rs in sorted(arms.items()):
            test = 100 * np.mean([curve(r, TEST) for r in rs], axis=0)
            val = 100 * np.mean([curve(r, VAL) for r in rs], axis=0)
            x = np.arange(1, len(test) + 1)
            line = ax.plot(x, test, label=f"{arm} (n={len(rs)})", color=colour[arm])[0]
            ax.plot(x, val, ls="--", lw=0.8, color=line.get_color())
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
    for r in sorted(runs, key=lambda r: (arm_of(r), json.dumps(r["cell"]["grid"], sort_keys=True))):
        val = 100 * curve(r, VAL)
        ma = np.convolve(val, np.ones(5) / 5, mode="valid")
        flat = next((i + 5 for i in range(len(ma) - 5) if ma[i + 5 :].max() - ma[i] < 1.0), None)
        lines.append(
            f"{arm_of(r):28s} {json.dumps(r['cell']['grid'], sort_keys=True):90s} "
            f"val last-10 {val[-10:].mean():5.1f}  flat from round {flat}  "
            f"val MA5: {' '.join(f'{v:.0f}' for v in ma[::2])}"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("stage", choices=("pilot", "run", "table"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "method_effect"))
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--lanes", type=int, default=1)
    ap.add_argument("--cell-timeout", type=float, default=1800)
    args = ap.parse_args()
    out = Path(args.out).resolve() / args.stage if args.stage != "table" else Path(args.out).resolve() / "run"
    if args.stage == "table":
        for stage in ("pilot", "run"):
            runs = load_runs(Path(args.out).resolve() / stage)
            if runs and stage == "pilot":
                print(pilot_report(runs) + "\n")
            elif runs:
                table, summary = paired_table(runs)
                print(table)
                (Path(args.out).resolve() / "paired.json").write_text(json.dumps(summary, indent=1))
                (Path(args.out).resolve() / "paired.md").write_text(table + "\n")
                plot_curves(runs, Path(args.out).resolve() / "curves.png")
                curves = [  # every finished cell's curves: enough to redo any analysis
                    {
                        "arm": arm_of(r),
                        "alpha": r["config"]["partition.alpha"],
                        "seed": r["config"]["seed"],
                        "val": curve(r, VAL).round(4).tolist(),
                        "test": curve(r, TEST).round(4).tolist(),
                    }
                    for r in runs
                ]
                (Path(args.out).resolve() / "cells.json").write_text(json.dumps(curves) + "\n")
        return 0
    from teacher_quality import control_teacher  # the same untrained control as the quality benchmark

    control = control_teacher(load_app_config(ROOT, None), Path(args.out).resolve() / "tiny-mnist-untrained")
    cells = pilot_cells() if args.stage == "pilot" else comparison_cells(args.seeds, control)
    failed = run_lanes(out, cells, settings(args, out), args.lanes, args.cell_timeout)
    runs = load_runs(out)
    print(pilot_report(runs) if args.stage == "pilot" else paired_table(runs)[0])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
