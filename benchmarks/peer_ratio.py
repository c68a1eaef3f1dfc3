"""The app's FedAvg round against a plain Flower app doing the same work (issue 49, item 4).

Run by hand (not a test), e.g.

    python benchmarks/peer_ratio.py                      # 2 nodes, 6 rounds, one run of each
    python benchmarks/peer_ratio.py --nodes 4 --rounds 8 --repeats 2

The peer is ``benchmarks/peer_app``: Flower's quickstart-pytorch layout (Message API; a ServerApp
running Flower's ``FedAvg`` through ``Strategy.start`` with a central ``evaluate_fn``, a ClientApp
with ``@app.train()``) training the app's ResNet-10 on the app's data and partitions with the
app's SGD settings, and scoring the app's validation and test splits after every round, as the
app does. The app runs ``method = "fedavg"`` with the same run config (``train.local-epochs``,
``num-server-rounds``, ``fraction-train = 1``; ``keep-checkpoints = 0``). Both run in Flower's Ray
simulation (``flwr run <app> local``, ``num-supernodes=N client-resources-num-cpus=1``) on one
local SuperLink with an isolated FLWR_HOME (``tests/flower_procs.py``), the app first, then the
peer (``--repeats`` alternates the order).

A round is timed the same way in both, from the end of one round to the end of the next: the
app's by its round checkpoints' write times (each round ends with its checkpoint, after its
central evaluation; the checkpoint, results.json and plot writes are part of the app's round),
the peer's by the ends of its central evaluations. Rounds 2 and later; the median of each, and
the ratio app / peer (target <= 1.05). The machine's load average is printed beside them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PEER_APP = ROOT / "benchmarks" / "peer_app"
sys.path.insert(0, str(ROOT / "tests"))

from bench_env import load, work_folder  # noqa: E402  (benchmarks/: sys.path[0])
from flower_procs import FlowerProcs  # noqa: E402

from feddifrc_app.config_loader import load_config  # noqa: E402
from feddifrc_app.outputs import RunDir  # noqa: E402
from feddifrc_app.tools.cmd_common import one_line_errors  # noqa: E402
from feddifrc_app.tools.run_config import app_defaults  # noqa: E402
from feddifrc_app.tools.sweep import toml_value  # noqa: E402

TARGET = 1.05


def app_run_config(work: Path, a: argparse.Namespace, run_name: str) -> dict[str, Any]:
    rc = app_defaults(ROOT)
    rc.update(
        {
            "method": "fedavg",
            "num-server-rounds": a.rounds,
            "train.local-epochs": a.local_epochs,
            "fraction-train": 1.0,
            "min-nodes": a.nodes,
            "keep-checkpoints": 0,  # every round's checkpoint stays: its write time ends the round
            "outputs-dir": str(work / "outputs"),
            "run-name": run_name,
        }
    )
    load_config(rc)  # a bad value fails here, not in the run
    return rc


def run_app(procs: FlowerProcs, work: Path, a: argparse.Namespace, k: int) -> dict[str, Any]:
    rc = app_run_config(work, a, f"app-{k}")
    conf = work / f"app-{k}.toml"
    conf.write_text("".join(f"{key} = {toml_value(v)}\n" for key, v in rc.items()))
    run_id = procs.submit_run(ROOT, "local", run_config=str(conf), federation_config=fed(a))
    info = procs.wait_for_run(run_id, "local", timeout=a.timeout)
    if info.get("status") != "finished:completed":
        raise RuntimeError(f"app run {info}\n{procs.run_log(run_id, 'local')[-4000:]}")
    run = RunDir(work / "outputs" / f"app-{k}")
    ends = sorted(p.stat().st_mtime for p in (run.path / "checkpoints").glob("round-*.pt"))
    res = run.load_results()
    return {
        "round-seconds": [b - a for a, b in zip(ends, ends[1:], strict=False)],  # rounds 2..R
        "row-seconds": [r.seconds for r in res.rounds if r.round >= 2],
        "accuracy": res.rounds[-1].test_accuracy,
    }


def run_peer(procs: FlowerProcs, work: Path, a: argparse.Namespace, k: int) -> dict[str, Any]:
    app_config = work / f"peer-{k}-app-config.json"
    app_config.write_text(json.dumps(app_run_config(work, a, f"peer-{k}")))
    out = work / f"peer-{k}.json"
    rc = f"app-config='{app_config}' out-file='{out}'"
    run_id = procs.submit_run(PEER_APP, "local", run_config=rc, federation_config=fed(a))
    info = procs.wait_for_run(run_id, "local", timeout=a.timeout)
    if info.get("status") != "finished:completed":
        raise RuntimeError(f"peer run {info}\n{procs.run_log(run_id, 'local')[-4000:]}")
    got = json.loads(out.read_text())
    return {"round-seconds": got["round-seconds"][1:], "accuracy": got["accuracy"][-1]}  # rounds 2..R


def fed(a: argparse.Namespace) -> str:
    return f"num-supernodes={a.nodes} client-resources-num-cpus=1"


def timed_runs(work: Path, a: argparse.Namespace) -> dict[str, list[float]]:
    """Rounds 2.. of the app's and the peer's runs, ``--repeats`` of each, order alternating."""
    secs: dict[str, list[float]] = {"app": [], "peer": []}
    with FlowerProcs(work / "flower") as procs:
        for k in range(a.repeats):
            order = ("app", "peer") if k % 2 == 0 else ("peer", "app")
            for who in order:
                r = (run_app if who == "app" else run_peer)(procs, work, a, k)
                secs[who] += r["round-seconds"]
                extra = (
                    f"; the app's own row seconds {', '.join(f'{s:.2f}' for s in r['row-seconds'])}"
                    if who == "app"
                    else ""
                )
                times = ", ".join(f"{s:.2f}" for s in r["round-seconds"])
                print(
                    f"  {who} run {k}: rounds 2-{a.rounds} {times} s{extra}; final test accuracy "
                    f"{r['accuracy']:.4f}; load {load()}",
                    flush=True,
                )
    return secs


@one_line_errors("benchmarks/peer_ratio.py")
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=2, help="simulated nodes (all train every round)")
    ap.add_argument("--rounds", type=int, default=6, help="num-server-rounds (rounds 2.. are timed)")
    ap.add_argument("--local-epochs", type=int, default=1, help="train.local-epochs")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each app, order alternating")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    ap.add_argument("--out", type=Path, default=None, help="work folder (default: a temporary one)")
    a = ap.parse_args(argv)
    if a.rounds < 3:
        raise SystemExit("--rounds: at least 3 (rounds 2 and later are timed)")
    with work_folder(a.out, "feddifrc-peer-") as work:
        cfg = load_config(app_run_config(work, a, "check"))
        print(
            f"{a.nodes} nodes, {a.rounds} rounds, {a.local_epochs} local epoch(s): dataset "
            f"{cfg.dataset.name}, {cfg.partition.name} partition, {cfg.model.name} width "
            f"{cfg.model.width}, batch {cfg.train.batch_size}; load {load()}",
            flush=True,
        )
        secs = timed_runs(work, a)
    med = {k: statistics.median(v) for k, v in secs.items()}
    ratio = med["app"] / med["peer"]
    print(f"app FedAvg round: median {med['app']:.2f} s; plain Flower peer: median {med['peer']:.2f} s")
    print(f"peer ratio: {ratio:.3f} (target <= {TARGET}: {'met' if ratio <= TARGET else 'NOT met'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
