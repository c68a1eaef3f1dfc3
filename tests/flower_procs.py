"""Start real Flower processes in tests, watch them, and always clean them up.

Used by the loopback deployment test and the ``flwr run`` simulation test. Nothing
here is mocked: the commands are the installed ``flower-superlink``,
``flower-supernode`` and ``flwr``.

Guarantees:

- **Isolation.** Every command runs with its own ``FLWR_HOME`` (a temp folder),
  telemetry and the update check off, and runtime dependency installation off
  (``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1``: no ``uv sync`` of torch per
  run); SuperExecs poll for work every 0.2 s (``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``, as in
  docker/). Ports are picked free at run time (:func:`free_port`), including the ports
  of the SuperLink that ``flwr run`` starts for a ``:local:`` (simulation)
  connection, so concurrent test sessions never share a local SuperLink.
- **Cleanup.** Each long-running process starts in its own session (process
  group). :meth:`FlowerProcs.kill` signals the whole group plus any descendant that
  left it, SIGTERM first and SIGKILL after a grace period. :class:`FlowerProcs` is a
  context manager, the :func:`flower_procs` fixture closes it even when the test
  fails, and an ``atexit`` hook kills anything still registered if the
  interpreter exits early. The detached local SuperLink of a simulation run is
  found by its log path under this harness's FLWR_HOME and killed at close.
  Nothing is ever killed by name.
- **Diagnostics.** Each process writes to ``<workdir>/logs/<name>.log``;
  :meth:`FlowerProcs.report` returns the tail of every log (the fixture prints
  it at teardown, so pytest shows it for failing tests only).
- **Run status.** ``flwr run --stream`` exits 0 even when the run FAILED, so runs
  are submitted without ``--stream`` and polled with
  ``flwr ls --run-id ID --format json`` (:meth:`FlowerProcs.wait_for_run`) until
  the status starts with ``finished:`` (``finished:completed``,
  ``finished:failed``, ``finished:stopped``).

Typical use::

    def test_x(flower_procs):
        p = flower_procs
        port = free_port()
        p.start("superlink", ["flower-superlink", "--insecure", "--port", str(port)],
                ready_port=port)
        p.add_connection("local-test", f"127.0.0.1:{port}", insecure=True)
        run_id = p.submit_run(APP_DIR, "local-test", run_config="num-server-rounds=1")
        run = p.wait_for_run(run_id, "local-test", timeout=300)
        assert run["status"] == "finished:completed", p.report()

    def test_sim(flower_procs):  # simulation: the managed local SuperLink
        run_id = flower_procs.submit_run(APP_DIR, "local", run_config="num-server-rounds=1",
                                         federation_config="num-supernodes=2")
        assert flower_procs.wait_for_run(run_id, "local", 600)["status"] == "finished:completed"
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import flwr_cli

try:
    import pytest
except ModuleNotFoundError:  # a bare GPU host's check (benchmarks/gpu_check_flower.py) starts
    # processes with this launcher without pytest: the fixtures below stay plain functions.
    class pytest:  # noqa: N801
        @staticmethod
        def fixture(fn=None, **_kw):
            return fn if fn is not None else (lambda f: f)


__all__ = [
    "FlowerProc",
    "FlowerProcs",
    "cmdline",
    "descendants",
    "flower_env",
    "flower_procs",
    "flower_procs_own_ray",
    "free_port",
    "ray_cluster",
    "session",
    "start_ray_head",
    "wait_for_port",
]

# Every process started through this module that has not been killed yet (pid -> proc).
_LIVE: dict[int, FlowerProc] = {}


# ----------------------------------------------------------------------------- ports


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now (the OS picks it; tiny race until it is bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_for_port(
    port: int,
    host: str = "127.0.0.1",
    timeout: float = 30.0,
    proc: FlowerProc | None = None,
) -> None:
    """Block until ``host:port`` accepts TCP connections.

    Raises ``RuntimeError`` (with the log tail) as soon as ``proc`` exits, and
    ``TimeoutError`` after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise RuntimeError(
                f"{proc.name} exited with code {proc.returncode} before listening on "
                f"{host}:{port}\n{proc.tail()}"
            )
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(
        f"nothing listened on {host}:{port} within {timeout}s"
        + (f"\n{proc.tail()}" if proc is not None else "")
    )


# ----------------------------------------------------------------------------- environment


def flower_env(flwr_home: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """``os.environ`` plus an isolated ``FLWR_HOME`` and quiet, offline Flower settings."""
    env = dict(os.environ)
    env.update(
        {
            "FLWR_HOME": str(flwr_home),
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            # As in docker/: a SuperExec asks for work every 0.2 s, not Flower's 1 s. Set on every
            # command, so it reaches the SuperExecs started by hand and the children of a SuperLink or
            # SuperNode run with --isolation subprocess (they inherit it).
            "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.2",
            "PYTHONUNBUFFERED": "1",
            "NO_COLOR": "1",
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            # Ray resolves 127.0.0.1 to the host's own network address unless its cluster mode is
            # off (meant for macOS/Windows, honoured on Linux): every Ray address stays on loopback.
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            # Several processes share few cores: one intra-op thread each.
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
    )
    if extra:
        env.update(extra)
    return env


# ----------------------------------------------------------------------------- processes


def descendants(pid: int) -> list[int]:
    """All live descendant pids of ``pid`` (Linux ``/proc``; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ..." -- comm may contain spaces and parentheses.
        fields = stat[stat.rfind(")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    out: list[int] = []
    todo = [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def cmdline(pid: int) -> str:
    """The command line of ``pid`` ('' if it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def _pids() -> list[int]:
    """Every live pid (Linux ``/proc``; empty elsewhere)."""
    proc = Path("/proc")
    return [int(e.name) for e in proc.iterdir() if e.name.isdigit()] if proc.is_dir() else []


def session(pid: int) -> int | None:
    """The session id of ``pid`` (None if it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rfind(")") + 2 :].split()[3])  # state ppid pgrp session


def _has_env(pid: int, entry: bytes) -> bool:
    """Whether ``pid``'s environment holds ``entry`` (``NAME=value``); False if unreadable."""
    try:
        return entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


class FlowerProc:
    """One started process (its own process group) and its log file."""

    def __init__(self, name: str, argv: Sequence[str], popen: subprocess.Popen, log: Path) -> None:
        self.name = name
        self.argv = list(argv)
        self.popen = popen
        self.log = log

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait(self, timeout: float) -> int:
        """Wait for the process to exit; return its exit code (raises on timeout)."""
        return self.popen.wait(timeout=timeout)

    def text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, chars: int = 4000) -> str:
        t = self.text()
        return f"----- {self.name} (pid {self.pid}, rc {self.returncode}) {self.log}\n{t[-chars:]}"

    def wait_for_log(self, needle: str, timeout: float = 30.0) -> None:
        """Block until ``needle`` appears in the log (raises with the tail otherwise)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if needle in self.text():
                return
            if not self.alive():
                break
            time.sleep(0.1)
        if needle in self.text():
            return
        raise TimeoutError(f"{needle!r} not in the log of {self.name} within {timeout}s\n{self.tail()}")

    def kill(self, sig: int = signal.SIGTERM, grace: float = 10.0) -> None:
        """Signal the process group and every descendant; SIGKILL whatever survives ``grace``."""
        pids = [self.pid, *descendants(self.pid)]
        self._signal(pids, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and self.alive():
            time.sleep(0.05)
        # Descendants may have been reparented (e.g. SuperExec children): find them again.
        left = [p for p in pids + descendants(self.pid) if _exists(p)]
        if self.alive() or left:
            self._signal(left + [self.pid], signal.SIGKILL)
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - a zombie-proof last resort
            pass
        _LIVE.pop(self.pid, None)

    def _signal(self, pids: list[int], sig: int) -> None:
        try:
            os.killpg(self.pid, sig)  # the group we created with start_new_session=True
        except (ProcessLookupError, PermissionError):
            pass
        for p in pids:
            try:
                os.kill(p, sig)
            except (ProcessLookupError, PermissionError):
                pass


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still "exists" until reaped; /proc/<pid>/stat says 'Z'.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rfind(")") + 2] != "Z"
    except OSError:
        return False


@atexit.register
def _kill_leftovers() -> None:
    for proc in list(_LIVE.values()):
        proc.kill(signal.SIGKILL, grace=0)


# ----------------------------------------------------------------------------- the harness


class FlowerProcs:
    """Start, watch and kill Flower processes; run the ``flwr`` CLI against them.

    ``workdir`` holds ``flwr_home/`` (the isolated ``FLWR_HOME``) and ``logs/``.
    ``extra_env`` is added to every command's environment.
    """

    def __init__(self, workdir: Path, extra_env: Mapping[str, str] | None = None) -> None:
        self.workdir = Path(workdir)
        self.flwr_home = self.workdir / "flwr_home"
        self.logs = self.workdir / "logs"
        self.flwr_home.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        # `flwr run .` against a `:local:` connection starts a detached SuperLink that
        # outlives the command; give it ports of its own (not 39091/39093, which another
        # user's local SuperLink on this machine may hold and `flwr` would silently reuse).
        local = {
            "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
            "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
        }
        self.env = flower_env(self.flwr_home, {**local, **(extra_env or {})})
        self.procs: dict[str, FlowerProc] = {}
        self.finished: set[int] = set()  # runs whose whole log was streamed to logs/run-<id>.log

    # -- lifecycle

    def __enter__(self) -> FlowerProcs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(
        self,
        name: str,
        argv: Sequence[str],
        ready_port: int | None = None,
        ready_log: str | None = None,
        timeout: float = 60.0,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> FlowerProc:
        """Start ``argv`` in a new process group, logging to ``logs/<name>.log``.

        Waits for ``ready_port`` to accept connections and/or ``ready_log`` to appear
        in the log, at most ``timeout`` seconds (raising with the log tail).
        """
        if name in self.procs and self.procs[name].alive():
            raise ValueError(f"a process named {name!r} is already running")
        log = self.logs / f"{name}.log"
        with open(log, "ab") as out:
            popen = subprocess.Popen(
                list(argv),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=cwd or self.workdir,
                env={**self.env, **(env or {})},
                start_new_session=True,
            )
        proc = FlowerProc(name, argv, popen, log)
        self.procs[name] = proc
        _LIVE[proc.pid] = proc
        if ready_port is not None:
            wait_for_port(ready_port, timeout=timeout, proc=proc)
        if ready_log is not None:
            proc.wait_for_log(ready_log, timeout=timeout)
        return proc

    def kill(self, name: str, sig: int = signal.SIGTERM, grace: float = 10.0) -> None:
        """Kill the named process with its whole process tree."""
        self.procs[name].kill(sig, grace)

    def close(self) -> None:
        """Kill every process still running, newest first, then the managed local SuperLink, then
        what they left behind (:meth:`stop_leftovers`)."""
        sessions = self.sessions()
        for proc in reversed(list(self.procs.values())):
            proc.kill(signal.SIGTERM, grace=5.0)
        self.stop_local_superlink()
        self.stop_leftovers(sessions)

    def sessions(self) -> set[int]:
        """The sessions of every live process started here and of its descendants (a SuperExec
        makes one of its own, which its simulation's Ray processes share), never this process's."""
        pids = [p.pid for p in self.procs.values() if p.alive()] + self.local_superlink_pids()
        found = {session(p) for p in pids + [d for p in pids for d in descendants(p)]}
        return found - {None, os.getsid(0)}

    def stop_leftovers(self, sessions: set[int], grace: float = 5.0) -> list[int]:
        """SIGTERM, then after ``grace`` s SIGKILL, every process (never this one) in one of
        ``sessions`` or whose environment holds this harness's FLWR_HOME; the pids found.

        Killing the process trees misses what left them before: Ray agents whose raylet was
        killed (Ray's shutdown under load) are reparented to init and linger for minutes. Their
        session and environment are still the run's; nothing else is matched, so another
        user's or session's processes (the shared test Ray cluster's, say) are never touched.
        """
        mark = f"FLWR_HOME={self.flwr_home}".encode()
        found = [p for p in _pids() if p != os.getpid() and (session(p) in sessions or _has_env(p, mark))]
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
            for p in found:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(p, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and any(_exists(p) for p in found):
                time.sleep(0.05)
        return found

    def start_local_superlink(self, timeout: float = 180.0) -> None:
        """Start the SuperLink that `flwr run` would start for a `:local-in-memory:` connection, and
        wait for it.

        The same command as ``flwr.cli.local_superlink`` (so `flwr` finds it healthy and uses it),
        started here because Flower gives its own start 15 s: on a loaded 2-core machine running
        several simulation tests at once, a SuperLink's imports alone can take longer. Without
        ``--database`` (`:local:` passes one): state in memory, as in test_deployment. With SQLite,
        a write that waits past Flower's fixed 5 s ``busy_timeout`` (a starved core) is an HTTP 500,
        which the simulation process does not retry: on a task heartbeat it ends the heartbeat
        thread (the run is failed within 60 s), on PushLogs the log upload (`flwr log` stops short).
        No test needs the state after the SuperLink is gone: close() ends it with the test.
        """
        runtime = self.flwr_home / "local-superlink"
        runtime.mkdir(parents=True, exist_ok=True)
        port = self.env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"]
        argv = [
            "flower-superlink",
            "--insecure",
            "--simulation",
            "--isolation",
            "subprocess",
            "--control-api-address",
            f"127.0.0.1:{self.env['FLWR_LOCAL_CONTROL_API_PORT']}",
            "--host",
            "127.0.0.1",
            "--port",
            port,
            "--log-file",
            str(runtime / "superlink.log"),
        ]
        proc = self.start("local-superlink", argv, ready_port=int(port), timeout=timeout)
        deadline = time.monotonic() + timeout
        while True:  # the port opens before the app behind it serves: ask /health, as `flwr` does
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline or not proc.alive():
                raise TimeoutError(f"the local SuperLink is not healthy after {timeout}s\n{proc.tail()}")
            time.sleep(0.2)

    def local_superlink_pids(self) -> list[int]:
        """PIDs of the SuperLink that `flwr` started for a `:local:` connection of THIS harness.

        `flwr` detaches it (it is not our child); it is recognised by its log file, which
        lies under this harness's own FLWR_HOME, so no other user's process can match.
        """
        marker = str(self.flwr_home / "local-superlink") + "/"
        pids = []
        for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
            if entry.name.isdigit() and marker in cmdline(int(entry.name)):
                pids.append(int(entry.name))
        return pids

    def stop_local_superlink(self, grace: float = 5.0) -> None:
        """Kill the managed local SuperLink (and its children) started under this FLWR_HOME."""
        pids = self.local_superlink_pids()
        pids += [d for p in pids for d in descendants(p)]
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
            for p in pids:
                try:
                    os.kill(p, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and any(_exists(p) for p in pids):
                time.sleep(0.05)

    def report(self, chars: int = 3000) -> str:
        """The tail of every process log, for assertion messages."""
        return "\n".join(p.tail(chars) for p in self.procs.values())

    # -- the flwr CLI

    def flwr(
        self,
        args: Sequence[str],
        cwd: Path | None = None,
        timeout: float = 120.0,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``flwr <args>`` with this harness's environment; raise on failure if ``check``.

        Through ``flwr_cli.run``: a process per command, forked from one that has imported the
        CLI's dependencies (a new `flwr` process spends 2 CPU-seconds on them)."""
        cp = flwr_cli.run(args, self.env, cwd or self.workdir, timeout)
        if check and cp.returncode != 0:
            raise RuntimeError(
                f"`flwr {' '.join(args)}` exited with {cp.returncode}\n"
                f"stdout:\n{cp.stdout[-4000:]}\nstderr:\n{cp.stderr[-4000:]}"
            )
        return cp

    def flwr_json(self, args: Sequence[str], **kw: Any) -> dict[str, Any]:
        """Run ``flwr <args> --format json`` and parse its JSON answer."""
        cp = self.flwr([*args, "--format", "json"], **kw)
        text = cp.stdout
        start = text.find("{")
        if start < 0:
            raise RuntimeError(f"`flwr {' '.join(args)}` printed no JSON:\n{text}\n{cp.stderr}")
        return json.loads(text[start:])

    def ensure_config(self) -> Path:
        """``$FLWR_HOME/config.toml``, written by `flwr` itself (with ``local``) if missing."""
        cfg = self.flwr_home / "config.toml"
        if not cfg.exists():
            self.flwr(["config", "list"])
        return cfg

    def add_connection(
        self,
        name: str,
        address: str,
        root_certificates: Path | None = None,
        insecure: bool = False,
        default: bool = True,
    ) -> None:
        """Add a ``[superlink.<name>]`` connection to ``$FLWR_HOME/config.toml``."""
        cfg = self.ensure_config()
        lines = cfg.read_text().splitlines()
        if default:
            lines = [f'default = "{name}"' if ln.startswith("default") else ln for ln in lines]
        lines += ["", f"[superlink.{name}]", f'address = "{address}"']
        if root_certificates is not None:
            lines.append(f'root-certificates = "{Path(root_certificates).resolve()}"')
        if insecure:
            lines.append("insecure = true")
        cfg.write_text("\n".join(lines) + "\n")

    # -- runs and nodes

    def submit_run(
        self,
        app_dir: Path,
        connection: str,
        run_config: str | None = None,
        federation_config: str | None = None,
        timeout: float = 120.0,
    ) -> int:
        """``flwr run <app_dir> <connection>`` (no ``--stream``); returns the run id.

        ``connection="local"`` is the default ``:local:`` connection: its simulation SuperLink is
        started first (:meth:`start_local_superlink`, on this harness's ports; killed by
        :meth:`close`); the run is sized by
        e.g. ``federation_config="num-supernodes=2 client-resources-num-cpus=1"``.
        """
        self.ensure_config()
        if connection == "local" and not self.local_superlink_pids():
            self.start_local_superlink()
        args = ["run", str(app_dir), connection]
        if run_config:
            args += ["--run-config", run_config]
        if federation_config:
            args += ["--federation-config", federation_config]
        answer = self.flwr_json(args, cwd=app_dir, timeout=timeout)
        if not answer.get("success"):
            raise RuntimeError(f"flwr run failed: {answer}")
        return int(answer["run-id"])

    def run_info(self, run_id: int, connection: str) -> dict[str, Any]:
        """The ``flwr ls --run-id`` record of one run (status, timestamps, traffic)."""
        answer = self.flwr_json(["ls", connection, "--run-id", str(run_id)])
        runs = answer.get("runs") or []
        if not runs:
            raise RuntimeError(f"flwr ls knows no run {run_id}: {answer}")
        return runs[0]

    def wait_for_run(self, run_id: int, connection: str, timeout: float, poll: float = 2.0) -> dict[str, Any]:
        """Wait until the run's status starts with ``finished:``; return its record.

        One ``flwr log --stream`` (the SuperLink ends the stream when the run finishes; the log
        lands in ``logs/run-<id>.log``) instead of a ``flwr ls`` every ``poll`` seconds: each
        `flwr` call is a Python start-up, which on a loaded 2-core machine slows the run it
        waits for. ``flwr ls`` polling only if the stream ends early.
        """
        deadline = time.monotonic() + timeout
        try:
            stream = ["log", str(run_id), connection, "--stream"]
            log = self.logs / f"run-{run_id}.log"
            streamed = flwr_cli.run(stream, self.env, self.workdir, timeout, output=log).returncode == 0
        except subprocess.TimeoutExpired:
            streamed = False  # reported below, with the run's last status
        info: dict[str, Any] = {}
        while True:
            info = self.run_info(run_id, connection)
            if str(info.get("status", "")).startswith("finished"):
                if streamed:  # the stream ran to the run's end: its file is the whole log
                    self.finished.add(run_id)
                return info
            streamed = False  # it ended before the run did
            if time.monotonic() >= deadline:
                break
            time.sleep(poll)
        raise TimeoutError(
            f"run {run_id} not finished after {timeout}s (last: {info.get('status')})\n"
            f"{self.run_log(run_id, connection)[-6000:]}\n{self.report()}"
        )

    def run_log(self, run_id: int, connection: str) -> str:
        """The run's ServerApp log: the stream :meth:`wait_for_run` kept once the run has finished
        (no second `flwr` start-up), else the log so far (``flwr log ID <conn> --show``)."""
        streamed = self.logs / f"run-{run_id}.log"
        if run_id in self.finished and streamed.is_file():
            return streamed.read_text(errors="replace")
        cp = self.flwr(["log", str(run_id), connection, "--show"], check=False, timeout=60)
        return cp.stdout + cp.stderr

    def nodes(self, connection: str) -> list[dict[str, Any]]:
        """``flwr supernode ls``: node records with ``node-id`` and ``status``."""
        return list(self.flwr_json(["supernode", "ls", connection]).get("nodes") or [])

    def wait_for_nodes_online(self, connection: str, count: int, timeout: float = 60.0) -> list[str]:
        """Block until ``count`` SuperNodes are online; return their node ids."""
        deadline = time.monotonic() + timeout
        online: list[str] = []
        while time.monotonic() < deadline:
            online = [str(n["node-id"]) for n in self.nodes(connection) if n.get("status") == "online"]
            if len(online) >= count:
                return online
            time.sleep(0.5)
        raise TimeoutError(f"{len(online)} of {count} SuperNodes online after {timeout}s\n{self.report()}")


def start_ray_head(procs: FlowerProcs, temp_dir: Path, num_cpus: int = 2, timeout: float = 300.0) -> str:
    """A Ray head node on 127.0.0.1 (see :func:`flower_env`) in its own process group; its GCS
    address (``RAY_ADDRESS``).

    ``ray start --block`` keeps the cluster's processes (GCS, raylet, their workers) in its own
    group, so :meth:`FlowerProcs.close` ends them all. Its ``--temp-dir`` is private: the
    cluster never writes ``/tmp/ray/ray_current_cluster``, so a run that starts Ray its own way
    (``ray.init()`` with no address, as `flwr run` does for a user) cannot join it by accident.
    ``num_cpus`` is logical: Flower sizes its actor pool as ``num_cpus // client-resources-num-cpus``.
    Ready in about 12 s on an idle 2-core machine; ``timeout`` leaves room for a busy one (a CI run
    measured over 120 s while the suite's other workers ran).
    """
    port = free_port()
    argv = ["ray", "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}"]
    argv += [f"--num-cpus={num_cpus}", "--num-gpus=0", "--include-dashboard=false", "--disable-usage-stats"]
    argv += ["--object-store-memory=200000000", f"--temp-dir={temp_dir}"]
    # Ports Ray would take at fixed defaults (10001, 8265, 52365): two sessions' heads would collide.
    for flag in ("ray-client-server-port", "dashboard-port", "dashboard-agent-listen-port"):
        argv.append(f"--{flag}={free_port()}")
    proc = procs.start("ray-head", argv, ready_log="block forever", timeout=timeout)
    assert proc.alive(), proc.tail()
    return f"127.0.0.1:{port}"


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One Ray cluster per test session (per pytest-xdist worker) that simulation runs join.

    A run's own ``ray.init()`` starts a cluster (GCS, raylet, dashboard agent, log monitor) and
    stops it again: about 6 s and 5 CPU-seconds per run on 2 cores, paid ~20 times by the suite.
    The runs of the suite join this one through ``RAY_ADDRESS`` (read by ``ray.init``); the
    end-to-end test keeps a user's path (``flower_procs_own_ray``).
    """
    procs = FlowerProcs(tmp_path_factory.mktemp("ray-head"))
    temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # short: Ray's socket paths have a limit
    try:
        yield start_ray_head(procs, temp)
    finally:
        procs.close()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture
def flower_procs(tmp_path: Path, ray_cluster: str) -> Iterator[FlowerProcs]:
    """A :class:`FlowerProcs` in ``tmp_path/flower`` whose simulation runs join ``ray_cluster``;
    every process is killed at teardown.

    The log tails are printed at teardown: pytest shows them for failing tests.
    """
    yield from _procs(tmp_path, {"RAY_ADDRESS": ray_cluster})


@pytest.fixture
def flower_procs_own_ray(tmp_path: Path) -> Iterator[FlowerProcs]:
    """As :func:`flower_procs`, but each simulation run starts its own Ray, as `flwr run` does."""
    yield from _procs(tmp_path, None)


def _procs(tmp_path: Path, extra_env: Mapping[str, str] | None) -> Iterator[FlowerProcs]:
    procs = FlowerProcs(tmp_path / "flower", extra_env)
    try:
        yield procs
    finally:
        procs.close()
        if procs.procs:
            print(procs.report())
