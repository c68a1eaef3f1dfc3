"""Per-round time of ONE config in a loopback deployment vs Flower's Ray simulation (issue 5).

Run by hand (not a test), e.g.

    python benchmarks/deploy_vs_sim.py                         # feddifrc, train-limit 300, 4 rounds
    python benchmarks/deploy_vs_sim.py --method fedavg --rounds 6 --train-limit 600

Both modes run the same run config (``method``, ``dataset.train-limit``,
``num-server-rounds``, ``fraction-train=1.0``, ``min-nodes=2``, outputs in a temp folder)
on 2 nodes, each starting with a COLD feature cache:

1. simulation: ``flwr run . local --federation-config "num-supernodes=2
   client-resources-num-cpus=1"`` with a fresh shared ``diffusion.cache-dir``;
2. deployment: ``flower-superlink --insecure`` (this measures time; TLS and node auth are
   tested in tests/test_deployment.py) + 2 ``flower-supernode --insecure`` with
   ``--node-config "partition-id=i num-partitions=2 cache-dir=<fresh per-node dir>"`` and
   ``OMP_NUM_THREADS=1`` (the simulated client's one CPU; Ray sets the same in its actors), and
   ``flwr run . <connection>``.

Printed per mode from its ``results.json``: ``setup-seconds``, ``setup-cache-misses``, every
round's ``seconds`` and the train metrics ``teacher-seconds`` / ``teacher-cache-misses`` (the
strategy's num-examples-weighted mean over nodes), the median round time of rounds >= 2, and
the deployment / simulation ratio of the medians. Also how often "loaded diffusion teacher"
appears in ``flwr log`` (and, in deployment, in the SuperLink and SuperNode logs, where the
ClientApp processes write) in total and AFTER setup. "After setup" = after ``results.json``
first appears (written after round 0's central evaluation, i.e. after the setup exchange); it
must be 0: the feature cache makes every training round SD-free.

3. Flower's floor, on the same SuperLink and SuperNodes right after the deployment run:
   ``benchmarks/floor_app``, a ClientApp that imports torch and replies with a new update of the app
   model's size (no data, no teacher, no model code), timed by a ServerApp with the app's own
   reply poll. Its median round is what Flower 1.42 and torch cost per round by themselves.
4. The training floor: the same floor app with ``sgd-step=true``, whose ClientApp makes its update
   with one ``torch.optim.SGD`` step. A new process's first optimizer imports ``torch._dynamo``
   (1-3 s on 2 cores, measured): torch charges it to every ClientApp process that trains (a
   deployment starts one per message), a simulation's Ray actor once per run, the plain floor never.

The last lines: ``overhead per round`` (deployment minus simulation median),
``flower floor per round`` (the floor app's median deployment round), ``excess over floor``
(their difference: what this app adds to a deployment round beyond its own compute and
Flower's floor), ``training floor per round`` (with torch.optim's first use, the difference of
the two floors) and ``excess over training floor``: what this app adds beyond what Flower and
torch charge any PyTorch ClientApp that trains.

Processes are started and killed by PID by tests/flower_procs.py (isolated FLWR_HOME, free
ports). The machine's load average is printed: the numbers only mean something next to it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from feddifrc_app.outputs import RunDir
from feddifrc_app.records import state_to_record
from feddifrc_app.results import Results
from feddifrc_app.tools.cmd_common import one_line_errors

ROOT = Path(__file__).resolve().parents[1]
FLOOR_APP = ROOT / "benchmarks" / "floor_app"
sys.path.insert(0, str(ROOT / "tests"))

from bench_env import load  # noqa: E402  (benchmarks/: sys.path[0])
from flower_procs import FlowerProcs, free_port  # noqa: E402

NEEDLE = "loaded diffusion teacher"
SIM_CPUS = 1  # per simulated client, and the thread budget of each deployment node
FED = "num-supernodes={n} client-resources-num-cpus=" + str(SIM_CPUS)
CONN = "bench-deploy"


def read_results(path: Path) -> Results | None:
    try:
        return RunDir(path.parent).load_results()
    except (AttributeError, TypeError, ValueError):
        return None


def save_log(work: Path, text: str) -> str:
    (work / "flwr-log.txt").write_text(text)
    return text


def watch(
    procs: FlowerProcs, run_id: int, conn: str, results: Path, *, rounds: int, timeout: float, snapshot
) -> tuple[dict[str, Any], Any]:
    """Wait for the run to finish with few CLI calls (they cost CPU on a small machine).

    ``snapshot()`` is called once, as soon as ``results.json`` exists (setup done); its value is
    returned with the final ``flwr ls`` record.
    """
    deadline, next_ls, snap = time.monotonic() + timeout, time.monotonic() + 30, None
    while time.monotonic() < deadline:
        res = read_results(results)
        if res is not None and snap is None:
            snap = snapshot()
        done = res is not None and any(r.round == rounds for r in res.rounds)
        if done or time.monotonic() > next_ls:
            info = procs.run_info(run_id, conn)
            if str(info.get("status", "")).startswith("finished"):
                return info, snap
            next_ls = time.monotonic() + (2 if done else 30)
        time.sleep(0.25)
    raise TimeoutError(f"run {run_id} not finished after {timeout}s\n{procs.run_log(run_id, conn)[-4000:]}")


def run_app(
    procs: FlowerProcs, work: Path, conn: str, a: argparse.Namespace, mode: str, counts=dict, **submit
) -> dict[str, Any]:
    """Submit this app (``submit``: its run and federation config) and watch it to the end: its
    status, wall time and results, and the teacher loads its logs show at setup and in all
    (``counts()``: the loads in the processes' own logs, beside ``flwr log``'s)."""
    results = work / "outputs" / mode / "results.json"

    def loads(log: str) -> dict[str, int]:
        return {"flwr log": log.count(NEEDLE), **counts()}

    t0 = time.monotonic()
    run_id = procs.submit_run(ROOT, conn, **submit)
    info, at_setup = watch(
        procs,
        run_id,
        conn,
        results,
        rounds=a.rounds,
        timeout=a.timeout,
        snapshot=lambda: loads(procs.run_log(run_id, conn)),
    )
    wall = time.monotonic() - t0
    total = loads(save_log(work, procs.run_log(run_id, conn)))
    return {
        "info": info,
        "wall": wall,
        "results": read_results(results),
        "loads": total,
        "loads-at-setup": at_setup,
    }


def run_simulation(work: Path, rc: str, a: argparse.Namespace) -> dict[str, Any]:
    rc += f" outputs-dir='{work / 'outputs'}' run-name='sim' diffusion.cache-dir='{work / 'cache'}'"
    # Ray prints a repeated actor log line (the 2nd actor's "loaded ...") only when its dedup
    # buffer flushes, possibly after setup: print each line as it comes, so the split is right.
    with FlowerProcs(work / "flower", extra_env={"RAY_DEDUP_LOGS": "0"}) as procs:
        fed = FED.format(n=a.nodes)
        return run_app(procs, work, "local", a, "sim", run_config=rc, federation_config=fed)


def run_deployment(work: Path, rc: str, a: argparse.Namespace) -> dict[str, Any]:
    out = work / "outputs"
    rc += f" outputs-dir='{out}' run-name='deploy'"  # no diffusion.cache-dir: the node config's wins
    with FlowerProcs(work / "flower") as procs:
        logs = start_deployment(procs, work, a.nodes)

        def counts() -> dict[str, int]:
            return {p.name: p.text().count(NEEDLE) for p in logs}

        got = run_app(procs, work, CONN, a, "deploy", counts, run_config=rc)
        floor = {step: run_floor(procs, work, out / "deploy", a, sgd_step=step) for step in (False, True)}
    return {**got, "floor": floor}


def start_deployment(procs: FlowerProcs, work: Path, n: int) -> list:
    """A SuperLink and ``n`` SuperNodes on loopback ports, online; their processes (the logs)."""
    port = free_port()
    procs.start(
        "superlink",
        [
            "flower-superlink",
            "--insecure",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--disable-runtime-dependency-installation",
        ],
        ready_port=port,
    )
    procs.add_connection(CONN, f"127.0.0.1:{port}", insecure=True)
    nodes = []
    for i in range(n):
        rport = free_port()
        node_cfg = f'partition-id={i} num-partitions={n} cache-dir="{work / f"cache-{i}"}"'
        nodes.append(
            procs.start(
                f"supernode-{i}",
                [
                    "flower-supernode",
                    "--insecure",
                    "--superlink",
                    f"127.0.0.1:{port}",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(rport),
                    "--node-config",
                    node_cfg,
                ],
                ready_port=rport,
                # The simulated client's CPU budget (client-resources-num-cpus=1: Ray sets
                # OMP_NUM_THREADS=1 in its actors), inherited by every ClientApp process:
                # two 2-thread processes on 2 cores measured a 3 s first step instead of 0.75 s.
                env={"OMP_NUM_THREADS": str(SIM_CPUS)},
            )
        )
    procs.wait_for_nodes_online(CONN, n, timeout=90)
    return [procs.procs["superlink"], *nodes]


def update_shapes(run_dir: Path) -> str:
    """The app's update layout, as the floor app's ``shapes``: every array the ClientApp sends (the
    saved global model's travelling entries), in order. Flower moves each array as its own objects,
    so the floor must send as many arrays of the same sizes, not one of the same total."""
    last = sorted((run_dir / "checkpoints").glob("round-*.pt"))[-1]
    state = torch.load(last, map_location="cpu", weights_only=False)["model"]
    return ",".join("x".join(map(str, a.shape)) for a in state_to_record(state).values())


def run_floor(
    procs: FlowerProcs, work: Path, run_dir: Path, a: argparse.Namespace, sgd_step: bool
) -> list[float]:
    """The floor app's round times on the deployment that just ran the app; ``sgd_step``: the
    training floor (each reply one ``torch.optim.SGD`` step, as a ClientApp that trains pays)."""
    out = work / f"floor-sgd-{str(sgd_step).lower()}.json"
    rc = (
        f"num-server-rounds={a.rounds} shapes='{update_shapes(run_dir)}' min-nodes={a.nodes} "
        f"sgd-step={str(sgd_step).lower()} out-file='{out}'"
    )
    run_id = procs.submit_run(FLOOR_APP, CONN, run_config=rc)
    info = procs.wait_for_run(run_id, CONN, timeout=a.timeout)
    if info.get("status") != "finished:completed":
        raise RuntimeError(f"floor app run {info}\n{procs.run_log(run_id, CONN)[-4000:]}")
    return json.loads(out.read_text())["round-seconds"]


def report(mode: str, r: dict[str, Any]) -> float | None:
    res: Results | None = r["results"]
    print(f"\n== {mode}: status {r['info'].get('status')}, submit -> finished {r['wall']:.1f}s")
    if not res:
        print("   no results.json")
        return None
    setup = res.setup_seconds if res.setup_seconds is not None else float("nan")
    print(f"   setup-seconds {setup:.2f}, setup-cache-misses {res.extra.get('setup-cache-misses')}")
    print("   round  seconds  teacher-seconds  teacher-cache-misses  test-accuracy  failures")
    secs = {}
    for row in res.rounds[1:]:
        m = row.train_metrics or {}
        secs[row.round] = row.seconds
        print(
            f"   {row.round:5d}  {row.seconds:7.2f}  {m.get('teacher-seconds', float('nan')):15.3f}  "
            f"{m.get('teacher-cache-misses', float('nan')):20.1f}  {row.test_accuracy:13.4f}  "
            f"{len(row.failures)}"
        )
    later = [s for k, s in secs.items() if k >= 2]
    med = statistics.median(later) if later else None
    print(f"   median round time (rounds >= 2): {med:.2f}s" if med is not None else "   (no round >= 2)")
    after = {k: v - (r["loads-at-setup"] or {}).get(k, 0) for k, v in r["loads"].items()}
    print(
        f"   {NEEDLE!r}: total {r['loads']}, after setup {after} -> "
        f"{'OK, none after setup' if not any(after.values()) else 'TEACHER LOADED AFTER SETUP'}"
    )
    return med


def report_overhead(m_sim: float | None, m_dep: float | None, floor: dict[bool, list[float]]) -> None:
    """The floor app's rounds, and the deployment's overhead per round against both floors."""
    floors = {}
    for step, label in ((False, "Flower's floor"), (True, "the training floor (+ one torch.optim step)")):
        secs = floor[step]
        print(f"\n== {label}, benchmarks/floor_app on the same deployment: round seconds", end=" ")
        print(", ".join(f"{s:.2f}" for s in secs))
        floors[step] = statistics.median(secs[1:] or secs)  # rounds >= 2, as for the app
    if m_sim and m_dep:
        over = m_dep - m_sim
        print(
            f"\nmedian round time (rounds >= 2): deployment {m_dep:.2f}s / simulation {m_sim:.2f}s "
            f"= {m_dep / m_sim:.2f}x"
        )
        print(f"overhead per round: {over:.2f} s")
        print(f"flower floor per round: {floors[False]:.2f} s")
        print(f"excess over floor: {over - floors[False]:.2f} s")
        print(
            f"training floor per round: {floors[True]:.2f} s "
            f"(torch.optim first use: {floors[True] - floors[False]:.2f} s)"
        )
        print(f"excess over training floor: {over - floors[True]:.2f} s")


@one_line_errors("benchmarks/deploy_vs_sim.py")
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="feddifrc", help="method (default: feddifrc, the app default)")
    ap.add_argument("--rounds", type=int, default=4, help="num-server-rounds")
    ap.add_argument("--train-limit", type=int, default=300, help="dataset.train-limit")
    ap.add_argument("--nodes", type=int, default=2, help="SuperNodes / simulated nodes")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    ap.add_argument("--keep", action="store_true", help="keep the temp folder (logs, results) and print it")
    a = ap.parse_args(argv)

    rc = (
        f"method='{a.method}' dataset.train-limit={a.train_limit} num-server-rounds={a.rounds} "
        f"fraction-train=1.0 min-nodes={a.nodes}"
    )
    from feddifrc_app.tools.run_config import load_app_config

    load_app_config(ROOT, [rc])  # a bad flag fails here, in one line, before any Flower process
    tmp = tempfile.mkdtemp(prefix="feddifrc-deploy-vs-sim-")
    work = Path(tmp)
    print(f"config: {rc}, {a.nodes} nodes, cold cache per mode; work dir {work}")
    print(f"load average before: {load()}")
    sim = run_simulation(work / "sim", rc, a)
    print(f"load average after simulation: {load()}")
    dep = run_deployment(work / "deploy", rc, a)
    print(f"load average after deployment: {load()}")

    report_overhead(report("simulation", sim), report("deployment", dep), dep["floor"])
    if a.keep:
        print(f"kept: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    ok = all(str(r["info"].get("status")) == "finished:completed" for r in (sim, dep))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
