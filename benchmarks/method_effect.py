"""Does FedDifRC help? FedAvg, FedProx, TDCL-only, NDCR-only and FedDifRC on mnist-5k, with the
trained tiny-mnist teacher and its untrained control, over several seeds.

    python benchmarks/method_effect.py [--out DIR] [--seeds 3] [--rounds 15] [--epochs 2]

Every cell is a real `flwr run .` in Flower's Ray simulation engine (10 simulated SuperNodes,
5 sampled per round, paper NID1 Dirichlet partitions) with an isolated FLWR_HOME; success
is read from `flwr ls` (`flwr run` exits 0 on a failed run). Within a seed, every method
sees the same partitions, initial model, sampled clients and batches. Cells are resumable:
a finished one is skipped, an interrupted one continues from its last checkpoint, a failed
one is recorded with its reason and the sweep goes on.

The teacher's features are cached per (teacher, seed) under DIR/cache, so the first cell of
each pays for extraction and the others read the cache. Output: a markdown table of
mean +- std over seeds of the final, best and mean-of-last-5 test accuracy
(DIR/method_effect.md), the raw numbers (DIR/method_effect.json) and accuracy curves
(DIR/method_effect.png).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# method -> run-config overrides. TDCL-only / NDCR-only drop the other term (paper's ablation).
METHODS: dict[str, str] = {
    "fedavg": "method='fedavg'",
    "fedprox": "method='fedavg' strategy.name='fedprox' strategy.proximal-mu=0.01",
    "tdcl-only": "method='feddifrc' loss.ndcr-weight=0.0",
    "ndcr-only": "method='feddifrc' loss.tdcl-weight=0.0",
    "feddifrc": "method='feddifrc'",
}
TEACHER_METHODS = ("tdcl-only", "ndcr-only", "feddifrc")
FEDERATION = "num-supernodes=10 client-resources-num-cpus=1"


@dataclass(frozen=True)
class Cell:
    method: str
    alpha: float
    seed: int
    teacher: str  # "trained" | "control" | "-" (no teacher)

    @property
    def name(self) -> str:
        return f"{self.method}-a{self.alpha:g}-s{self.seed}-{self.teacher}"


def cells(seeds: int, alphas: list[float]) -> list[Cell]:
    out = []
    for seed in range(seeds):
        for alpha in alphas:
            for m in METHODS:
                for teacher in ("trained", "control") if m in TEACHER_METHODS else ("-",):
                    out.append(Cell(m, alpha, seed, teacher))
    return out


class Flower:
    """`flwr` with an isolated FLWR_HOME; stops the local SuperLink it started."""

    def __init__(self, home: Path) -> None:
        self.home = home
        home.mkdir(parents=True, exist_ok=True)
        self.env = {
            **os.environ,
            "FLWR_HOME": str(home),
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FLWR_TELEMETRY_ENABLED": "0",
            "HF_HUB_OFFLINE": "1",
            "NO_COLOR": "1",
        }

    def json(self, *args: str, timeout: float = 300) -> dict:
        cp = subprocess.run(
            ["flwr", *args, "--format", "json"],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        starts = [i for i, line in enumerate(cp.stdout.splitlines()) if line.startswith("{")]
        if not starts:
            raise RuntimeError(
                f"`flwr {' '.join(args)}` printed no JSON: {cp.stdout[-2000:]} {cp.stderr[-2000:]}"
            )
        return json.loads("\n".join(cp.stdout.splitlines()[starts[0] :]))

    def run(self, run_config: str, timeout: float) -> tuple[str, str]:
        """Submit, wait, return (status, log tail)."""
        ans = self.json("run", ".", "local", "--run-config", run_config, "--federation-config", FEDERATION)
        if not ans.get("success"):
            return "submit-failed", json.dumps(ans)[-2000:]
        run_id = str(ans["run-id"])
        deadline = time.monotonic() + timeout
        status = ""
        while time.monotonic() < deadline:
            runs = self.json("ls", "local", "--run-id", run_id).get("runs") or [{}]
            status = str(runs[0].get("status", ""))
            if status.startswith("finished"):
                break
            time.sleep(3)
        else:
            subprocess.run(["flwr", "stop", run_id, "local"], cwd=ROOT, env=self.env, capture_output=True)
            status = "timeout"
        log = subprocess.run(
            ["flwr", "log", run_id, "local", "--show"],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        return status, (log.stdout + log.stderr)[-3000:]

    def close(self) -> None:
        """Stop the SuperLink that `flwr` started for THIS FLWR_HOME: a flower-superlink process
        whose --log-file lies in it (a SuperLink already serving the local port is reused by
        `flwr` and left alone)."""
        log_dir = str(self.home / "local-superlink") + "/"
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if len(argv) > 1 and Path(argv[1]).name == "flower-superlink" and "--log-file" in argv:
                log = argv[argv.index("--log-file") + 1] if argv.index("--log-file") + 1 < len(argv) else ""
                if log.startswith(log_dir):
                    try:
                        os.kill(int(entry.name), signal.SIGTERM)
                    except OSError:
                        pass


def run_config(cell: Cell, args: argparse.Namespace, runs: Path, cache: Path, control: Path) -> str:
    pairs = [
        METHODS[cell.method],
        f"seed={cell.seed}",
        "partition.name='dirichlet'",
        f"partition.alpha={cell.alpha}",
        f"num-server-rounds={args.rounds}",
        f"train.local-epochs={args.epochs}",
        "fraction-train=0.5",
        "min-nodes=10",
        f"outputs-dir='{runs}'",
        f"run-name='{cell.name}'",
        f"diffusion.cache-dir='{cache}'",
        "keep-checkpoints=1",
    ]
    if cell.teacher == "control":
        pairs.append(f"diffusion.model='{control}'")
    if args.overrides:
        pairs.append(args.overrides)
    return " ".join(pairs)


def finished(run_dir: Path, rounds: int) -> dict | None:
    """The cell's results if it ran every round with every sampled client answering, else None."""
    try:
        r = json.loads((run_dir / "results.json").read_text())
    except (OSError, ValueError):
        return None
    complete = r.get("summary") and r["rounds"] and r["rounds"][-1]["round"] == rounds
    return r if complete and not any(row.get("failures") for row in r["rounds"]) else None


def stale(run_dir: Path, cell: Cell, args: argparse.Namespace) -> str:
    """Why an existing run directory does not belong to this cell's settings ("" if it does)."""
    try:
        c = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    want = {
        "num-server-rounds": args.rounds,
        "train.local-epochs": args.epochs,
        "seed": cell.seed,
        "partition.alpha": cell.alpha,
    }
    diff = {k: (c.get(k), v) for k, v in want.items() if c.get(k) != v}
    return f"{run_dir} was made with other settings {diff}: delete it or use another --out" if diff else ""


def summarise(results: dict[str, dict], all_cells: list[Cell]) -> tuple[str, dict]:
    keys = ("final-accuracy", "best-accuracy", "mean-last-5-accuracy")
    groups: dict[tuple, list[dict]] = {}
    for c in all_cells:
        r = results.get(c.name)
        if r is not None:
            groups.setdefault((c.alpha, c.method, c.teacher), []).append(r)
    lines = [
        "| alpha | method | teacher | seeds | final | best | mean of last 5 |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    table = {}
    for (alpha, method, teacher), rs in sorted(
        groups.items(), key=lambda kv: (kv[0][0], list(METHODS).index(kv[0][1]), kv[0][2])
    ):
        vals = {k: np.array([r["summary"][k] for r in rs]) * 100 for k in keys}
        cells_ = " | ".join(
            f"{v.mean():.1f} ± {v.std(ddof=1) if len(v) > 1 else 0:.1f}" for v in vals.values()
        )
        name = {"trained": "tiny-mnist", "control": "untrained control", "-": "none"}[teacher]
        lines.append(f"| {alpha:g} | {method} | {name} | {len(rs)} | {cells_} |")
        table[f"{alpha:g}/{method}/{teacher}"] = {k: [float(x) for x in v] for k, v in vals.items()}
    return "\n".join(lines), table


def plot(results: dict[str, dict], all_cells: list[Cell], alphas: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(alphas), figsize=(6 * len(alphas), 4.2), squeeze=False)
    colours = dict(zip(METHODS, ("tab:grey", "tab:brown", "tab:blue", "tab:green", "tab:red"), strict=False))
    for ax, alpha in zip(axes[0], alphas, strict=False):
        for method in METHODS:
            for teacher in ("trained", "control") if method in TEACHER_METHODS else ("-",):
                rs = [
                    results[c.name]
                    for c in all_cells
                    if (c.method, c.alpha, c.teacher) == (method, alpha, teacher) and c.name in results
                ]
                if not rs:
                    continue
                acc = np.array([[row["test-accuracy"] for row in r["rounds"]] for r in rs]) * 100
                label = method + ("" if teacher != "control" else " (untrained teacher)")
                ax.plot(
                    acc.mean(0), color=colours[method], ls="--" if teacher == "control" else "-", label=label
                )
        ax.set(
            title=f"mnist-5k, Dirichlet alpha = {alpha:g}, mean over seeds",
            xlabel="round",
            ylabel="test accuracy (%)",
        )
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "method_effect"))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--alphas", default="0.05,0.5")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--cell-timeout", type=float, default=1800)
    ap.add_argument("--only", default="", help="comma-separated method names (default: all)")
    ap.add_argument("--teachers", default="trained,control", help="teachers for the teacher methods")
    ap.add_argument(
        "--overrides", default="", help="extra run-config pairs for every cell (use another --out)"
    )
    args = ap.parse_args()
    out = Path(args.out).resolve()
    runs, cache = out / "runs", out / "cache"
    alphas = [float(a) for a in args.alphas.split(",")]
    todo = cells(args.seeds, alphas)
    if args.only:
        todo = [c for c in todo if c.method in args.only.split(",")]
    todo = [c for c in todo if c.teacher == "-" or c.teacher in args.teachers.split(",")]

    from teacher_quality import control_teacher  # the same untrained control as the quality benchmark

    from feddifrc_app.cli import load_app_config

    control = control_teacher(load_app_config(ROOT, None), out / "tiny-mnist-untrained")
    flower = Flower(out / "flwr-home")
    results: dict[str, dict] = {}
    failures: dict[str, str] = {}
    t0 = time.monotonic()
    ran = 0
    try:
        for i, cell in enumerate(todo, 1):
            run_dir = runs / cell.name
            why = stale(run_dir, cell, args)
            if why:
                failures[cell.name] = why
                print(f"[{i}/{len(todo)}] {cell.name}: SKIPPED ({why})", flush=True)
                continue
            done = finished(run_dir, args.rounds)
            if done is None:
                rc = run_config(cell, args, runs, cache, control)
                if any((run_dir / "checkpoints").glob("round-*.pt")):
                    rc += f" resume-from='{run_dir}'"  # interrupted: continue from its last round
                elif run_dir.exists():
                    shutil.rmtree(run_dir)  # started but no round finished: start over
                t_cell = time.monotonic()
                try:
                    status, log = flower.run(rc, args.cell_timeout)
                except (RuntimeError, ValueError, KeyError, subprocess.SubprocessError) as e:
                    status, log = "error", f"{type(e).__name__}: {e}"
                ran += 1
                done = finished(run_dir, args.rounds)
                if status != "finished:completed" or done is None:
                    failures[cell.name] = f"{status}: {log[-600:]}"
                    print(f"[{i}/{len(todo)}] {cell.name}: FAILED ({status})", flush=True)
                    continue
                eta = (
                    (time.monotonic() - t0)
                    / ran
                    * sum(1 for c in todo[i:] if finished(runs / c.name, args.rounds) is None)
                )
                print(
                    f"[{i}/{len(todo)}] {cell.name}: final {done['summary']['final-accuracy']:.4f} "
                    f"({time.monotonic() - t_cell:.0f}s, ETA {eta / 60:.0f} min)",
                    flush=True,
                )
            results[cell.name] = done
    finally:
        flower.close()
    table, numbers = summarise(results, todo)
    header = (
        f"mnist-5k, 10 clients (5 per round), {args.rounds} rounds x {args.epochs} local epochs, "
        f"ResNet-10 width 16, seeds 0..{args.seeds - 1}{', ' + args.overrides if args.overrides else ''}; "
        f"accuracy in % on the 1,000-image test split, mean ± std over seeds"
    )
    text = header + "\n\n" + table + "\n"
    if failures:
        text += (
            "\nFailed cells:\n"
            + "\n".join(f"- {k}: {v.splitlines()[0] if v else ''}" for k, v in failures.items())
            + "\n"
        )
    print("\n" + text)
    out.mkdir(parents=True, exist_ok=True)
    (out / "method_effect.md").write_text(text)
    (out / "method_effect.json").write_text(
        json.dumps(
            {
                "settings": vars(args),
                "table": numbers,
                "failures": failures,
                "wall-seconds": time.monotonic() - t0,
            },
            indent=2,
        )
        + "\n"
    )
    plot(results, todo, alphas, out / "method_effect.png")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
