"""tests/flwr_cli.py: each ``flwr`` command of the harness is a process of its own that reads its
own environment, as a typed command is, though forked from one that imported the CLI once."""

from __future__ import annotations

import http.server
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import flwr_cli
import pytest
from flower_procs import FlowerProcs, flower_env, free_port


@pytest.fixture
def health_server() -> Iterator[tuple[int, list[str], list[float]]]:
    """A stand-in for a local SuperLink's HTTP API: healthy, every other request refused (500)
    after ``delay[0]`` seconds; the paths it was asked for."""
    paths: list[str] = []
    delay = [0.0]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802  (http.server's name)
            paths.append(self.path)
            if self.path != "/health":
                time.sleep(delay[0])
            self.send_response(200 if self.path == "/health" else 500)
            self.end_headers()

        do_POST = do_GET  # noqa: N815

        def log_message(self, *args: object) -> None:
            pass

    port = free_port()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield port, paths, delay
    finally:
        server.shutdown()


def test_each_command_has_its_own_home_directory_output_and_status(tmp_path: Path) -> None:
    for name in ("a", "b"):
        env = flower_env(tmp_path / name)
        cp = flwr_cli.run(["config", "list"], env, tmp_path, timeout=120)
        assert cp.returncode == 0, cp.stderr
        assert f"{tmp_path / name / 'config.toml'}" in cp.stdout.replace("\n", "")
        assert (tmp_path / name / "config.toml").is_file()
    bad = flwr_cli.run(["no-such-command"], flower_env(tmp_path / "a"), tmp_path, timeout=120)
    assert bad.returncode == 2 and "No such command" in bad.stderr  # click's usage error


def test_the_local_superlink_port_is_read_per_command(tmp_path: Path, health_server) -> None:
    """Flower reads FLWR_LOCAL_SUPERLINK_HTTP_API_PORT when flwr.cli is imported: a child that
    reused the server's import would ask the port of the first command (or Flower's 39091)."""
    port, paths, _ = health_server
    other = flower_env(tmp_path / "other")  # a command with another port first
    flwr_cli.run(["config", "list"], other, tmp_path, timeout=120)
    out = tmp_path / "ls.log"
    # FlowerProcs: were the port not read, `flwr` would start a local SuperLink under this
    # FLWR_HOME, which closing the harness kills.
    with FlowerProcs(tmp_path / "flower", {"FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(port)}) as procs:
        cp = flwr_cli.run(["ls", "local", "--format", "json"], procs.env, tmp_path, timeout=120, output=out)
        started = procs.local_superlink_pids()
    assert not started and paths and paths[0] == "/health", paths  # found "its" SuperLink there
    assert cp.stdout == "" and '"success": false' in out.read_text()  # the stand-in refused the listing


def test_a_command_past_its_timeout_is_killed(tmp_path: Path, health_server) -> None:
    port, _, delay = health_server
    delay[0] = 60.0  # the stand-in holds the stream (Flower sets no read timeout on it)
    with FlowerProcs(tmp_path / "flower", {"FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(port)}) as procs:
        with pytest.raises(subprocess.TimeoutExpired):
            flwr_cli.run(["log", "1", "local", "--stream"], procs.env, tmp_path, timeout=5)
        still = flwr_cli.run(["config", "list"], procs.env, tmp_path, timeout=120)  # the server goes on
        assert still.returncode == 0
