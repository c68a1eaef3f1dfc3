"""How a simulation reads the Ray address it is told to join (feddifrc_app/ray_address.py), case
by case, as Ray 2.55's ``ray.init()`` reads it (``ray/_private/worker.py`` ``init``,
``ray/_private/services.py`` ``get_ray_address_from_environment``): no Ray is started, nothing
but a loopback socket is opened. test_ray_cluster.py has the gone and the live cluster."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest
from fakes import SuperLink
from flower_procs import free_port

from feddifrc_app import ray_address
from feddifrc_app.ray_address import RayUnreachableError


def _simulation_grid():
    """The Grid a ServerApp gets in Flower's simulation engine: Flower's InMemoryGrid."""
    return SuperLink().grid


@pytest.fixture
def ray_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No RAY_ADDRESS, and Ray's temp dir an empty folder of this test's: where a recorded
    cluster goes (returned)."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    (tmp_path / "ray").mkdir()
    return tmp_path / "ray" / "ray_current_cluster"


def test_an_empty_ray_address_is_unset_and_local_ignores_the_recorded_cluster(ray_env, monkeypatch):
    """Ray skips an empty RAY_ADDRESS (``if address_env_var``) and reads the recorded cluster."""
    monkeypatch.setenv("RAY_ADDRESS", "")
    assert ray_address.named_address() is None  # nothing recorded: Flower starts its own Ray
    ray_env.write_text("10.1.2.3:6379\n")  # stripped, as Ray's read_ray_address does
    assert ray_address.named_address() == (
        "10.1.2.3:6379",
        f"{ray_env}, where the last `ray start` on this machine recorded its cluster",
    )
    monkeypatch.setenv("RAY_ADDRESS", "local")
    assert ray_address.named_address() is None
    monkeypatch.setenv("RAY_ADDRESS", "10.9.9.9:6380")  # RAY_ADDRESS wins over the file
    assert ray_address.named_address() == ("10.9.9.9:6380", "RAY_ADDRESS")


@pytest.mark.parametrize("value", [" 10.1.2.3:6379", "10.1.2.3:6379 ", "10.1.2.3:6379\n", "   ", "\t"])
def test_blanks_around_ray_address_are_refused_not_stripped(ray_env, monkeypatch, value):
    """Ray uses the value as it is: " h:6379" is host " h"; "   " is no address (ValueError in
    Flower's engine, on the simulation's stderr alone). Stripping it here would check another
    address than the one Ray joins."""
    monkeypatch.setenv("RAY_ADDRESS", value)
    with pytest.raises(RayUnreachableError, match=re.escape(f"RAY_ADDRESS={value!r} has blanks around it")):
        ray_address.check(_simulation_grid())
    assert ray_address.check(object()) is None  # a deployment's ServerApp: Ray is not its business


def test_auto_follows_rays_order_between_the_recorded_cluster_and_those_running_here(ray_env, monkeypatch):
    """Ray's ``get_ray_address_from_environment`` for "auto": several running and one recorded ->
    the recorded; one running -> that one, even over a (maybe stale) recorded one; none running ->
    the recorded; nothing -> ConnectionError."""
    rec = ("10.1.2.3:6379", "the file")
    one = ("10.0.0.5:6379", "RAY_ADDRESS=auto, the one Ray cluster running on this machine")
    assert ray_address.auto_address({"10.0.0.5:6379", "10.0.0.6:6379"}, rec) == rec
    assert ray_address.auto_address({"10.0.0.5:6379"}, rec) == one
    assert ray_address.auto_address({"10.0.0.5:6379"}, None) == one
    assert ray_address.auto_address(frozenset(), rec) == rec
    with pytest.raises(RayUnreachableError, match=r"2 Ray clusters run on this machine \(a:1, b:2\)"):
        ray_address.auto_address({"b:2", "a:1"}, None)
    with pytest.raises(RayUnreachableError, match="joins a running Ray cluster only, and none is recorded"):
        ray_address.auto_address(frozenset(), None)
    # Ray's order checked against Ray itself, with the running clusters stubbed as Ray finds them.
    from ray._private import services

    ray_env.write_text(rec[0])
    for running in ({"10.0.0.5:6379", "10.0.0.6:6379"}, {"10.0.0.5:6379"}, set()):
        monkeypatch.setattr(services, "find_gcs_addresses", lambda r=running: set(r))
        ours = ray_address.auto_address(running, (ray_env.read_text(), "the file"))[0]
        assert services.get_ray_address_from_environment("auto", None) == ours


def test_an_empty_recorded_cluster_file_is_refused_as_ray_cannot_parse_it(ray_env, monkeypatch):
    ray_env.write_text("\n")
    with pytest.raises(RayUnreachableError, match=f"{re.escape(str(ray_env))} is empty"):
        ray_address.named_address()
    monkeypatch.setenv("RAY_ADDRESS", "local")  # Ray's own Ray: the file is not read
    assert ray_address.named_address() is None


def test_an_empty_ray_tmpdir_is_the_working_directory_as_for_ray(monkeypatch):
    monkeypatch.setenv("RAY_TMPDIR", "")
    assert ray_address.current_cluster_file() == Path("ray") / "ray_current_cluster"


def test_auto_with_nothing_recorded_reads_the_raylets_of_this_machine(ray_env, monkeypatch):
    """The live path: Ray's own search of this machine's raylets, whatever runs here now. Other
    tests start and stop clusters beside this one, so the answer is checked against what that
    very search found, not against a second search."""
    from ray._private import services

    live, found = services.find_gcs_addresses, []

    def search():
        found.append(frozenset(live()))
        return found[-1]

    search.cache_clear = live.cache_clear
    monkeypatch.setattr(services, "find_gcs_addresses", search)
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    try:
        answer = ray_address.named_address()
    except RayUnreachableError as refused:
        assert len(found) == 1 and len(found[0]) != 1
        assert "RAY_ADDRESS=auto" in str(refused)
    else:
        assert len(found) == 1 and answer == ray_address.auto_address(found[0], None)
        assert len(found[0]) == 1


def test_where_each_address_form_is_probed():
    assert ray_address.endpoint("10.1.2.3:6379") == ("10.1.2.3", 6379)
    assert ray_address.endpoint("head.lab:6379") == ("head.lab", 6379)
    assert ray_address.endpoint("[::1]:6379") == ("::1", 6379)
    assert ray_address.endpoint("ray://head.lab:10001") == ("head.lab", 10001)  # Ray Client
    assert ray_address.endpoint("ray://[::1]:10001") == ("::1", 10001)


@pytest.mark.parametrize(
    ("address", "says"),
    [
        # Ray Client dials a bare host at gRPC's default port (443), not its own server's 10001.
        ("ray://head.lab", "'ray://head.lab' is not <host>:<port>: write ray://<host>:10001"),
        ("head.lab", "'head.lab' is not <host>:<port>: write <host>:6379"),
        ("head.lab:", "is not <host>:<port>"),
        (":6379", "is not <host>:<port>"),
        ("head.lab:port", "is not <host>:<port>"),
        ("[::1]", "is not <host>:<port>"),
        ("::1:6379", "write an IPv6 host in brackets"),  # Ray's parse_address: None
        # ray.init() takes `x://` as Ray client module x: `http` has none (AssertionError in Ray).
        ("http://head.lab:8265", "is a Ray dashboard address .* <head>:6379 .* ray://<head>:10001"),
        ("https://head.lab:8265", "is a Ray dashboard address"),
        ("nosuchmodule://head.lab:1", "module 'nosuchmodule' with a ClientBuilder, and there is none"),
        ("json://head.lab:1", "a Python module 'json' with a ClientBuilder"),  # a module, no builder
    ],
)
def test_an_address_ray_cannot_use_is_refused_saying_what_to_write(address, says):
    with pytest.raises(RayUnreachableError, match=says):
        ray_address.endpoint(address)


def test_a_scheme_is_refused_or_probed_in_the_simulation(ray_env, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")
    with pytest.raises(RayUnreachableError, match="'http://127.0.0.1:8265' is a Ray dashboard address"):
        ray_address.check(_simulation_grid())
    gone = f"ray://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("RAY_ADDRESS", gone)
    with pytest.raises(RayUnreachableError, match=f"Ray cluster at {gone} \\(named by RAY_ADDRESS\\)"):
        ray_address.check(_simulation_grid())
    with socket.create_server(("127.0.0.1", 0)) as server:
        live = f"ray://127.0.0.1:{server.getsockname()[1]}"
        monkeypatch.setenv("RAY_ADDRESS", live)
        assert ray_address.check(_simulation_grid()) == live
