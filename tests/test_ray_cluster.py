"""A simulation across a Ray cluster (docs/scale-out.md): the quickstart on two raylets of this
host, attached through ``RAY_ADDRESS``, gives the numbers of the one-machine run, and results.json
names the raylet each reply came from (``origins``); a simulation told to join a Ray that is gone
fails at once, saying so, instead of waiting without a word.

The one-machine run is the run that was the second half of test_simulation.py's end-to-end test
(a run on a cache filled by ``feddifrc extract`` loads no teacher and extracts nothing), moved
here as the reference: the suite gains one Flower run, the cluster run. Both runs read that one
cache, so they compare the layouts (one actor of 2 CPUs on one raylet vs one actor of 1 CPU on
each of two), not the cache's writers.
"""

from __future__ import annotations

import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT
from flower_procs import FlowerProcs, free_port
from flwr.server.superlink.linkstate import LinkStateFactory
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.superlink.federation import NoOpFederationManager
from flwr.superlink.grid import InMemoryGrid
from simulation_runs import QUICK, assert_reference, results, run_ok

from feddifrc_app import ray_address
from feddifrc_app.client_app import origin

# One actor of 1 CPU per raylet: Flower sizes its pool as the cluster's CPUs // the client's.
CLUSTER_FED = "num-supernodes=2 client-resources-num-cpus=1"


def _simulation_grid() -> InMemoryGrid:
    """The Grid a ServerApp gets in Flower's simulation engine."""
    return InMemoryGrid(
        LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory())
    )


def test_a_reply_outside_ray_names_its_host_and_no_ray_node():
    assert dict(origin()) == {"host": socket.gethostname()}  # a deployment's ClientApp


@pytest.fixture
def no_ray_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No RAY_ADDRESS, and Ray's temp dir an empty folder of this test's (returned)."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    return tmp_path


def test_a_simulation_told_to_join_a_ray_that_is_gone_fails_at_once_saying_so(no_ray_named, monkeypatch):
    """The hang this replaces: ray.init() retries a dead address without end, on stderr only."""
    gone = f"127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("RAY_ADDRESS", gone)
    with pytest.raises(
        ray_address.RayUnreachableError, match=f"Ray cluster at {gone} \\(named by RAY_ADDRESS\\)"
    ):
        ray_address.check(_simulation_grid())
    assert ray_address.check(object()) is None  # a deployment's ServerApp: Ray is not its business

    # A cluster killed without `ray stop` leaves its address where a plain ray.init() reads it.
    monkeypatch.delenv("RAY_ADDRESS")
    (no_ray_named / "ray").mkdir()
    recorded = no_ray_named / "ray" / "ray_current_cluster"
    recorded.write_text(gone + "\n")
    with pytest.raises(
        ray_address.RayUnreachableError, match=f"at {gone} \\(named by {recorded}, where the last"
    ):
        ray_address.check(_simulation_grid())
    monkeypatch.setenv("RAY_ADDRESS", "local")  # Ray's own word for "start your own"
    assert ray_address.check(_simulation_grid()) is None


def test_a_ray_that_answers_is_joined_and_none_named_is_started(no_ray_named, monkeypatch):
    assert ray_address.check(_simulation_grid()) is None  # nothing named: Flower starts its own Ray
    with socket.create_server(("127.0.0.1", 0)) as server:
        live = f"127.0.0.1:{server.getsockname()[1]}"
        monkeypatch.setenv("RAY_ADDRESS", live)
        assert ray_address.check(_simulation_grid()) == live


@pytest.fixture
def two_raylets(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, set[str]]]:
    """A Ray cluster of two raylets of 1 CPU on 127.0.0.1 (``ray.cluster_utils.Cluster``): its
    address and the two Ray node ids. Always shut down; its temp dir is private, so the address
    it records for a plain ``ray.init()`` (``ray_current_cluster``) is never /tmp/ray's, where
    another simulation on this machine would join it (or, once it is gone, hang on it)."""
    from ray.cluster_utils import Cluster

    temp = Path(tempfile.mkdtemp(prefix="rc-", dir="/tmp"))  # short: Ray's socket paths have a limit
    monkeypatch.setenv("RAY_TMPDIR", str(temp))
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # 127.0.0.1 stays loopback (flower_env)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as the harness's own Ray: one thread per actor
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    node = {"node_ip_address": "127.0.0.1", "num_cpus": 1, "num_gpus": 0, "include_dashboard": False}
    cluster = Cluster()
    try:
        # Free ports, not Ray's fixed defaults, which another cluster on this machine may hold.
        head = cluster.add_node(**node, gcs_server_port=free_port(), dashboard_agent_listen_port=free_port())
        worker = cluster.add_node(**node, dashboard_agent_listen_port=free_port())
        assert cluster.address.startswith("127.0.0.1:"), cluster.address
        yield cluster.address, {head.node_id, worker.node_id}
    finally:
        cluster.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def _same_numbers(a: dict, b: dict) -> None:
    """Every number of results.json but the wall times and the replies' machines."""
    assert (a["basis"], a["summary"], a["label-counts"]) == (b["basis"], b["summary"], b["label-counts"])
    for x, y in zip(a["rounds"], b["rounds"], strict=True):
        drop = {"seconds", "origins", "train-metrics"}
        assert {k: v for k, v in x.items() if k not in drop} == {k: v for k, v in y.items() if k not in drop}
        timed = {k for k in x.get("train-metrics", {}) if k.endswith("-seconds")}
        assert {k: v for k, v in x.get("train-metrics", {}).items() if k not in timed} == {
            k: v for k, v in y.get("train-metrics", {}).items() if k not in timed
        }, x["round"]


@pytest.mark.slow
def test_the_quickstart_on_two_raylets_gives_the_one_machine_numbers(
    flower_procs_own_ray, two_raylets, tmp_path
):
    address, raylets = two_raylets
    out, filled = tmp_path / "runs", tmp_path / "extracted"
    # `feddifrc extract` with the run's config fills a cache under the same keys: a run on that
    # cache never loads the teacher and extracts nothing, in setup or in any round.
    from feddifrc_app.tools import cli

    extract = ["extract", "--app", str(ROOT), "--cache-dir", str(filled), "--num-partitions", "2"]
    assert cli.main([*extract, "--no-progress", "--run-config", "dataset.train-limit=120"]) == 0
    base = f"{QUICK} outputs-dir='{out}' diffusion.cache-dir='{filled}'"

    # One machine, the user's path: `flwr run .` starts its own Ray (one actor of 2 CPUs).
    logs = [run_ok(flower_procs_own_ray, base + " run-name='one'")["log"]]
    # The cluster: the local SuperLink, and the simulation it starts, attach through RAY_ADDRESS.
    with FlowerProcs(tmp_path / "cluster", {"RAY_ADDRESS": address}) as procs:
        logs.append(run_ok(procs, base + " run-name='two'", fed=CLUSTER_FED)["log"])
    one, two = results(out / "one"), results(out / "two")
    assert f"joining the Ray cluster at {address}" in logs[1]
    for r, log in zip((one, two), logs, strict=True):
        assert r["status"] == "completed" and [x["round"] for x in r["rounds"]] == [0, 1, 2]
        assert r["setup-cache-misses"] == 0
        assert all(row["train-metrics"]["teacher-cache-misses"] == 0 for row in r["rounds"][1:])
        assert "loaded diffusion teacher" not in log
    _same_numbers(one, two)
    # Warm (a cache `feddifrc extract` filled in another process) gives the numbers of
    # test_simulation.py's cold run (its actor filled its cache as it trained): the reference.
    assert_reference(one)

    # Each trained round names, per node id, the machine of its reply: this host; on the cluster,
    # over the run, both raylets (each node's message goes to whichever actor is free).
    for r in (one, two):
        for row in r["rounds"][1:]:
            assert sorted(o["partition-id"] for o in row["origins"].values()) == [0, 1], row["origins"]
            assert {o["host"] for o in row["origins"].values()} == {socket.gethostname()}
    used = {o["ray-node"] for r in (two,) for row in r["rounds"][1:] for o in row["origins"].values()}
    assert used == raylets, (used, raylets)
    own = {o["ray-node"] for row in one["rounds"][1:] for o in row["origins"].values()}
    assert len(own) == 1 and not own & raylets  # one machine: its own Ray, one raylet
