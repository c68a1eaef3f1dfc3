#!/usr/bin/env python3
"""End-to-end test of the shipped Docker images, on ONE host with a Docker daemon.

    python scripts/docker_e2e.py                 # as root (or a docker-group user with sudo-free chown)

Phases (each bounded by its own timeout; a PASS/FAIL table with timings at the end):

 1. preflight   docker daemon, Compose (v2 `docker compose` or v1 `docker-compose`), flwr, openssl.
 2. bases       Flower's base images flwr/{superlink,supernode,superexec}:<flwr>. Each one that the
                daemon lacks is built locally (Docker Hub is unreachable on many sites): a Debian
                bookworm root file system from `debootstrap` (cached as a tarball), Python 3.11
                from Debian, a venv at /python/venv with flwr at the pinned version, user `app`
                (uid 49999), HOME=WORKDIR=/app, Flower's ENTRYPOINT for each (the layout of
                Flower's framework/docker/base/ubuntu and its superlink/supernode/superexec
                Dockerfiles), plus this machine's CA bundle and pip settings, so that pip inside
                later builds reaches the package registry. Tagged with the official names, so
                docker/ builds unchanged. Images already there are kept.
 3. images      docker/superlink.Dockerfile and docker/superexec.Dockerfile (the CPU image) built as
                docs/deploy.md says, with --network host.
 4. up          certificates (scripts/make_certs.sh), the chown of docs/deploy.md, the topology of
                `docker/make_compose.py --cpu-nodes 2 --loopback` (host network, TLS, SuperNode
                authentication, process isolation, healthchecks) with RUNS_DIR on the host: the
                SuperLink first, the node keys registered, then the rest, until all are healthy.
 5. run         `flwr run .`, FedAvg on all of mnist-5k's training images (LEARNING_CONFIG), judged
                by `flwr ls` (finished:completed) and the results.json in RUNS_DIR: every round
                with both nodes, and the run must learn (`not_learned`: the last round's test
                accuracy at least LEARNED_FLOOR and above round 1's).
 6. kill        a longer run with the packaged teacher (method feddifrc, tiny-mnist, 200 images,
                TEACHER_CONFIG); SuperNode 2's container killed (`docker kill`) in round 2; the run
                must complete with the lost node in results.json. The node is started again once
                the SuperLink lists it offline (a node back within ~1 min of a crash is refused,
                SuperLink 412 / exit 305, until the SuperLink drops the old session; the restart
                policy retries until then).
 7. rejoin      a 1-round run of the same that needs both nodes and gets a reply from each.
 8. down        `compose down -v` (containers and volumes; the images stay cached).

Environment: FEDDIFRC_E2E_CACHE (rootfs tarball, default ~/.cache/feddifrc-e2e),
FEDDIFRC_E2E_DEBIAN_MIRROR (default http://deb.debian.org/debian), FEDDIFRC_E2E_TORCH_INDEX (the
index the CPU image's torch comes from; default the pip registry's index; PyTorch's CPU index
https://download.pytorch.org/whl/cpu where it is reachable, then the build checks it got the CPU
build). Every address is 127.0.0.1; containers and builds use the host network only.
Stdlib only; exit status 0 only if every phase passed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the sibling modules, also when this file is loaded by its path (tests)
    sys.path.insert(0, str(HERE))

from docker_e2e_bases import LocalBases  # noqa: E402
from docker_e2e_host import DOCKER, FLWR_VERSION, Failed, PhaseTimeout  # noqa: E402

CONN = "e2e"  # the flwr connection, in this run's own FLWR_HOME
NODES = 2
KILLED = 2  # the SuperNode killed in the long run (partition-id 1)
APP_UID = 49999  # user `app` of Flower's images

# min-nodes=2 makes every run wait for both SuperNodes; the server scores 200 validation and 200
# test images a round. `run` must learn: FedAvg on all of mnist-5k's 2,500 training images (1,250
# a node, 40 SGD steps a round). `kill` and `rejoin` run the packaged teacher on 200 images (100 a
# node): on all 2,500 a round takes minutes in these CPU containers (docs/deploy.md section 13).
COMMON_CONFIG = (
    "min-nodes=2 fraction-train=1.0 dataset.eval-limit=200 train.local-epochs=1 strategy.round-timeout=300"
)
LEARNING_CONFIG = 'method="fedavg" dataset.train-limit=0'
TEACHER_CONFIG = 'method="feddifrc" diffusion.model="tiny-mnist" dataset.train-limit=200'
RUNS = {"run": (2, LEARNING_CONFIG), "kill": (4, TEACHER_CONFIG), "rejoin": (1, TEACHER_CONFIG)}
MUST_LEARN = ("run",)

# Chance on mnist-5k's 10 classes is 0.10. A run that learns ends at least here, and above its
# round 1 (LEARNING_CONFIG's measured accuracies are in docs/deploy.md section 13).
LEARNED_FLOOR = 0.3

# Each phase's bound, in seconds (cold caches on a 2-core machine; see docs/deploy.md).
# Together at most 78 min (docs/deploy.md has the measured times). `run` trains on 1,250 images
# a node, slow in the CPU containers.
TIMEOUTS = {
    "preflight": 60,
    "bases": 600,
    "images": 1200,
    "up": 420,
    "run": 900,
    "kill": 900,
    "rejoin": 420,
    "down": 180,
}


@dataclass
class Phase:
    name: str
    seconds: float
    ok: bool
    detail: str


class E2E(LocalBases):
    def __init__(self, work: Path, torch_index: str | None, keep_up: bool) -> None:
        super().__init__(work)
        self.torch_index = torch_index
        self.keep_up = keep_up
        self.node_ids: dict[int, int] = {}
        self.phases: list[Phase] = []

    # ------------------------------------------------------------------ phases (bases: LocalBases)

    def preflight(self) -> str:
        for tool in ("docker", "flwr", "openssl"):
            if shutil.which(tool) is None:
                raise Failed(f"{tool} not found on PATH")
        self.sh(["docker", "info"], 30)
        if self.sh(["docker", "compose", "version"], 30, check=False).returncode == 0:
            self.compose = ["docker", "compose"]
        elif shutil.which("docker-compose"):
            self.compose = ["docker-compose"]
        else:
            raise Failed("no Compose: neither `docker compose` (v2) nor `docker-compose` (v1)")
        version = self.sh([*self.compose, "version"], 30).stdout.splitlines()[0]
        return f"compose: {version.strip()}"

    def images(self) -> str:
        index = self.torch_index or self.registry_index()
        cpu_index = index.rstrip("/").endswith("/whl/cpu")
        self.sh(["docker", "build", "--network", "host", "-f", "docker/superlink.Dockerfile",
                 "-t", f"feddifrc-superlink:{FLWR_VERSION}", "docker"], timeout=600)  # fmt: skip
        self.sh(["docker", "build", "--network", "host", "-f", "docker/superexec.Dockerfile",
                 "-t", "feddifrc-superexec:cpu", "--build-arg", f"TORCH_INDEX_URL={index}",
                 "--build-arg", "REQUIRE_CUDA_TORCH=0",
                 "--build-arg", f"REQUIRE_CPU_TORCH={1 if cpu_index else 0}", "."],
                timeout=TIMEOUTS["images"] - 60)  # fmt: skip
        sizes = self.sh(["docker", "image", "ls", "--format", "{{.Repository}}:{{.Tag}} {{.Size}}"], 30)
        ours = [ln for ln in sizes.stdout.splitlines() if ln.startswith(("feddifrc-", "flwr/"))]
        return f"torch from {index}; " + ", ".join(sorted(ours))

    def up(self) -> str:
        self.sh(["bash", "scripts/make_certs.sh", "-n", str(NODES)], 60)
        # docs/deploy.md section 7: the containers run as uid 49999; make_certs.sh writes mode 600.
        certs = DOCKER / "certs"
        private = [certs / "superlink" / "server.key", certs / "superlink" / "superexec.secret"]
        for i in range(1, NODES + 1):
            private += [certs / f"supernode-{i}" / f for f in ("auth.key", "runtime.key", "superexec.secret")]
        self.sh(["chown", f"{APP_UID}:{APP_UID}", *map(str, private)], 30)
        self.runs_dir.mkdir()
        os.chown(self.runs_dir, APP_UID, APP_UID)
        self.sh([sys.executable, "docker/make_compose.py", "--cpu-nodes", str(NODES), "--loopback",
                 "-o", str(self.compose_file)], 30)  # fmt: skip
        self.write_flwr_config(certs / "ca.crt")
        # Containers and volumes an interrupted earlier run left (its SuperLink state knows old keys).
        self.dc("down", "-v", "--remove-orphans", timeout=150)
        # The SuperLink first: a SuperNode whose key is not registered yet is refused and restarts,
        # and `up` would wait on its health before starting the SuperExec that dials it.
        self.dc("up", "-d", "--no-build", "superlink", "superexec-serverapp", timeout=240)
        for i in range(1, NODES + 1):
            answer = self.flwr("supernode", "register", str(certs / f"supernode-{i}" / "auth.key.pub"), CONN)
            if not answer.get("success"):
                raise Failed(f"register supernode-{i}: {answer}")
            self.node_ids[i] = int(answer["node-id"])
        self.dc("up", "-d", "--no-build", timeout=300)
        self.wait(lambda: self.online() == set(self.node_ids.values()), "both SuperNodes online", 120)
        self.wait(self.all_healthy, "every container healthy", 150, every=5)
        return f"node ids {self.node_ids}; {len(self.containers())} containers healthy"

    def write_flwr_config(self, ca: Path) -> None:
        self.flwr_home.mkdir()
        (self.flwr_home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONN}"\n\n[superlink.{CONN}]\n'
            f'address = "127.0.0.1:8000"\nroot-certificates = "{ca}"\n'
        )

    def run_phase(self, phase: str) -> str:
        """A run that needs both nodes; every round must get a reply from each."""
        (rounds, _), name = RUNS[phase], f"e2e-{phase}"
        run_id = self.submit(phase, name)
        info = self.wait_finished(run_id, TIMEOUTS[phase] - 30)
        res = self.results(name)
        self.check_rounds(res, rounds)
        bad = [r for r in res["rounds"][1:] if r["failures"] or sorted(r["nodes"]) != list(range(NODES))]
        if bad:
            raise Failed(f"run {run_id}: rounds without every node or with failures: {bad}")
        if phase in MUST_LEARN and (why := not_learned(res["rounds"])):
            raise Failed(f"run {run_id}: {why}")
        return f"run {run_id} {info['status']}; {self.summary(res)}"

    def kill_phase(self) -> str:
        name = "e2e-kill"
        run_id = self.submit("kill", name)
        self.wait(lambda: self.round_done(name, 1), "round 1 of the long run", 600, run_id=run_id)
        container = self.container(f"supernode-{KILLED}")
        self.sh(["docker", "kill", container], 30)
        t_kill = time.monotonic()
        failed = self.wait(lambda: self.failed_round(name), "the killed node's failure", 420, run_id=run_id)
        killed_id = self.node_ids[KILLED]
        # Started while the SuperLink still holds its session, the node is refused (412); wait
        # until it is listed offline. `docker kill` counts as stopped by hand: no restart by policy.
        self.wait(lambda: killed_id not in self.online(), "the killed node to be offline", 180, every=3)
        self.dc("start", f"supernode-{KILLED}", timeout=60)
        t_start = time.monotonic() - t_kill
        self.wait(lambda: killed_id in self.online(), "the restarted node to be online", 240, every=3)
        restarts = self.sh(["docker", "inspect", "-f", "{{.RestartCount}}", container], 30).stdout.strip()
        info = self.wait_finished(run_id, 600)
        res = self.results(name)
        self.check_rounds(res, RUNS["kill"][0])
        lost = [f for r in res["rounds"] for f in r.get("failures", [])]
        if not lost or any(f["partition-id"] != KILLED - 1 for f in lost):
            raise Failed(f"run {run_id}: failures {lost}, expected partition {KILLED - 1} only")
        return (
            f"run {run_id} {info['status']}; node {killed_id} killed in round 2, failure recorded in "
            f"round {failed} ({lost[0]['reason'][:60]!r}), started {t_start:.0f}s after the kill, "
            f"restarts by policy {restarts}; {self.summary(res)}"
        )

    def down(self) -> str:
        if self.keep_up:
            return f"left up (--keep-up): {shlex.join(self.compose_cmd())}"
        logs = self.dc("logs", "--no-color", "--timestamps", timeout=60, check=False)
        (self.work / "compose.log").write_text(logs.stdout + logs.stderr)
        self.dc("down", "-v", "--remove-orphans", timeout=150)
        return f"containers and volumes removed; logs in {self.work / 'compose.log'}"

    # ------------------------------------------------------------------ runs and nodes

    def submit(self, phase: str, name: str) -> int:
        rounds, config = RUNS[phase]
        cfg = f"{COMMON_CONFIG} {config} num-server-rounds={rounds} run-name='{name}'"
        answer = self.flwr("run", ".", CONN, "--run-config", cfg, timeout=180)
        if not answer.get("success"):
            raise Failed(f"flwr run: {answer}")
        return int(answer["run-id"])

    def status(self, run_id: int) -> str:
        runs = self.flwr("ls", CONN, "--run-id", str(run_id)).get("runs") or [{}]
        return str(runs[0].get("status", "unknown"))

    def wait_finished(self, run_id: int, timeout: float) -> dict[str, Any]:
        self.wait(lambda: self.status(run_id).startswith("finished"), f"run {run_id} to finish", timeout, 5)
        status = self.status(run_id)
        if status != "finished:completed":
            log = self.sh(["flwr", "log", str(run_id), CONN, "--show"], 60, check=False,
                          env={"FLWR_HOME": str(self.flwr_home)})  # fmt: skip
            raise Failed(f"run {run_id} ended {status}:\n{(log.stdout + log.stderr)[-3000:]}")
        return {"status": status}

    def results(self, name: str) -> dict[str, Any]:
        path = self.runs_dir / name / "results.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise Failed(f"no readable results.json at {path}: {e}") from e

    def round_done(self, name: str, n: int) -> bool:
        try:
            return any(r["round"] == n for r in self.results(name)["rounds"])
        except Failed:
            return False  # not written yet

    def failed_round(self, name: str) -> int | None:
        try:
            rounds = self.results(name)["rounds"]
        except Failed:
            return None
        return next((r["round"] for r in rounds if r.get("failures")), None)

    @staticmethod
    def check_rounds(res: dict[str, Any], rounds: int) -> None:
        got = [r["round"] for r in res["rounds"]]
        if got != list(range(rounds + 1)):
            raise Failed(f"results.json has rounds {got}, expected 0..{rounds}")
        if not all(isinstance(r.get("test-accuracy"), float) for r in res["rounds"]):
            raise Failed(f"a round without test-accuracy: {res['rounds']}")

    @staticmethod
    def summary(res: dict[str, Any]) -> str:
        rs = res["rounds"]
        secs = " ".join(f"{r.get('seconds', 0):.0f}s" for r in rs[1:])
        return f"accuracy {rs[0]['test-accuracy']:.2f} -> {rs[-1]['test-accuracy']:.2f}, rounds {secs}"

    def online(self) -> set[int]:
        nodes = self.flwr("supernode", "ls", CONN).get("nodes") or []
        return {int(n["node-id"]) for n in nodes if n.get("status") == "online"}

    def containers(self) -> list[str]:
        return self.dc("ps", "-q", timeout=60).stdout.split()

    def container(self, service: str) -> str:
        ids = self.dc("ps", "-q", service, timeout=60).stdout.split()
        if len(ids) != 1:
            raise Failed(f"service {service}: {len(ids)} containers")
        return ids[0]

    def all_healthy(self) -> bool:
        ids = self.containers()
        cp = self.sh(["docker", "inspect", "-f", "{{.State.Health.Status}}", *ids], 60, check=False)
        states = cp.stdout.split()
        return len(ids) == 2 + 2 * NODES and states == ["healthy"] * len(ids)

    def wait(self, pred: Any, what: str, timeout: float, every: float = 2, run_id: int | None = None) -> Any:
        """Poll ``pred`` until truthy; fail on timeout, or at once if ``run_id`` finished first."""
        deadline = time.monotonic() + timeout
        while True:
            value = pred()
            if value:
                return value
            if run_id is not None and self.status(run_id).startswith("finished"):
                raise Failed(f"run {run_id} finished ({self.status(run_id)}) before {what}")
            if time.monotonic() >= deadline:
                raise Failed(f"timed out after {timeout:.0f}s waiting for {what}")
            time.sleep(every)

    # ------------------------------------------------------------------ driver

    def phase(self, name: str, fn: Any) -> bool:
        print(f"[e2e] {name} ...", flush=True)
        t0 = time.monotonic()
        signal.alarm(TIMEOUTS[name])
        try:
            detail, ok = fn(), True
        except Failed as e:
            detail, ok = str(e), False
        finally:
            signal.alarm(0)
        self.phases.append(Phase(name, time.monotonic() - t0, ok, detail))
        print(
            f"[e2e] {name}: {'ok' if ok else 'FAILED'} in {time.monotonic() - t0:.0f}s: {detail}", flush=True
        )
        return ok

    def main(self) -> int:
        steps = [
            ("preflight", self.preflight),
            ("bases", self.bases),
            ("images", self.images),
            ("up", self.up),
            ("run", lambda: self.run_phase("run")),
            ("kill", self.kill_phase),
            ("rejoin", lambda: self.run_phase("rejoin")),
        ]
        started = False
        for name, fn in steps:
            started = started or name == "up"
            if not self.phase(name, fn):
                break
        if started and self.compose:
            self.phase("down", self.down)
        return self.report()

    def report(self) -> int:
        ok = len(self.phases) > 0 and all(p.ok for p in self.phases) and self.phases[-1].name in ("down",)
        print("\n==== docker e2e " + ("PASS" if ok else "FAIL") + " ====")
        for p in self.phases:
            mark = "ok  " if p.ok else "FAIL"
            print(f"  {mark} {p.name:<10} {p.seconds:7.1f}s  {p.detail.splitlines()[0][:150]}")
        print(f"  total {sum(p.seconds for p in self.phases):.0f}s; log {self.log}")
        return 0 if ok else 1


def not_learned(rounds: list[dict[str, Any]], floor: float = LEARNED_FLOOR) -> str | None:
    """Why a run's results.json ``rounds`` (round 0: the initial model) show no learning; None if
    they do: the last round's test accuracy is at least ``floor`` and above round 1's.

    A deployment that never applies an update stays at round 0's accuracy (chance) and fails.
    Shared with tests/test_deployment.py."""
    acc = {int(r["round"]): r.get("test-accuracy") for r in rounds}
    last = max(acc, default=0)
    if last < 2 or not all(isinstance(acc.get(n), float) for n in (1, last)):
        return f"learning needs test accuracy in round 1 and a later round; rounds {acc}"
    first, end = acc[1], acc[last]
    if end >= floor and end > first:
        return None
    trend = " -> ".join(f"{acc[n]:.3f}" for n in sorted(acc))
    return f"no learning: test accuracy {trend} by round; the last must be >= {floor} and above round 1's"


def _on_alarm(signum: int, frame: Any) -> None:
    raise PhaseTimeout("the phase ran past its timeout")


def _on_term(signum: int, frame: Any) -> None:
    # `timeout` (CI's overall bound) sends SIGTERM: fail the phase, so that `down` still runs.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second one ends the script
    raise Failed("terminated (SIGTERM)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, help="work folder (default: a new /tmp/feddifrc-e2e.*)")
    p.add_argument("--keep-up", action="store_true", help="leave the containers running (debugging)")
    a = p.parse_args(argv)
    work = a.work or Path(tempfile.mkdtemp(prefix="feddifrc-e2e."))
    work.mkdir(parents=True, exist_ok=True)
    os.chmod(work, 0o755)  # RUNS_DIR inside it is bind-mounted for uid 49999
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.signal(signal.SIGTERM, _on_term)
    print(f"[e2e] work folder {work}", flush=True)
    return E2E(work.resolve(), os.environ.get("FEDDIFRC_E2E_TORCH_INDEX"), a.keep_up).main()


if __name__ == "__main__":
    raise SystemExit(main())
