"""The Docker end-to-end test's commands on this host (``scripts/docker_e2e.py``): each one
logged, bounded in time and failing with its one-line reason; Compose on the e2e project, and
``flwr`` with the run's own FLWR_HOME."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
FLWR_VERSION = "1.42.0"  # docker/*.Dockerfile's FLWR_VERSION (tests/test_docker_files.py checks)
PROJECT = "feddifrc-e2e"  # the Compose project: its own containers and volumes


class Failed(Exception):
    """A phase failed; the message is its one-line reason."""


class PhaseTimeout(Failed):
    pass


class Host:
    """The work folder's log, Compose file, RUNS_DIR and FLWR_HOME, and the commands that use them."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.log = work / "e2e.log"
        self.runs_dir = work / "runs"
        self.flwr_home = work / "flwr-home"
        # Generated into the work folder (docker/ keeps only the committed files); its relative
        # paths (./certs, build contexts) resolve against docker/, given as the project directory.
        self.compose_file = work / "compose.e2e.yml"
        self.compose: list[str] = []

    def sh(
        self, args: list[str], timeout: float = 120, check: bool = True, env: dict | None = None, **kw: Any
    ) -> subprocess.CompletedProcess:
        """Run a command, its output appended to the log (and returned); a failure names the command."""
        with open(self.log, "a") as f:
            f.write(f"\n$ {shlex.join(args)}\n")
        try:
            cp = subprocess.run(
                args,
                cwd=kw.pop("cwd", ROOT),
                env={**os.environ, **(env or {})},
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout,
                **kw,
            )
        except subprocess.TimeoutExpired as e:
            raise Failed(f"`{shlex.join(args)[:120]}` ran past {timeout:.0f}s") from e
        with open(self.log, "a") as f:
            f.write(cp.stdout + cp.stderr)
        if check and cp.returncode != 0:
            tail = (cp.stdout + cp.stderr).strip().splitlines()[-15:]
            raise Failed(f"`{shlex.join(args)[:160]}` exited {cp.returncode}:\n    " + "\n    ".join(tail))
        return cp

    def dc(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        """Compose on the e2e file, v1 or v2 (same arguments)."""
        env = {"RUNS_DIR": str(self.runs_dir), "FLWR_VERSION": FLWR_VERSION}
        return self.sh([*self.compose_cmd(), *args], timeout, check, env, cwd=DOCKER)

    def compose_cmd(self) -> list[str]:
        return [
            *self.compose,
            "-p",
            PROJECT,
            "-f",
            str(self.compose_file),
            "--project-directory",
            str(DOCKER),
        ]

    def flwr(self, *args: str, timeout: float = 120) -> dict[str, Any]:
        """`flwr <args> --format json` with this run's FLWR_HOME; its JSON answer."""
        env = {
            "FLWR_HOME": str(self.flwr_home),
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "NO_COLOR": "1",
        }
        cp = self.sh(["flwr", *args, "--format", "json"], timeout, check=False, env=env)
        start = cp.stdout.find("{")
        if start < 0:
            raise Failed(f"`flwr {' '.join(args)}` printed no JSON: {(cp.stdout + cp.stderr)[-400:]}")
        return json.loads(cp.stdout[start:])

    def image_exists(self, ref: str) -> bool:
        return self.sh(["docker", "image", "inspect", ref], 30, check=False).returncode == 0
