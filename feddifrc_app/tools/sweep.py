"""`feddifrc sweep`: conf files x grid values x seeds, one real `flwr run` after another.

Every cell is validated before the first run starts. Cells are resumable: a finished one
is skipped, an interrupted one continues from its last checkpoint (``resume-from``), a
failed one is recorded with its reason and the sweep goes on. Success is read from
``flwr ls``, because ``flwr run --stream`` exits 0 on a failed run. Layout of ``--out``::

    sweep.json         every cell: conf, seed, grid values, paper number, status, reason
    cells/<name>.toml  the exact run config each cell was submitted with
    runs/<name>/       the cells' run directories (results.json, checkpoints, plots)
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from feddifrc_app.casting import file_above
from feddifrc_app.config import Config
from feddifrc_app.config_changes import run_changes
from feddifrc_app.config_loader import load_config, resumable
from feddifrc_app.files import FolderInUse, folder_holder, lock_folder, write_json
from feddifrc_app.results import Results, summary_text
from feddifrc_app.tools.run_config import parse_run_config
from feddifrc_app.tracking import cell_tags
from feddifrc_app.tracking import check as check_tracking

_PAPER = re.compile(r"^#.*Paper accuracy[^:]*:\s*([0-9.]+)%", re.MULTILINE)

# Keys the sweep sets on every cell (after the conf, --set and --grid): a user value for one
# would be overwritten silently, so it is refused, with what to use instead.
SWEEP_OWNED = {
    "seed": "the sweep sets each cell's seed: use --seeds N (seeds 0..N-1)",
    "outputs-dir": "the sweep writes every cell under <--out>/runs",
    "run-name": "the sweep names every cell's run folder after the cell",
    "resume-from": "the sweep resumes an interrupted cell itself: rerun the same sweep command",
}


class SweepError(ValueError):
    """A sweep that cannot be run as asked (one line, naming the key, file or flag)."""


def refuse_owned_keys(keys: Any, where: str) -> None:
    """``SweepError`` naming the first key of ``keys`` (from ``where``) that the sweep sets itself."""
    for k in keys:
        if k in SWEEP_OWNED:
            raise SweepError(f"{where}: key '{k}' is set by the sweep, not by you ({SWEEP_OWNED[k]})")


@dataclass(frozen=True)
class Cell:
    """One run of the sweep: a conf file (or none) with grid values and a seed."""

    conf: str  # path of the override file, "" = the app's defaults
    seed: int
    grid: dict[str, Any] = field(default_factory=dict)
    paper: float | None = None  # the paper's accuracy (%) quoted in the conf file

    @property
    def name(self) -> str:
        tags = [Path(self.conf).stem if self.conf else "defaults"]
        tags += [f"{k.rsplit('.', 1)[-1]}{v}" for k, v in sorted(self.grid.items())]
        return re.sub(r"[^A-Za-z0-9._-]", "_", "-".join(tags) + f"-s{self.seed}")


def make_cells(confs: list[str], seeds: list[int], grid: dict[str, list[Any]]) -> list[Cell]:
    """Every conf x every combination of grid values x every seed (seed varies slowest)."""
    refuse_owned_keys(grid, "--grid")
    keys = sorted(grid)
    combos = [dict(zip(keys, vals, strict=True)) for vals in itertools.product(*(grid[k] for k in keys))]
    out = []
    for seed in seeds:
        for conf in confs or [""]:
            text = Path(conf).read_text() if conf else ""
            paper = float(m.group(1)) if (m := _PAPER.search(text)) else None
            out += [Cell(conf, seed, combo, paper) for combo in combos]
    seen: dict[str, Cell] = {}
    for c in out:  # a cell's name is its run folder: two cells must never share one
        if (other := seen.setdefault(c.name, c)) is not c:
            if other.conf == c.conf:
                raise SweepError(
                    f"cell {c.name!r} is asked for twice (a conf file or a --grid value repeated)"
                )
            raise SweepError(
                f"conf files {other.conf} and {c.conf} give cells the same name {c.name!r} (the file "
                "name without .toml), so they would share a run folder: rename one of the files"
            )
    return out


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))  # a JSON string is a valid TOML basic string


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cell_config(
    cell: Cell, overrides: dict[str, Any], runs: Path, defaults: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The flat run config of ``cell`` (without resume-from) in a sweep whose runs go to ``runs``:
    the conf file, then ``--set``, then the grid values, then the keys the sweep owns."""
    conf = parse_run_config([cell.conf]) if cell.conf else {}
    refuse_owned_keys(conf, cell.conf)
    flat = {**conf, **overrides, **cell.grid}
    if str({**(defaults or {}), **flat}.get("tracking.backend", "none")).strip().lower() != "none":
        # A tracked cell is tagged with its conf, seed and grid values, after the user's tags.
        tags = [str(flat.get("tracking.tags", "")), *cell_tags(cell.conf, cell.seed, cell.grid)]
        flat["tracking.tags"] = ",".join(t for t in tags if t)
    return {**flat, "seed": cell.seed, "outputs-dir": str(runs), "run-name": cell.name}


def validate_cells(
    cells: list[Cell], defaults: dict[str, Any], overrides: dict[str, Any], runs: Path
) -> dict[str, Config]:
    """Every cell's config, checked before any run or folder: a typo fails the sweep, not cell 17,
    and leaves nothing on disk."""
    refuse_owned_keys(overrides, "--set")
    configs = {c.name: load_config({**defaults, **cell_config(c, overrides, runs, defaults)}) for c in cells}
    for cfg in configs.values():  # a tracking extra missing here fails the sweep, not each cell
        check_tracking(cfg)
    return configs


LOCAL_START_TRIES = 3  # `flwr run` starts of the local SuperLink before a cell is failed


class Flower:
    """`flwr` against ``federation``. The local simulation gets a FLWR_HOME of its own (``home``)
    and stops the SuperLink it started; any other connection (a deployed SuperLink) is the
    user's, defined in the user's Flower configuration, with its credentials: that home is kept."""

    def __init__(self, app: Path, home: Path, federation: str, federation_config: str) -> None:
        self.app, self.home, self.federation, self.federation_config = (
            app,
            home,
            federation,
            federation_config,
        )
        self.env = {
            **os.environ,
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FLWR_TELEMETRY_ENABLED": "0",
            "NO_COLOR": "1",
        }
        if federation == "local":
            home.mkdir(parents=True, exist_ok=True)
            self.env |= {
                "FLWR_HOME": str(home),
                # The local SuperLink `flwr run` starts gets ports of its own: on the default ones,
                # `flwr` would silently reuse another user's (or another sweep's) SuperLink.
                "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(_free_port()),
                "FLWR_LOCAL_CONTROL_API_PORT": str(_free_port()),
            }

    def json(self, *args: str, timeout: float = 300) -> dict[str, Any]:
        cp = subprocess.run(
            ["flwr", *args, "--format", "json"],
            cwd=self.app,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        lines = cp.stdout.splitlines()
        start = next((i for i, line in enumerate(lines) if line.startswith("{")), None)
        if start is None:
            raise RuntimeError(
                f"`flwr {' '.join(args)}` printed no JSON: {cp.stdout[-1500:]} {cp.stderr[-1500:]}"
            )
        return json.loads("\n".join(lines[start:]))

    def run(self, run_config: Path, timeout: float) -> tuple[str, str]:
        """Submit one run, wait for it; (flwr ls status, reason or log tail).

        The run's log streams into ``<run_config>.log`` until the SuperLink ends the stream (the
        run finished): one `flwr` process per cell rather than a `flwr ls` every few seconds.
        """
        args = ["run", ".", self.federation, "--run-config", str(run_config)]
        if self.federation_config:
            args += ["--federation-config", self.federation_config]
        ans = self.json(*args)
        for _ in range(LOCAL_START_TRIES - 1):
            # `flwr` gives the local SuperLink it starts 15 s (and its health probe 0.4 s), which a
            # loaded machine can overrun; no run was submitted, so asking again is safe.
            if ans.get("success") or "Failed to start local SuperLink" not in str(ans.get("error-message")):
                break
            print("the local SuperLink did not start within flwr's 15 s; trying again", flush=True)
            ans = self.json(*args)
        if not ans.get("success"):
            return "submit-failed", json.dumps(ans)[-1500:]
        run_id = str(ans["run-id"])
        try:
            return self._wait(run_id, run_config, timeout)
        except (KeyboardInterrupt, SystemExit):
            # Ctrl-C (or SIGTERM / SIGHUP, cmd_common.exit_on_termination): the run would go on as
            # an orphan writing into the cell's folder; stop it through Flower before the sweep exits.
            print(f"\ninterrupted: stopping Flower run {run_id} (flwr stop) ...", flush=True)
            self.stop(run_id)
            raise

    def stop_leftovers(self) -> list[str]:
        """Stop every run our own local SuperLink still lists as unfinished; their ids. A sweep
        killed before it could stop its run (SIGKILL, a machine that went down) leaves that run
        pending in the SuperLink's state (``<FLWR_HOME>/local-superlink/state.db``), and the next
        SuperLink on this folder launches it again, beside the new run of the same cell. A
        deployed SuperLink's runs are its users': never touched."""
        if self.federation != "local":
            return []
        runs = self.json("ls", self.federation).get("runs") or []
        left = [str(r["run-id"]) for r in runs if not str(r.get("status", "")).startswith("finished")]
        for run_id in left:
            print(
                f"stopping Flower run {run_id}, left unfinished by an earlier sweep of this folder",
                flush=True,
            )
            self.stop(run_id)
        return left

    def stop(self, run_id: str, wait: float = 60) -> str:
        """`flwr stop` the run and wait (bounded) until Flower says it finished; its last status."""
        subprocess.run(
            ["flwr", "stop", run_id, self.federation],
            cwd=self.app,
            env=self.env,
            capture_output=True,
            timeout=wait,
        )
        deadline, status = time.monotonic() + wait, ""
        while time.monotonic() < deadline:
            info = (self.json("ls", self.federation, "--run-id", run_id, timeout=wait).get("runs") or [{}])[0]
            status = str(info.get("status", ""))
            if status.startswith("finished"):
                break
            time.sleep(2)
        return status

    def _wait(self, run_id: str, run_config: Path, timeout: float) -> tuple[str, str]:
        deadline = time.monotonic() + timeout
        with open(run_config.with_suffix(".log"), "wb") as log:
            with contextlib.suppress(subprocess.TimeoutExpired):
                subprocess.run(
                    ["flwr", "log", run_id, self.federation, "--stream"],
                    cwd=self.app,
                    env=self.env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    timeout=timeout,
                )
        info: dict[str, Any] = {}
        while True:  # the stream ended (or timed out): the status says which
            info = (self.json("ls", self.federation, "--run-id", run_id).get("runs") or [{}])[0]
            if str(info.get("status", "")).startswith("finished"):
                return str(info["status"]), str(info.get("status-details", ""))
            if time.monotonic() >= deadline:
                break
            time.sleep(3)
        self.stop(run_id)
        return "timeout", f"not finished after {timeout:.0f}s (last status {info.get('status')})"

    def close(self, grace: float = 10) -> None:
        """Stop a flower-superlink whose --log-file lies in OUR FLWR_HOME (never another one), then
        what our `flwr` commands started and outlived it: every process in that SuperLink's session
        (its simulation and the simulation's Ray, which `flwr` starts in a session of its own) or
        whose environment holds our FLWR_HOME (Ray agents reparented after their raylet went, which
        otherwise linger for minutes after an interrupted run). Never this process's session."""
        sessions = self._stop_superlinks()
        if self.federation != "local":
            return  # a deployed SuperLink's processes are not ours
        mark = f"FLWR_HOME={self.home}".encode()
        deadline = time.monotonic() + grace  # the SuperLink ends its own simulation first, if it can
        while (left := _processes_of(mark, sessions)) and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)

    def _stop_superlinks(self) -> set[int]:
        """SIGTERM our SuperLinks; their sessions (read before they go)."""
        mine, sessions = str(self.home) + "/", set()
        for entry in Path("/proc").glob("[0-9]*"):
            try:
                argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if (
                Path(argv[0] if len(argv) < 2 else argv[1]).name == "flower-superlink"
                and "--log-file" in argv
            ):
                log = argv[argv.index("--log-file") + 1] if argv.index("--log-file") + 1 < len(argv) else ""
                if log.startswith(mine):
                    with contextlib.suppress(OSError):
                        pid = int(entry.name)
                        if os.getsid(pid) == pid:  # `flwr` starts it detached: the session is the run's
                            sessions.add(pid)
                        os.kill(pid, signal.SIGTERM)
        return sessions - {os.getsid(0)}


def _processes_of(mark: bytes, sessions: set[int]) -> list[int]:
    """Our user's processes (never this one) in one of ``sessions`` or whose environment holds the
    entry ``mark``."""
    out = []
    for entry in Path("/proc").glob("[0-9]*"):
        pid = int(entry.name)
        try:
            if pid != os.getpid() and (
                os.getsid(pid) in sessions or mark in (entry / "environ").read_bytes().split(b"\0")
            ):
                out.append(pid)
        except OSError:  # gone, or another user's
            continue
    return out


def check_out(out: Path) -> None:
    """``--out`` can be a sweep folder: not a file, nor under one (checked first, before the cells'
    configs would name their outputs-dir, ``<out>/runs``, instead)."""
    if out.exists() and not out.is_dir():
        raise SweepError(f"--out {out} is a file; pass a folder for the sweep (new, or an earlier sweep's)")
    if above := file_above(out):
        raise SweepError(f"--out {out}: {above} is a file, so no folder can be created under it")


class Sweep:
    """The cells of one sweep folder, their run configs, and running them in order."""

    def __init__(self, out: Path, app: Path, defaults: dict[str, Any], overrides: dict[str, Any]) -> None:
        refuse_owned_keys(overrides, "--set")
        check_out(out)
        try:
            out.mkdir(parents=True, exist_ok=True)
            # Owned for this process's life: a second sweep into the same --out would run every
            # cell twice into the same run folders.
            lock_folder(out, "feddifrc sweep")
        except FolderInUse as e:
            raise SweepError(f"sweep folder {e}: one sweep per --out") from None
        except OSError as e:
            raise SweepError(f"--out {out}: cannot create or lock it ({e.strerror or e})") from None
        self.out, self.app, self.defaults, self.overrides = out, app, defaults, overrides
        self.runs, self.state_path = out / "runs", out / "sweep.json"
        self.state: dict[str, dict[str, Any]] = {}
        if self.state_path.exists() and not self.state_path.is_file():
            raise SweepError(
                f"{self.state_path} is not a file (a folder?); the sweep records its cells there: "
                "move it aside and rerun"
            )
        if self.state_path.is_file():
            try:
                self.state = json.loads(self.state_path.read_text())["cells"]
                if not isinstance(self.state, dict):
                    raise TypeError("'cells' is not an object")
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise SweepError(
                    f"{self.state_path} is unreadable ({type(e).__name__}: {e}); the runs under "
                    f"{self.runs} are intact: move sweep.json aside and rerun to rebuild it"
                ) from None

    def cell_config(self, cell: Cell) -> dict[str, Any]:
        return cell_config(cell, self.overrides, self.runs, self.defaults)

    def validate(self, cells: list[Cell]) -> dict[str, Config]:
        return validate_cells(cells, self.defaults, self.overrides, self.runs)

    def stale(self, cell: Cell, cfg: Config) -> str:
        """Why the cell's run directory holds a run of other settings ("" if it does not)."""
        try:
            old = json.loads((self.runs / cell.name / "config.json").read_text())
        except (OSError, ValueError):
            return ""
        diff = run_changes(old, cfg.to_flat())
        return f"{self.runs / cell.name} holds a run with other settings ({'; '.join(diff)})" if diff else ""

    def finished(self, cell: Cell, cfg: Config) -> Results | None:
        if self.stale(cell, cfg):
            return None
        from feddifrc_app.tools.report import completed_results

        r, _ = completed_results(self.runs / cell.name, cfg.num_server_rounds)
        return r

    def submit_file(self, cell: Cell) -> Path:
        """Write cells/<name>.toml; an interrupted cell resumes from its last checkpoint."""
        flat = self.cell_config(cell)
        run_dir = self.runs / cell.name
        cfg = load_config({**self.defaults, **flat})
        if run_dir.is_dir() and (who := folder_holder(run_dir)):
            raise SweepError(
                f"run directory {run_dir} is in use by {who}: a run of this cell is still live (of an "
                "interrupted sweep?); stop it (flwr stop <run-id>) or let it end, then rerun the sweep"
            )
        if resumable(cfg) and any((run_dir / "checkpoints").glob("round-*.pt.sha256")):
            flat["resume-from"] = str(run_dir)
        elif run_dir.exists():
            shutil.rmtree(run_dir)  # no round finished, or node state a resume would lack: start over
        path = self.out / "cells" / f"{cell.name}.toml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in flat.items()))
        return path

    def record(self, cell: Cell, **fields: Any) -> None:
        self.state[cell.name] = {**asdict(cell), **fields}
        write_json(self.state_path, {"cells": self.state})


def run_sweep(sweep: Sweep, cells: list[Cell], flower: Flower, cell_timeout: float) -> dict[str, str]:
    """Run every unfinished cell in order; print progress and an ETA; {cell: failure reason}."""
    configs = sweep.validate(cells)
    todo = [c for c in cells if sweep.finished(c, configs[c.name]) is None]
    print(f"sweep {sweep.out}: {len(cells)} cells, {len(cells) - len(todo)} already done, {len(todo)} to run")
    for c in cells:
        if c not in todo:
            sweep.record(c, status="completed", reason="")
    if todo:  # before a cell's run can meet a ghost of an earlier one in its folder
        flower.stop_leftovers()
    failures: dict[str, str] = {}
    t0 = time.monotonic()
    for i, cell in enumerate(todo, 1):
        t_cell = time.monotonic()
        if why := sweep.stale(cell, configs[cell.name]):
            failures[cell.name] = f"{why}: delete it or use another --out"
            sweep.record(cell, status="failed", reason=failures[cell.name])
            print(f"[{i}/{len(todo)}] {cell.name}: SKIPPED ({failures[cell.name]})", flush=True)
            continue
        try:
            status, reason = flower.run(sweep.submit_file(cell), cell_timeout)
        except (RuntimeError, ValueError, OSError, subprocess.SubprocessError) as e:
            status, reason = "error", f"{type(e).__name__}: {e}"
        except (KeyboardInterrupt, SystemExit):  # Flower.run has stopped the cell's run
            sweep.record(
                cell, status="stopped", reason="interrupted (Ctrl-C or a signal); rerun the sweep to resume"
            )
            raise
        done = sweep.finished(cell, configs[cell.name])
        if status != "finished:completed" or done is None:
            failures[cell.name] = f"{status}: {reason}".strip()
        sweep.record(
            cell,
            status="completed" if cell.name not in failures else "failed",
            reason=failures.get(cell.name, ""),
            seconds=round(time.monotonic() - t_cell, 1),
        )
        eta = (time.monotonic() - t0) / i * (len(todo) - i)
        what = summary_text(done.summary) if done else f"FAILED ({status})"
        print(
            f"[{i}/{len(todo)}] {cell.name}: {what} in {time.monotonic() - t_cell:.0f}s; "
            f"{len(todo) - i} left, ETA {eta / 60:.1f} min",
            flush=True,
        )
    return failures
