"""Reading docker/ and the repository's stdlib-only scripts in tests (test_docker_files.py, and the
loopback deployment in test_deployment.py)."""

from __future__ import annotations

import functools
import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"


def load_compose(name: str) -> dict[str, Any]:
    """docker/``name`` parsed as Compose reads it."""
    # Plain safe YAML (merge keys included): a Compose v2-only tag (!override, !reset) fails here.
    data = yaml.safe_load((DOCKER / name).read_text())
    assert isinstance(data, dict) and isinstance(data.get("services"), dict), name
    return data


def health_probe(svc: dict[str, Any]) -> tuple[str, str]:
    """(the service's healthcheck Python probe, the host:port it dials)."""
    test = svc["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"], test
    m = re.search(r"insecure_channel\('([^']+)'\)", test[3])
    assert m, test[3]
    return test[3], m.group(1)


@functools.cache
def script_module(path: Path):
    """A stdlib-only script of this repository as a module (without running its main)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def e2e_script():
    """scripts/docker_e2e.py as a module: the home of the deployment's learning criterion."""
    return script_module(ROOT / "scripts" / "docker_e2e.py")
