"""A loopback deployment in the shipped topology: TLS, SuperNode auth, `flwr run`, a node lost mid-run.

The processes and flags are those of docker/compose.yml (but the SuperLink keeps its state in
memory, not in ``--database``: see deploy()), on 127.0.0.1 at ports chosen at
run time under an isolated FLWR_HOME: ``flower-superlink --isolation process`` with TLS
(certificates and SuperExec secrets from ``scripts/make_certs.sh``),
``--enable-supernode-auth`` and ``--superexec-auth-secret-file``; a ``flower-superexec``
that runs the ServerApp, dialling the SuperLink's Runtime API over TLS with the secret;
two ``flower-supernode --isolation process`` whose public keys are registered with ``flwr
supernode register``, each with a TLS Runtime API, its own secret and ``--node-config
"partition-id=i num-partitions=2 cache-dir=..."``, and next to each the ``flower-superexec``
that runs its ClientApps; a third SuperNode with an unregistered key. Every Flower process
serves the gRPC health service the compose healthchecks probe. All are killed by PID, with
their children, even when a test fails (tests/flower_procs.py).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from flower_procs import FlowerProc, FlowerProcs, cmdline, descendants, free_port

ROOT = Path(__file__).resolve().parents[1]
MAKE_CERTS = ROOT / "scripts" / "make_certs.sh"
CONN = "deploy-test"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("flower-superlink") is None or shutil.which("flower-supernode") is None,
        reason="flower-superlink / flower-supernode are not installed",
    ),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="make_certs.sh needs openssl"),
]


def make_certs(out: Path, nodes: int, *sans: str) -> Path:
    subprocess.run(
        ["bash", str(MAKE_CERTS), "-o", str(out), "-n", str(nodes), *sans],
        check=True,
        capture_output=True,
        text=True,
    )
    return out


@dataclass
class Deployment:
    """A TLS + SuperNode-auth SuperLink on 127.0.0.1 and the SuperNodes started against it."""

    procs: FlowerProcs
    certs: Path
    port: int
    health_port: int  # the SuperLink's gRPC health service
    node_ids: dict[int, int] = field(default_factory=dict)  # supernode index -> registered id
    runtime_ports: dict[int, int] = field(default_factory=dict)  # supernode index -> Runtime API port

    def register(self, i: int) -> int:
        """`flwr supernode register` supernode-i's public key; returns the node id."""
        answer = self.procs.flwr_json(
            ["supernode", "register", str(self.certs / f"supernode-{i}" / "auth.key.pub"), CONN]
        )
        assert answer.get("success"), answer
        self.node_ids[i] = int(answer["node-id"])
        return self.node_ids[i]

    def start_supernode(self, i: int, num_partitions: int, cache_root: Path) -> FlowerProc:
        """SuperNode i (partition i-1): TLS to the SuperLink, its auth key, a TLS Runtime API
        for its SuperExec (process isolation, shared secret)."""
        node_dir = self.certs / f"supernode-{i}"
        self.runtime_ports[i] = runtime_port = free_port()
        cache = cache_root / f"cache-{i}"
        argv = [
            "flower-supernode",
            "--superlink", f"127.0.0.1:{self.port}",
            "--root-certificates", str(self.certs / "ca.crt"),
            "--auth-supernode-private-key", str(node_dir / "auth.key"),
            "--isolation", "process",
            "--host", "127.0.0.1",
            "--port", str(runtime_port),
            "--ssl-certfile", str(node_dir / "runtime.pem"),
            "--ssl-keyfile", str(node_dir / "runtime.key"),
            "--ssl-ca-certfile", str(self.certs / "ca.crt"),
            "--superexec-auth-secret-file", str(node_dir / "superexec.secret"),
            "--node-config",
            f'partition-id={i - 1} num-partitions={num_partitions} cache-dir="{cache}"',
        ]  # fmt: skip
        return self.procs.start(f"supernode-{i}", argv, ready_port=runtime_port)

    def start_superexec(self, name: str, runtime_port: int, secret: Path) -> FlowerProc:
        """A SuperExec on a Runtime API (TLS, the shared secret); ready once its health server is."""
        health = free_port()
        argv = [
            "flower-superexec",
            "--runtime-api-address", f"127.0.0.1:{runtime_port}",
            "--root-certificates", str(self.certs / "ca.crt"),
            "--superexec-auth-secret-file", str(secret),
            "--health-server-address", f"127.0.0.1:{health}",
        ]  # fmt: skip
        return self.procs.start(name, argv, ready_port=health)

    def start_node(self, i: int, num_partitions: int, cache_root: Path) -> None:
        """A GPU machine of docker/compose.supernode.yml: SuperNode i and its ClientApp SuperExec."""
        self.start_supernode(i, num_partitions, cache_root)
        secret = self.certs / f"supernode-{i}" / "superexec.secret"
        self.start_superexec(f"superexec-clientapp-{i}", self.runtime_ports[i], secret)


@contextlib.contextmanager
def deploy(workdir: Path, registered: int = 2, total_keys: int = 3) -> Iterator[Deployment]:
    """SuperLink (TLS, --enable-supernode-auth) with `registered` keys registered, nodes online."""
    certs = make_certs(workdir / "certs", total_keys)
    with FlowerProcs(workdir / "flower") as procs:
        try:
            port, health = free_port(), free_port()
            procs.start(
                "superlink",
                [
                    "flower-superlink",
                    "--isolation",
                    "process",
                    "--ssl-ca-certfile",
                    str(certs / "ca.crt"),
                    "--ssl-certfile",
                    str(certs / "superlink" / "server.pem"),
                    "--ssl-keyfile",
                    str(certs / "superlink" / "server.key"),
                    "--enable-supernode-auth",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    # No --database (compose's one deviation): state in memory. With SQLite, a write
                    # that waits past Flower's fixed 5 s busy_timeout (a starved 2-core machine) is
                    # a 500 on push-object, and the SuperNode drops that reply for good (docs/deploy.md
                    # section 9). Persistence is checked statically by test_docker_files.
                    "--disable-runtime-dependency-installation",
                    "--superexec-auth-secret-file",
                    str(certs / "superlink" / "superexec.secret"),
                    "--health-server-address",
                    f"127.0.0.1:{health}",
                ],  # fmt: skip
                ready_port=port,
            )
            procs.add_connection(CONN, f"127.0.0.1:{port}", root_certificates=certs / "ca.crt")
            dep = Deployment(procs, certs, port, health)
            dep.start_superexec("superexec-serverapp", port, certs / "superlink" / "superexec.secret")
            for i in range(1, registered + 1):
                dep.register(i)
            for i in range(1, registered + 1):
                dep.start_node(i, registered, workdir / "node-cache")
            procs.wait_for_nodes_online(CONN, registered, timeout=90)
            yield dep
        except BaseException:
            print(procs.report())
            raise


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    with deploy(tmp_path_factory.mktemp("deployment")) as dep:
        yield dep


# ----------------------------------------------------------------------------- TLS and auth


def _handshake(port: int, cafile: Path, server_hostname: str) -> dict[str, Any]:
    ctx = ssl.create_default_context(cafile=str(cafile))
    # Python >= 3.13 verifies strictly by default (the images may run it): check that here too.
    ctx.verify_flags |= getattr(ssl, "VERIFY_X509_STRICT", 0)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        with ctx.wrap_socket(sock, server_hostname=server_hostname) as tls:
            return tls.getpeercert()


def test_superlink_serves_tls_with_the_dev_ca(deployment: Deployment, tmp_path: Path) -> None:
    # Every name the SuperNodes, SuperExecs and the CLI may dial (make_certs.sh SANs).
    for name in ("127.0.0.1", "localhost", "superlink"):
        cert = _handshake(deployment.port, deployment.certs / "ca.crt", name)
        assert ("DNS", "superlink") in cert["subjectAltName"]
    # A name outside the SANs and a foreign CA are both rejected.
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(deployment.port, deployment.certs / "ca.crt", "elsewhere.example.org")
    other = make_certs(tmp_path / "other-ca", 0)
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(deployment.port, other / "ca.crt", "localhost")


def test_the_compose_healthcheck_probe_sees_a_serving_superlink(deployment: Deployment) -> None:
    from docker_helpers import health_probe, load_compose

    probe, address = health_probe(load_compose("compose.yml")["services"]["superlink"])
    serving = subprocess.run(
        [sys.executable, "-c", probe.replace(address, f"127.0.0.1:{deployment.health_port}")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert serving.returncode == 0, serving.stderr
    # Nothing serving there: unhealthy (non-zero), not a hang.
    down = subprocess.run(
        [sys.executable, "-c", probe.replace(address, f"127.0.0.1:{free_port()}")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert down.returncode != 0 and "UNAVAILABLE" in down.stderr, down.stderr


def test_registered_supernodes_are_online(deployment: Deployment) -> None:
    nodes = {int(n["node-id"]): n["status"] for n in deployment.procs.nodes(CONN)}
    assert set(deployment.node_ids.values()) <= set(nodes)
    assert all(nodes[nid] == "online" for nid in deployment.node_ids.values()), nodes


def test_unregistered_supernode_is_refused(deployment: Deployment, tmp_path: Path) -> None:
    before = {int(n["node-id"]) for n in deployment.procs.nodes(CONN)}
    proc = deployment.start_supernode(3, 2, tmp_path)  # supernode-3's key was never registered
    rc = proc.wait(timeout=90)
    log = proc.text()
    assert rc != 0, log
    assert "Failed to activate SuperNode" in log, log
    after = deployment.procs.nodes(CONN)
    assert {int(n["node-id"]) for n in after} == before, after
    assert sum(n["status"] == "online" for n in after) == 2, after


def test_supernode_auth_requires_tls(tmp_path: Path) -> None:
    with FlowerProcs(tmp_path / "flower") as procs:
        port = free_port()
        proc = procs.start(
            "superlink-insecure",
            ["flower-superlink", "--insecure", "--enable-supernode-auth", "--port", str(port)],
        )
        assert proc.wait(timeout=60) != 0
        assert "requires encrypted TLS" in proc.text(), proc.text()


# ----------------------------------------------------------------------------- a real run

# Round 1 with both nodes, round 2 loses the killed node (~60 s), then the node is
# restarted: the rounds in progress when it comes back online do not use it yet, a later
# round must. Each extra round costs a ClientApp process start and 32 SGD steps per node.
ROUNDS = 5
KILLED = 2  # supernode index killed mid-run (partition-id 1) and later restarted


def _results(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _wait_for(pred: Any, what: str, timeout: float, dep: Deployment, run_id: int, every: float = 0.5) -> Any:
    """Poll ``pred()`` every ``every`` s until truthy; fail early (with logs) if the run finishes first.

    The run's status is asked at most every 10 s: each `flwr` call is a Python start-up that
    competes with the run for the 2 cores."""
    deadline, next_status = time.monotonic() + timeout, time.monotonic() + 10
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        if time.monotonic() >= next_status:
            next_status = time.monotonic() + 10
            status = dep.procs.run_info(run_id, CONN)["status"]
            if str(status).startswith("finished"):
                value = pred()
                if value:
                    return value
                log = dep.procs.run_log(run_id, CONN)[-6000:]
                pytest.fail(f"run finished ({status}) before {what}\n{log}")
        time.sleep(every)
    pytest.fail(
        f"timed out after {timeout}s waiting for {what}\n"
        f"{dep.procs.run_log(run_id, CONN)[-6000:]}\n{dep.procs.report()}"
    )


def test_flwr_run_completes_and_records_a_killed_supernode(deployment: Deployment, tmp_path: Path) -> None:
    """Last in this file: it kills and restarts SuperNode 2 of the shared deployment (one deployment
    per file: an idle one polls its SuperLink and costs a tenth of a core)."""
    out = tmp_path / "outputs"
    run_config = (
        # All of mnist-5k's 2,500 training images (1,000 a node after the hold-out, 32 SGD steps a
        # round): enough to learn in these rounds, which the end of this test demands.
        f'method="fedavg" num-server-rounds={ROUNDS} dataset.train-limit=0 dataset.eval-limit=200 '
        # A lost node is detected by the SuperLink's heartbeat (~60 s), not by this timeout, which
        # only has to outlast a rejoined node's cold ClientApp start on a loaded 2-core machine.
        f"train.local-epochs=1 strategy.round-timeout=240 fraction-train=1.0 "
        # Federated evaluation through the same Grid: every node scores each round's model on its 20%.
        f"fraction-evaluate=1.0 evaluate-holdout=0.2 "
        f'outputs-dir="{out}" run-name="x"'
    )
    results_path = out / "x" / "results.json"
    t0 = time.monotonic()
    dep = deployment
    run_id = dep.procs.submit_run(ROOT, CONN, run_config)

    # Round 1 completes with both nodes.
    def round_done(n: int) -> Any:
        res = _results(results_path)
        return res if res and any(r["round"] == n for r in res["rounds"]) else None

    _wait_for(lambda: round_done(1), "round 1 in results.json", 420, dep, run_id)
    t_r1 = time.monotonic() - t0

    # Machine 2 dies while it works on the next round: SIGKILL its SuperNode and its
    # SuperExec, with the ClientApp process the SuperExec runs.
    superexec = dep.procs.procs[f"superexec-clientapp-{KILLED}"]

    def clientapp_running() -> bool:
        return any("flwr-clientapp" in cmdline(p) for p in descendants(superexec.pid))

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not clientapp_running():
        time.sleep(0.1)
    dep.procs.kill(f"superexec-clientapp-{KILLED}", sig=signal.SIGKILL)
    dep.procs.kill(f"supernode-{KILLED}", sig=signal.SIGKILL)
    t_kill = time.monotonic() - t0

    # Its failure is recorded (after ~60 s of missed heartbeats or the round-timeout).
    def failed_round() -> int | None:
        res = _results(results_path)
        for r in (res or {}).get("rounds", []):
            if any(f["partition-id"] == KILLED - 1 for f in r.get("failures", [])):
                return int(r["round"])
        return None

    fail_round = _wait_for(failed_round, "the killed node's failure in results.json", 400, dep, run_id)
    t_fail = time.monotonic() - t0

    # Restart the same SuperNode (same auth key, same partition-id). The SuperLink only
    # re-activates a registered node that is offline: wait until it is marked so.
    killed_id = dep.node_ids[KILLED]

    def node_status() -> str | None:
        return next((n["status"] for n in dep.procs.nodes(CONN) if int(n["node-id"]) == killed_id), None)

    _wait_for(lambda: node_status() == "offline", "the killed node to be offline", 120, dep, run_id, 2)
    dep.start_node(KILLED, 2, tmp_path / "node-cache")
    # Same key -> same node id: the registered one comes back online, no new node appears.
    _wait_for(lambda: node_status() == "online", "the restarted node to be online", 90, dep, run_id, 2)
    nodes_after = {int(n["node-id"]): n["status"] for n in dep.procs.nodes(CONN)}
    assert set(nodes_after) == set(dep.node_ids.values()), nodes_after
    back_round = max(r["round"] for r in _results(results_path)["rounds"])
    t_back = time.monotonic() - t0

    info = dep.procs.wait_for_run(run_id, CONN, timeout=600)
    t_done = time.monotonic() - t0
    log = dep.procs.run_log(run_id, CONN)
    assert info["status"] == "finished:completed", f"{info}\n{log[-6000:]}\n{dep.procs.report()}"

    res = _results(results_path)
    assert res is not None, f"no results.json at {results_path}\n{log}"
    rounds = {r["round"]: r for r in res["rounds"]}
    assert sorted(rounds) == list(range(ROUNDS + 1)), res["rounds"]
    assert rounds[1]["failures"] == [], rounds[1]
    assert sorted(rounds[1]["nodes"]) == [0, 1], rounds[1]
    later = [rounds[n] for n in range(2, ROUNDS + 1)]
    lost = [f for r in later for f in r["failures"]]
    assert lost, f"the killed node's failure is not recorded: {later}\n{log}"
    assert all(f["partition-id"] == KILLED - 1 for f in lost), lost
    assert rounds[fail_round]["failures"], rounds[fail_round]
    # The node that rejoined is used again: a round that started after it was back online
    # (round back_round + 1 may have started just before) trains on its partition again.
    # Used = chosen AND replied: being chosen alone does not show that the node works again.
    rejoined = [
        r["round"]
        for r in later
        if r["round"] > fail_round
        and KILLED - 1 in r["nodes"]
        and all(f["partition-id"] != KILLED - 1 for f in r["failures"])
    ]
    assert rejoined, (
        f"partition {KILLED - 1} not used after the restart (failed in round {fail_round}, back online "
        f"during round {back_round + 1}; if that is round {ROUNDS}, raise ROUNDS): {later}\n{log[-6000:]}"
    )
    assert all(not r["failures"] for r in later if r["round"] > min(rejoined)), later
    # The run went on with the surviving node, and every round was evaluated: centrally, and by
    # the nodes that were up (example-weighted over their held-out data; the lost one a failure).
    assert all(isinstance(r["test-accuracy"], float) for r in rounds.values()), res["rounds"]
    assert [n["partition-id"] for n in rounds[1]["evaluate-nodes"]] == [0, 1], rounds[1]
    for r in later + [rounds[1]]:
        nodes = r["evaluate-nodes"]
        assert nodes and all(f["partition-id"] == KILLED - 1 for f in r["evaluate-failures"]), r
        held = sum(n["num-examples"] for n in nodes)
        weighted = sum(n["num-examples"] * n["accuracy"] for n in nodes) / held
        assert 0.0 <= r["federated-accuracy"] <= 1.0 and abs(r["federated-accuracy"] - weighted) < 1e-6, r
    assert all(n["num-examples"] > 0 for r in later for n in r["evaluate-nodes"])
    # The updates were applied: the global model learned, through the lost and the rejoined node.
    from docker_helpers import e2e_script

    assert (why := e2e_script().not_learned(res["rounds"])) is None, why
    print(
        f"round 1 done {t_r1:.1f}s after submit, node killed {t_kill:.1f}s, "
        f"failure recorded (round {fail_round}) {t_fail:.1f}s, node back online (during round "
        f"{back_round + 1}, same node id {killed_id}) {t_back:.1f}s, used again in rounds {rejoined}, "
        f"run finished {t_done:.1f}s (rounds: "
        + ", ".join(
            f"{r['round']}:{r.get('seconds', 0):.1f}s/{len(r.get('failures', []))} failed/"
            f"test {r['test-accuracy']:.3f}/federated {r.get('federated-accuracy')}"
            for r in res["rounds"][1:]
        )
        + ")"
    )
