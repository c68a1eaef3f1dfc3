"""The ``flwr`` CLI for the test harness, without paying its start-up on every command.

A new ``flwr`` process spends about 2 CPU-seconds importing the CLI (typer, rich, grpc, Flower's
protocol and common modules) before it sends one request, and the suite runs many of them
(``flwr run``, ``log --stream`` and ``ls`` per run; ``supernode ls`` polls in the deployment
tests). :func:`run` sends each command to a fork server: a process that has imported those
dependencies once and forks a child per command. The child is a separate process, as a typed
command is: its own environment, working directory, stdout and stderr (files), exit status and
signals. It imports ``flwr.cli`` itself (0.1 s), so the CLI reads its environment as a new
``flwr`` process does (``FLWR_LOCAL_*`` ports are read at import).

Where ``os.fork`` is missing or the server cannot start, :func:`run` starts ``flwr`` processes.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["run"]


def run(
    args: Sequence[str],
    env: Mapping[str, str],
    cwd: Path,
    timeout: float,
    output: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """``flwr <args>`` as ``subprocess.run(..., capture_output=True, text=True)`` would run it.

    ``output``: append stdout and stderr to this file instead (a log stream, readable while it
    runs); the result's ``stdout`` is then empty. ``subprocess.TimeoutExpired`` after ``timeout``
    seconds, the command killed."""
    server = _server()
    if server is None:
        return _subprocess(args, env, cwd, timeout, output)
    return server.run(args, env, cwd, timeout, output)


def _subprocess(
    args: Sequence[str], env: Mapping[str, str], cwd: Path, timeout: float, output: Path | None
) -> subprocess.CompletedProcess[str]:
    argv = ["flwr", *args]
    if output is None:
        return subprocess.run(
            argv,
            cwd=cwd,
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    with open(output, "ab") as out:
        rc = subprocess.run(
            argv,
            cwd=cwd,
            env=dict(env),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            timeout=timeout,
        ).returncode
    return subprocess.CompletedProcess(argv, rc, "", "")


# ----------------------------------------------------------------------------- client side


class _Server:
    """The fork server's process and its line protocol: a JSON request in, the child's pid and
    then its exit code out (one line each)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            # Unbuffered stdio, inherited by every child: a streamed log reaches its file line by line.
            env={
                **os.environ,
                "FLWR_TELEMETRY_ENABLED": "0",
                "FLWR_DISABLE_UPDATE_CHECK": "1",
                "PYTHONUNBUFFERED": "1",
            },
        )
        self.buf = b""
        self.lock = threading.Lock()
        if self._line(120.0) != "ready":
            raise RuntimeError("the flwr fork server did not start")

    def _line(self, timeout: float) -> str | None:
        """The next line from the server, or None after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"the flwr fork server exited ({self.proc.poll()})")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()

    def run(
        self, args: Sequence[str], env: Mapping[str, str], cwd: Path, timeout: float, output: Path | None
    ) -> subprocess.CompletedProcess[str]:
        argv = ["flwr", *args]
        with self.lock, tempfile.TemporaryDirectory(prefix="flwr-cli-") as tmp:
            out = output or Path(tmp) / "stdout"
            err = output or Path(tmp) / "stderr"
            request = {
                "args": list(args),
                "env": dict(env),
                "cwd": str(cwd),
                "out": str(out),
                "err": str(err),
            }
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            pid = int(self._line(60.0) or "0")
            if not pid:
                raise RuntimeError("the flwr fork server did not fork")
            code = self._line(timeout)
            if code is None:  # kill the command; the server reaps it and answers
                with contextlib.suppress(ProcessLookupError):  # it may have ended just now
                    os.kill(pid, signal.SIGKILL)
                self._line(60.0)
                raise subprocess.TimeoutExpired(argv, timeout)
            if output is not None:
                return subprocess.CompletedProcess(argv, int(code), "", "")
            return subprocess.CompletedProcess(argv, int(code), _text(out), _text(err))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


_SERVER: _Server | None = None
_UNAVAILABLE = not hasattr(os, "fork")


def _server() -> _Server | None:
    """The fork server of this process (started on first use; again if it died), or None."""
    global _SERVER, _UNAVAILABLE
    if _UNAVAILABLE:
        return None
    if _SERVER is None or _SERVER.proc.poll() is not None:
        try:
            _SERVER = _Server()
        except (OSError, RuntimeError):
            _UNAVAILABLE = True  # plain `flwr` processes from now on
            return None
        atexit.register(_SERVER.close)
    return _SERVER


# ----------------------------------------------------------------------------- server side


def _serve() -> None:
    """Import the CLI's dependencies, then fork one child per request until stdin closes."""
    import flwr.cli.app  # noqa: F401  (its dependencies stay imported)

    # Forget flwr.cli itself: each child imports it anew, reading that command's environment.
    for name in [m for m in sys.modules if m == "flwr.cli" or m.startswith("flwr.cli.")]:
        del sys.modules[name]
    import flwr

    vars(flwr).pop("cli", None)

    reply = os.fdopen(os.dup(1), "w")  # the protocol's own copy: the children get fd 1 as their stdout
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 1)
    reply.write("ready\n")
    reply.flush()
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(req, null)
        reply.write(f"{pid}\n")
        reply.flush()
        _, status = os.waitpid(pid, 0)
        reply.write(f"{os.waitstatus_to_exitcode(status)}\n")
        reply.flush()


def _child(req: dict, null: int) -> None:
    """In the forked child: become ``flwr <args>`` with the request's environment, cwd and files."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
        out = os.open(req["out"], flags, 0o644)
        err = out if req["err"] == req["out"] else os.open(req["err"], flags, 0o644)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        sys.stdin = open(os.devnull)  # noqa: SIM115
        sys.argv = ["flwr", *req["args"]]
        from flwr.cli.app import app

        try:
            app()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001  (reported as a failed command, as Python would)
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    _serve()
