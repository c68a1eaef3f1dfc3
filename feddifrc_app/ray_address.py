"""Whether a simulation can reach the Ray cluster it is told to join, checked before it waits on it.

Flower's Ray engine calls ``ray.init()``, which joins an existing cluster when one is named:
``RAY_ADDRESS``, else the address that the last ``ray start --head`` (or a test's
``ray.cluster_utils.Cluster``) wrote to ``<temp>/ray/ray_current_cluster``; ``ray stop`` and a
clean shutdown remove that file, a killed cluster leaves it. When nothing answers at the address,
``ray.init()`` retries without end and says so only on the simulation process's stderr, which
`flwr log` does not show: no node ever starts, and the ServerApp would wait for setup replies
for ``strategy.setup-timeout`` (a day) without a word. So the ServerApp of a simulation checks
the address first and fails the run, saying what is wrong and what to do (docs/scale-out.md).
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from flwr.serverapp import Grid
from flwr.superlink.grid import InMemoryGrid

from feddifrc_app import log

# A live GCS accepts a TCP connection at once (the kernel does, however busy the process is);
# only an address that drops packets (a firewall, a host that is down) waits this long.
PROBE_SECONDS = 10.0
RAY_CLIENT_PORT = 10001  # a ray://host address without a port: Ray Client's default


class RayUnreachableError(RuntimeError):
    """The Ray cluster this simulation is told to join does not answer."""


def current_cluster_file() -> Path:
    """Where ``ray start`` records its cluster for a later ``ray.init()``: Ray's temp dir
    (``RAY_TMPDIR``, else on Linux ``TMPDIR``, else ``/tmp``) / ``ray/ray_current_cluster``."""
    tmp = os.environ.get("RAY_TMPDIR") or (sys.platform.startswith("linux") and os.environ.get("TMPDIR"))
    return Path(tmp or "/tmp") / "ray" / "ray_current_cluster"


def named_address() -> tuple[str, str] | None:
    """(address, where it was named) of the cluster ``ray.init()`` will join in this process, or
    None: it starts a Ray of its own (``RAY_ADDRESS`` unset or ``local``, and no recorded cluster)."""
    env = os.environ.get("RAY_ADDRESS", "").strip()
    if env == "local":
        return None
    if env and env != "auto":
        return env, "RAY_ADDRESS"
    path = current_cluster_file()
    try:
        recorded = path.read_text().strip()
    except OSError:  # no file: no cluster recorded
        return None
    if not recorded:
        return None
    return recorded, f"{path}, where the last `ray start` on this machine recorded its cluster"


def host_port(address: str) -> tuple[str, int]:
    """``host:port``, ``ray://host[:port]`` or ``[v6]:port`` -> (host, port)."""
    rest = address.removeprefix("ray://")
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit() or "]" in port:
        host, port = rest, str(RAY_CLIENT_PORT if address.startswith("ray://") else -1)
    if int(port) < 0:
        raise RayUnreachableError(f"Ray address {address!r} names no port (host:port)")
    return host.strip("[]"), int(port)


def check(grid: Grid) -> str | None:
    """In a simulation (Flower's in-memory Grid), raise RayUnreachableError when the cluster
    ``ray.init()`` will join does not accept a connection. The address joined, or None: a
    deployment, or a simulation that starts a Ray of its own."""
    named = named_address() if isinstance(grid, InMemoryGrid) else None
    if named is None:
        return None
    address, source = named
    try:
        with socket.create_connection(host_port(address), timeout=PROBE_SECONDS):
            log.info("simulation: joining the Ray cluster at %s (named by %s)", address, source)
            return address
    except OSError as e:
        raise RayUnreachableError(
            f"this simulation is told to join the Ray cluster at {address} (named by {source}), but "
            f"nothing answers there ({e}): Ray would wait for it without end and no node would start. "
            "Start that cluster (`ray start --head` / `ray start --address=...`), or, for a run on "
            "this machine alone, unset RAY_ADDRESS (or remove the stale file named above, once no "
            "`ray start` cluster of yours runs) and restart the local SuperLink, which keeps the "
            "environment it was started with (docs/scale-out.md)"
        ) from e
