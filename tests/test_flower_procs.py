"""tests/flower_procs.py's close(): it stops what left the trees of the processes it started (as
Ray agents do when their raylet is killed: reparented to init, lingering for minutes after
scripts/quickstart_reference.py had printed its line), and nothing of anyone else's. Real
processes, no Flower: a stand-in SuperLink whose stand-in SuperExec makes a session of its own."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from flower_procs import FlowerProcs, _exists, descendants, session

# The stand-in SuperLink: a child in a session of its own that stays (a SuperExec) starts an
# orphan in that session without FLWR_HOME (a Ray agent after its setproctitle), and a process
# that detaches into a session of its own (as `flwr` starts a `:local:` SuperLink) keeps it.
LINK = """
import os, subprocess, sys, time
SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:  # the simulation, which exits and leaves its processes behind
        bare = {k: v for k, v in os.environ.items() if k != "FLWR_HOME"}
        a = subprocess.Popen(SLEEP, env=bare)
        b = subprocess.Popen(SLEEP, start_new_session=True)
        open(sys.argv[1] + ".tmp", "w").write(f"{a.pid} {b.pid}")
        os.rename(sys.argv[1] + ".tmp", sys.argv[1])
        os._exit(0)
    time.sleep(600)
time.sleep(600)
"""


def _wait_for(path: Path) -> str:
    deadline = time.monotonic() + 120  # a hang guard only: the file appears in well under a second
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.05)
    return path.read_text()


def test_close_stops_the_orphans_of_its_sessions_and_environment_and_nothing_else(tmp_path: Path) -> None:
    procs = FlowerProcs(tmp_path / "flower")
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    other = subprocess.Popen(  # another harness's process: another FLWR_HOME, a session of its own
        sleeper, env={**os.environ, "FLWR_HOME": str(tmp_path / "other")}, start_new_session=True
    )
    orphans: list[int] = []
    try:
        link = procs.start("link", [sys.executable, "-c", LINK, str(tmp_path / "pids")])
        orphans += [int(x) for x in _wait_for(tmp_path / "pids").split()]
        a, b = orphans
        deadline = time.monotonic() + 120  # a hang guard: the simulation exits at once
        while len(live := [d for d in descendants(link.pid) if _exists(d)]) > 1:  # (a zombie: gone)
            assert time.monotonic() < deadline, live
            time.sleep(0.05)
        (superexec,) = live  # the simulation is gone: the orphans are no descendants
        assert session(superexec) == superexec != session(link.pid)
        assert session(a) == superexec and session(b) == b
        assert b"FLWR_HOME=" not in Path(f"/proc/{a}/environ").read_bytes()

        procs.close()
        assert not _exists(a) and not _exists(b) and not _exists(superexec) and not link.alive()
        assert other.poll() is None and _exists(os.getpid())
    finally:  # should the test fail: this test's own processes, by pid
        procs.close()
        for pid in orphans:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        other.kill()
        other.wait()
