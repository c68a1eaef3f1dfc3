"""Does FedDifRC help? FedAvg, FedProx, TDCL-only, NDCR-only and FedDifRC on mnist-5k, with the
trained tiny-mnist teacher and its untrained control, over several seeds.

    python benchmarks/method_effect.py [--out DIR] [--seeds 3] [--rounds 12] [--epochs 2]

The same runner as `feddifrc sweep` (feddifrc_app/sweep.py): every cell a real `flwr run .`
in Flower's Ray simulation engine (10 simulated SuperNodes, 5 sampled per round, paper NID1
Dirichlet partitions), judged by `flwr ls`, resumable, failures recorded. Within a seed,
every method sees the same partitions, initial model, sampled clients and batches. The
teacher methods run twice: with the packaged teacher and with its untrained control (same
architecture, 0 training steps). Output: the same table and curves as `feddifrc table`
(DIR/table.md, table.csv, curves.png).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from feddifrc_app.cli import app_defaults, load_app_config  # noqa: E402
from feddifrc_app.report import write_sweep_table  # noqa: E402
from feddifrc_app.sweep import Flower, Sweep, make_cells, run_sweep  # noqa: E402

PLAIN = ("fedavg", "fedprox")
TEACHER = ("tdcl-only", "ndcr-only", "feddifrc")


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
    args = ap.parse_args()
    out = Path(args.out).resolve()
    from teacher_quality import control_teacher  # the same untrained control as the quality benchmark

    control = control_teacher(load_app_config(ROOT, None), out / "tiny-mnist-untrained")
    wanted = set(args.only.split(",")) if args.only else set(PLAIN + TEACHER)
    conf = {m: str(ROOT / "conf" / f"mnist5k-{m}.toml") for m in PLAIN + TEACHER}
    seeds, alphas = list(range(args.seeds)), [float(a) for a in args.alphas.split(",")]
    teachers = [{"trained": "tiny-mnist", "control": str(control)}[t] for t in args.teachers.split(",")]
    cells = make_cells([conf[m] for m in PLAIN if m in wanted], seeds, {"partition.alpha": alphas})
    cells += make_cells(
        [conf[m] for m in TEACHER if m in wanted],
        seeds,
        {"partition.alpha": alphas, "diffusion.model": teachers},
    )
    settings = {
        "num-server-rounds": args.rounds,
        "train.local-epochs": args.epochs,
        "fraction-train": 0.5,
        "min-nodes": 10,
        "keep-checkpoints": 1,
        "diffusion.cache-dir": str(out / "cache"),
    }
    sweep = Sweep(out, ROOT, app_defaults(ROOT), settings)
    flower = Flower(ROOT, out / "flwr-home", "local", "num-supernodes=10 client-resources-num-cpus=1")
    try:
        failures = run_sweep(sweep, cells, flower, args.cell_timeout)
    finally:
        flower.close()
    print(write_sweep_table(out))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
