"""The GPU check's Flower sections (``benchmarks/gpu_check.py``; docs/gpu-check.md).

G. one FedDifRC round of this app in Flower's deployment engine on loopback, WITHOUT Ray: a
   ``flower-superlink --insecure`` and two ``flower-supernode --insecure`` on 127.0.0.1 ports,
   ``flwr run`` of the checkout, each ClientApp on the GPU (``train.device`` and
   ``diffusion.device`` = ``cuda``: a node without one fails the round), on the CPU in a dry run.
   The processes are started and killed by PID by the test suite's launcher
   (``tests/flower_procs.py``: isolated FLWR_HOME, free ports); their log tails go to
   ``<--out>/flower-logs/``.
I. (``--simulation``) a 2-round FedDifRC simulation through ``feddifrc sweep``: needs ray too.

Both need flwr; without it they are a SKIP naming it. The dataset is scikit-learn's ``digits``
and the teacher the packaged ``tiny-mnist`` (by its folder: a FAB carries no weights), so a bare
host needs nothing downloaded.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONN = "gpu-check"
NODES = 2
DEPLOY_SHARE_S = 150.0  # G's own time on a GPU: held back from the sections before it
DRY_RUN_CAP_S = 600.0  # G's most on a CPU (a dry run's deadline may be far): then it is a FAIL
LOG_TAIL_BYTES = 40_000  # of each Flower process log, copied into --out
TEACHER = ROOT / "feddifrc_app" / "teachers" / "tiny-mnist"
BINARIES = ("flower-superlink", "flower-supernode", "flower-superexec")
# What a SuperLink or SuperNode logs when a ServerApp / ClientApp process made its first request
# more than Flower's 30 s after its launch (HEARTBEAT_DEFAULT_INTERVAL): a CPU too loaded to start it
MISSED_START = "Runtime task-token authentication failed"


def script_path() -> str:
    """PATH with the console-script folders of this interpreter first: ``pip install`` puts
    ``flower-superlink`` there (or in the user scheme's, for a ``--user`` install), which PATH
    may lack; the SuperNode starts ``flower-superexec`` by name from the PATH it is given."""
    dirs = [str(Path(sys.executable).parent), sysconfig.get_path("scripts")]
    try:
        dirs.append(sysconfig.get_path("scripts", f"{os.name}_user"))
    except KeyError:
        pass
    return os.pathsep.join(dict.fromkeys([*dirs, os.environ.get("PATH", "")]))


def deploy_run_config(out: Path, device: str, dry: bool, timeout_s: float = 120.0) -> str:
    """One FedDifRC round on both nodes: digits (scikit-learn's, no download), the packaged
    tiny-mnist teacher by its folder, the teacher and the training on ``device``; a node that
    does not answer within ``timeout_s`` is the round's failure, not an hour's wait."""
    limit = 60 if dry else 0  # 0: every training image; 60: 30 a node, the extraction a few seconds
    wait = f"{max(float(timeout_s), 30.0):.0f}"
    return (
        f'method="feddifrc" dataset.name="digits" num-server-rounds=1 dataset.train-limit={limit} '
        f"dataset.eval-limit=200 train.local-epochs=1 fraction-train=1.0 min-nodes={NODES} "
        f'train.device="{device}" diffusion.device="{device}" diffusion.model="{TEACHER}" '
        f"strategy.setup-timeout={wait} strategy.round-timeout={wait} "
        f'outputs-dir="{out}" run-name="gpu-check"'
    )


def section_deploy(c) -> None:
    """G: SuperLink + two SuperNodes on loopback, ``flwr run``, one round; PASS when the run
    finished completed with round 1 in results.json and every node's teacher on the device."""
    import flwr  # noqa: F401  a SKIP naming it when absent

    path = script_path()
    missing = [b for b in BINARIES if shutil.which(b, path=path) is None]
    if missing:
        c.judge("Flower deployment", missing, False, "flower-superlink, -supernode, -superexec found",
                f"not found on PATH or beside {sys.executable}: {', '.join(missing)}")  # fmt: skip
        return
    if str(ROOT / "tests") not in sys.path:
        sys.path.append(str(ROOT / "tests"))
    from flower_procs import FlowerProcs

    budget = min(c.left(), DRY_RUN_CAP_S if c.dry else DEPLOY_SHARE_S)
    work = Path(tempfile.mkdtemp(prefix="feddifrc-gpu-check-deploy-"))
    procs = FlowerProcs(work / "flower", extra_env={"PATH": path})
    try:
        got = _deploy(c, procs, work, time.monotonic() + max(budget, 60.0))
        got["missed_start"] = any(MISSED_START in p.text() for p in procs.procs.values())
    finally:
        procs.close()
        _keep_logs(procs, c.out_dir / "flower-logs")
        shutil.rmtree(work, ignore_errors=True)
    _judge_deploy(c, got)


def _deploy(c, procs, work: Path, deadline: float) -> dict[str, Any]:
    """Start the SuperLink and the SuperNodes, run the app once; the times and results.json."""
    from flower_procs import free_port

    t0 = time.monotonic()
    port = free_port()
    link = ["flower-superlink", "--insecure", "--host", "127.0.0.1", "--port", str(port)]
    procs.start("superlink", link, ready_port=port, timeout=120)
    procs.add_connection(CONN, f"127.0.0.1:{port}", insecure=True)
    threads = {"OMP_NUM_THREADS": "1"} if c.dry else {}  # a dry run shares a few CPU cores
    for i in range(NODES):
        rport = free_port()
        node_cfg = f'partition-id={i} num-partitions={NODES} cache-dir="{work / f"cache-{i}"}"'
        argv = ["flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{port}"]
        argv += ["--host", "127.0.0.1", "--port", str(rport), "--node-config", node_cfg]
        procs.start(f"supernode-{i}", argv, ready_port=rport, timeout=120, env=threads)
    procs.wait_for_nodes_online(CONN, NODES, timeout=120)
    up = time.monotonic() - t0
    out = work / "outputs"
    left = deadline - time.monotonic()
    rc = deploy_run_config(out, c.device.type, c.dry, timeout_s=min(left * 0.75, 600.0))
    t1 = time.monotonic()
    run_id = procs.submit_run(ROOT, CONN, run_config=rc, timeout=120)
    wait = max(deadline - time.monotonic(), 30.0)
    try:
        status = str(procs.wait_for_run(run_id, CONN, timeout=wait).get("status"))
    except (TimeoutError, subprocess.TimeoutExpired):  # its message asks `flwr log`: not again
        status = f"not finished within {wait:.0f} s"
    from feddifrc_app.outputs import RunDir

    log = procs.logs / f"run-{run_id}.log"  # the ServerApp's log, streamed by wait_for_run
    return {
        "status": status,
        "up_s": up,
        "run_s": time.monotonic() - t1,
        "results": RunDir(out / "gpu-check").load_results(),
        "log": log.read_text(errors="replace")[-2000:] if log.is_file() else "",
    }


def _judge_deploy(c, got: dict[str, Any]) -> None:
    from feddifrc_app.tools.report import teacher_of

    res, want = got["results"], c.device.type
    rounds = [r for r in (res.rounds if res else []) if r.round == 1]
    failures = rounds[0].failures if rounds else None
    devices = teacher_of(res).get("devices", {}) if res else {}
    on_device = bool(devices) and all(d.split()[0] == want for d in devices)
    c.data["G"] = {
        "status": got["status"],
        "nodes_up_s": got["up_s"],
        "run_s": got["run_s"],
        "setup_s": res.setup_seconds if res else None,
        "round_s": rounds[0].seconds if rounds else None,
        "test_accuracy": rounds[0].test_accuracy if rounds else None,
        "teacher_devices": devices,
    }
    c.add("SuperLink + 2 SuperNodes online", got["up_s"], f"{got['up_s']:.1f} s (--insecure, loopback)")
    ok = got["status"] == "finished:completed" and bool(rounds) and not failures and on_device
    d = c.data["G"]
    where = ", ".join(f"{k} (partitions {v})" for k, v in devices.items()) or "not recorded"
    text = (
        f"{got['status']} in {got['run_s']:.0f} s; teachers on {where}; setup {d['setup_s'] or 0:.1f} s, "
        f"round 1 {d['round_s'] or 0:.1f} s, test accuracy {d['test_accuracy'] or 0:.3f}"
    )
    if not ok:
        if got.get("missed_start"):
            text += f"; the logs say {MISSED_START!r}: a process started too slowly (a loaded CPU)"
        text += f"; failures {failures}; log: {' '.join(got['log'].split()[-40:])}"
    bound = f"finished:completed, round 1 without failures, every teacher on {want}"
    c.judge("one FedDifRC round, deployment engine (no Ray)", got["status"], ok, bound, text)


def _keep_logs(procs, dest: Path) -> None:
    """The tail of every Flower process log (the ClientApps write to their SuperNode's)."""
    dest.mkdir(parents=True, exist_ok=True)
    for p in procs.procs.values():
        with open(p.log, "rb") as f:
            f.seek(max(p.log.stat().st_size - LOG_TAIL_BYTES, 0))
            (dest / p.log.name).write_bytes(f.read())
    for log in procs.logs.glob("run-*.log"):
        (dest / log.name).write_bytes(log.read_bytes()[-LOG_TAIL_BYTES:])


def section_simulation(c) -> None:
    """I (--simulation): a 2-round FedDifRC simulation through ``feddifrc sweep``, two ClientApps
    sharing the GPU (``client-resources-num-gpus = 0.5``); needs flwr and ray."""
    if not c.args.simulation:
        c.skip("Flower simulation", "not asked for (--simulation; needs flwr and ray)")
        return
    import flwr  # noqa: F401  a SKIP naming them when absent
    import ray  # noqa: F401

    from feddifrc_app.tools import cli

    out = Path(tempfile.mkdtemp(prefix="feddifrc-gpu-check-sim-"))
    conf = out / "gpu-check.toml"
    dev = c.device.type
    lines = [
        'method = "feddifrc"',
        'dataset.name = "mnist-5k"',
        f'train.device = "{dev}"',
        f'diffusion.device = "{dev}"',
    ]
    conf.write_text("\n".join(lines) + "\n")
    argv = [
        "sweep", str(conf), "--seeds", "1", "--app", str(ROOT), "--out", str(out / "sweep"),
        "--set", f"num-server-rounds={1 if c.dry else 2} dataset.train-limit={60 if c.dry else 1000}",
        "--federation-config", f"num-supernodes=2 client-resources-num-gpus={0 if c.dry else 0.5}",
    ]  # fmt: skip
    t0 = time.perf_counter()
    rc = cli.main(argv)
    c.judge(
        "Flower simulation", rc, rc == 0, "exit 0", f"exit {rc} in {time.perf_counter() - t0:.0f} s; {out}"
    )
