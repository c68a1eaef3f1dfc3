"""Shared test fixtures: the app's real defaults and small overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from feddifrc_app.config import Config
from feddifrc_app.config_loader import load_config
from feddifrc_app.tools.run_config import app_defaults

ROOT = Path(__file__).resolve().parents[1]

# The Flower process fixtures (flower_procs, flower_procs_own_ray, ray_cluster) for every test file.
pytest_plugins = ("flower_procs",)


# Most unit tests exercise the plumbing on sklearn's digits with the embedded RANDOM tiny
# teacher at the paper's 512-d width: small and independent of the packaged weights. Tests
# of the quickstart defaults (mnist-5k, the pretrained tiny-mnist teacher) pass
# ``plumbing=False``.
PLUMBING: dict[str, Any] = {
    "dataset.name": "digits",
    "dataset.image-size": 16,
    "model.width": 64,
    "diffusion.model": "tiny",
    "diffusion.resolution": 16,
    "diffusion.channels": "256,128,128",
}


def default_run_config(plumbing: bool = True, **overrides: Any) -> dict[str, Any]:
    """The flat [tool.flwr.app.config] table of pyproject.toml (with ``PLUMBING`` unless
    ``plumbing=False``), with dotted-key overrides.

    Keyword names use '__' for '.' and '_' for '-': dataset__train_limit=64.
    """
    cfg = app_defaults(ROOT)
    if plumbing:
        cfg.update(PLUMBING)
    for k, v in overrides.items():
        key = k.replace("__", ".").replace("_", "-")
        assert key in cfg, key
        cfg[key] = v
    return cfg


def make_config(plumbing: bool = True, **overrides: Any) -> Config:
    return load_config(default_run_config(plumbing, **overrides))


@pytest.fixture(scope="session")
def teacher_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache folder per test session: the tiny teacher and its features are built once."""
    return tmp_path_factory.mktemp("feddifrc-app-cache")


@pytest.fixture
def tmp_cache(tmp_path: Path) -> Path:
    d = tmp_path / "cache"
    d.mkdir()
    return d


@pytest.fixture(autouse=True)
def flower_task_identity():
    """Flower 1.42 stamps every Message with the process's task identity (set by the
    SuperExec in real runs); handler tests build real Messages in-process, so set one."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


_HOLD = (
    "import sys; from pathlib import Path; from feddifrc_app.files import lock_folder; "
    "lock_folder(Path(sys.argv[1]), 'a test holder'); print('locked', flush=True); sys.stdin.read()"
)


@pytest.fixture
def holder():
    """Other processes that own a folder (``start(folder)``: a new one, returned once it holds the
    folder), killed at teardown (test_ownership.py, test_cli_runs.py)."""
    import os
    import subprocess
    import sys

    procs: list[subprocess.Popen] = []

    def start(folder: Path) -> subprocess.Popen:
        folder.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        p = subprocess.Popen(
            [sys.executable, "-c", _HOLD, str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        procs.append(p)
        assert p.stdout.readline().strip() == b"locked"
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
