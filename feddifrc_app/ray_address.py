"""Whether a simulation can reach the Ray cluster it is told to join, checked before it waits on it.

Flower's Ray engine calls ``ray.init()`` with no address, which joins an existing cluster when one
is named: ``RAY_ADDRESS``, else the address that the last ``ray start --head`` (or a test's
``ray.cluster_utils.Cluster``) wrote to ``<temp>/ray/ray_current_cluster``; ``ray stop`` and a
clean shutdown remove that file, a killed cluster leaves it. When nothing answers at the address,
``ray.init()`` retries without end and says so only on the simulation process's stderr, which
`flwr log` does not show: no node ever starts, and the ServerApp would wait for setup replies
for ``strategy.setup-timeout`` (a day) without a word. An address Ray cannot use at all (blanks
around it, ``http://``, ``auto`` with no cluster) crashes Flower's engine, again on that stderr
alone. So the ServerApp of a simulation reads the address as Ray 2.55 does (``ray/_private/
worker.py`` ``init``, ``ray/_private/services.py`` ``get_ray_address_from_environment``) and fails
the run at once, saying what is wrong and what to do (docs/scale-out.md, section 3).
"""

from __future__ import annotations

import importlib
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
RAY_CLIENT_PORT = 10001  # Ray Client's server (`ray start --head`), named in the refusal of a bare ray://host


class RayUnreachableError(RuntimeError):
    """The Ray cluster this simulation is told to join does not answer, or is no address Ray can use."""


def current_cluster_file() -> Path:
    """Where ``ray start`` records its cluster for a later ``ray.init()``: Ray's temp dir
    (``RAY_TMPDIR``, else on Linux ``TMPDIR``, else ``/tmp``) / ``ray/ray_current_cluster``."""
    if "RAY_TMPDIR" in os.environ:  # Ray tests presence: an empty value is the working directory
        tmp = os.environ["RAY_TMPDIR"]
    elif sys.platform.startswith("linux") and "TMPDIR" in os.environ:
        tmp = os.environ["TMPDIR"]
    else:
        tmp = "/tmp"
    return Path(tmp) / "ray" / "ray_current_cluster"


def named_address() -> tuple[str, str] | None:
    """(address, where it was named) of the cluster ``ray.init()`` will join in this process, or
    None: it starts a Ray of its own (``RAY_ADDRESS`` unset, empty or ``local``, and, but for
    ``local``, no recorded cluster). Raises RayUnreachableError where Ray would fail on it."""
    env = os.environ.get("RAY_ADDRESS", "")
    if env != env.strip():  # Ray uses the value as it is: " h:6379" is host " h", "  " no address
        raise RayUnreachableError(
            f"RAY_ADDRESS={env!r} has blanks around it, which Ray keeps: it cannot parse or reach "
            "that address and no node would start. Export it without them (or unset it)"
        )
    if env == "local":  # Ray's word for "start a Ray of your own", whatever is recorded
        return None
    if env and env != "auto":
        return env, "RAY_ADDRESS"
    recorded = _recorded()
    if env != "auto":  # empty or unset: the file, else a Ray of its own
        return recorded
    from ray._private.services import find_gcs_addresses  # Ray's own search: its raylets' flags

    find_gcs_addresses.cache_clear()
    return auto_address(find_gcs_addresses(), recorded)


def _recorded() -> tuple[str, str] | None:
    """The cluster the last ``ray start`` on this machine recorded, and where, or None."""
    path = current_cluster_file()
    try:
        recorded = path.read_text().strip()  # Ray strips it too (ray/_private/utils.py read_ray_address)
    except OSError:  # no file: no cluster recorded
        return None
    if not recorded:  # Ray reads "" and fails to parse it ("Invalid address format")
        raise RayUnreachableError(
            f"{path} is empty: Ray takes it for the address of the last `ray start` cluster and "
            "fails to parse it, so no node would start. Remove the file (once no `ray start` "
            "cluster of yours runs), or name the cluster in RAY_ADDRESS"
        )
    return recorded, f"{path}, where the last `ray start` on this machine recorded its cluster"


def auto_address(running: frozenset[str] | set[str], recorded: tuple[str, str] | None) -> tuple[str, str]:
    """``RAY_ADDRESS=auto``, in Ray's order (``get_ray_address_from_environment``): with several
    clusters running here, the recorded one; else the one running here (over a recorded one);
    else the recorded one; else Ray fails. Several running and none recorded: Ray joins any one
    of them, which is refused here."""
    if recorded is not None and len(running) != 1:
        return recorded
    if len(running) == 1:
        return next(iter(running)), "RAY_ADDRESS=auto, the one Ray cluster running on this machine"
    if running:
        raise RayUnreachableError(
            f"RAY_ADDRESS=auto, no cluster is recorded in {current_cluster_file()} and "
            f"{len(running)} Ray clusters run on this machine ({', '.join(sorted(running))}): Ray "
            "would join any one of them. Name the one to join: RAY_ADDRESS=<host>:<port>"
        )
    raise RayUnreachableError(
        f"RAY_ADDRESS=auto joins a running Ray cluster only, and none is recorded in "
        f"{current_cluster_file()} or runs on this machine: Ray would fail and no node would start. "
        "Start the cluster (`ray start --head`), or, for a Ray of this run's own, unset RAY_ADDRESS "
        "and restart the local SuperLink (docs/scale-out.md)"
    )


def endpoint(address: str) -> tuple[str, int] | None:
    """Where to probe ``address`` (``host:port``, ``[v6]:port``, ``ray://host:port``), or None
    for a Ray client plugin's scheme, which only its module can reach. Raises RayUnreachableError
    for an address Ray cannot use."""
    scheme, sep, rest = address.partition("://")
    if not sep:
        return host_port(address)
    if scheme == "ray":  # Ray Client (ray.init hands any `x://` to module x's ClientBuilder)
        return host_port(rest, address)
    if scheme in ("http", "https"):
        raise RayUnreachableError(
            f"Ray address {address!r} is a Ray dashboard address (the one `ray job submit` uses), "
            f"which ray.init() cannot join (it would look for a Ray client module named {scheme!r}). "
            f"Name the cluster itself: <head>:6379 (its GCS), or ray://<head>:{RAY_CLIENT_PORT}"
        )
    try:
        plugin = hasattr(importlib.import_module(scheme), "ClientBuilder")
    except Exception:  # whatever Ray's own import of it would raise
        plugin = False
    if not plugin:
        raise RayUnreachableError(
            f"Ray address {address!r}: ray.init() hands an address `{scheme}://...` to a Python "
            f"module {scheme!r} with a ClientBuilder, and there is none here. Use <host>:<port> "
            f"or ray://<host>:<port>"
        )
    return None


def host_port(address: str, named: str | None = None) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); ``named``: the address as given."""
    host, sep, port = address.rpartition(":")
    bare_v6 = ":" in host and not (host.startswith("[") and host.endswith("]"))  # Ray cannot parse it
    if not sep or not port.isdigit() or not host.strip("[]") or bare_v6:
        client = (named or "").startswith("ray://")
        hint = f"ray://<host>:{RAY_CLIENT_PORT}, Ray Client's default" if client else "<host>:6379"
        if bare_v6:
            hint = "an IPv6 host in brackets, [<host>]:<port>"
        raise RayUnreachableError(f"Ray address {named or address!r} is not <host>:<port>: write {hint}")
    return host.strip("[]"), int(port)


def check(grid: Grid) -> str | None:
    """In a simulation (Flower's in-memory Grid), raise RayUnreachableError when the cluster
    ``ray.init()`` will join does not accept a connection, or is no address Ray can use. The
    address joined, or None: a deployment, or a simulation that starts a Ray of its own."""
    named = named_address() if isinstance(grid, InMemoryGrid) else None
    if named is None:
        return None
    address, source = named
    target = endpoint(address)
    if target is None:
        log.info("simulation: joining Ray at %s (named by %s) through its client plugin", address, source)
        return address
    try:
        with socket.create_connection(target, timeout=PROBE_SECONDS):
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
