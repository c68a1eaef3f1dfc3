"""The wheels a bare GPU host lacks for benchmarks/gpu_check.py, downloaded to carry along.

    python scripts/carry_wheels.py                       # here, with network: into wheels/
    python scripts/carry_wheels.py --python-version 3.12 # the GPU host's Python, if not 3.11

A bare GPU host (docs/gpu-check.md) has a CUDA torch, torchvision, transformers, accelerate and
scikit-learn, and no flwr, ray, diffusers, matplotlib or importlib_metadata. ``CARRY`` is what
the check needs beyond that, pinned: diffusers (B to E), flwr and the pure-Python or binary
dependencies its deployment engine imports (G: SuperLink, SuperNodes, ``flwr run``; no uv, no
uvicorn extras: runtime installation is off), matplotlib (the ServerApp's plots). Packages a
torch + transformers host may already have are in it too; pip skips what is there.

Each wheel is fetched with ``pip download --no-deps --only-binary=:all:`` for the host's Python
and ``manylinux`` x86_64, into ``--dest`` (default ``wheels/``, git-ignored; the device tool
carries it when named in ``carry``), with ``carry.txt`` listing the names. On the host, one
command installs them, without resolving dependencies (diffusers' ``importlib_metadata``, which
Python 3.8+ does not need, is never asked for):

    python -m pip install --upgrade --no-index --no-deps --find-links wheels -r wheels/carry.txt
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT_BYTES = 64 * 2**20  # what the device tool carries, all paths together
INSTALL = "python -m pip install --upgrade --no-index --no-deps --find-links {d} -r {d}/carry.txt"
# (pin, why): the check's imports beyond a torch + transformers + accelerate + scikit-learn host
CARRY: tuple[tuple[str, str], ...] = (
    ("diffusers==0.42.1", "the teachers (B-E, G)"),
    ("requests==2.34.2", "diffusers, flwr"),
    ("urllib3==2.8.0", "requests"),
    ("charset-normalizer==3.5.3", "requests"),
    ("certifi==2026.10.19.post1", "requests, httpx, flwr"),
    ("idna==3.21", "requests, httpx"),
    ("flwr==1.42.0", "G: the deployment engine, the flwr CLI"),
    ("grpcio==1.85.4", "flwr"),
    ("grpcio-health-checking==1.81.1", "flwr"),
    ("protobuf==6.33.6", "flwr"),
    ("cryptography==50.0.2", "flwr"),
    ("cffi==2.1.1", "cryptography"),
    ("pycparser==3.12", "cffi"),
    ("pycryptodome==3.24.1", "flwr"),
    ("iterators==0.0.2", "flwr"),
    ("pathspec==1.1.1", "flwr (the FAB)"),
    ("tomli==2.5.0", "flwr"),
    ("tomli-w==1.2.0", "flwr"),
    ("prompt-toolkit==3.0.53", "flwr"),
    ("wcwidth==0.9.5", "prompt-toolkit"),
    ("sqlalchemy==2.1.9", "flwr (the SuperLink's state)"),
    ("greenlet==3.5.6", "sqlalchemy[asyncio]"),
    ("alembic==1.20.1", "flwr"),
    ("mako==1.4.3", "alembic"),
    ("fastapi==0.138.2", "flwr (the SuperLink's HTTP API)"),
    ("starlette==1.3.1", "flwr, fastapi"),
    ("pydantic==2.14.4", "fastapi"),
    ("pydantic-core==2.50.5", "pydantic"),
    ("annotated-types==0.8.0", "pydantic"),
    ("typing-inspection==0.4.5", "pydantic, fastapi"),
    ("annotated-doc==0.0.7", "fastapi"),
    ("typing-extensions==4.16.0", "pydantic needs >= 4.16"),
    ("uvicorn==0.49.0", "flwr"),
    ("h11==0.16.0", "uvicorn, httpcore"),
    ("httpx==0.29.0", "flwr"),
    ("httpcore==1.0.9", "httpx"),
    ("anyio==4.16.0", "httpx, starlette"),
    ("typer==0.20.1", "flwr (the CLI)"),
    ("click==8.5.1", "flwr, typer, uvicorn"),
    ("shellingham==1.5.4", "typer"),
    ("rich==14.3.4", "flwr, typer"),
    ("markdown-it-py==4.3.0", "rich"),
    ("mdurl==0.1.2", "markdown-it-py"),
    ("pygments==2.21.0", "rich"),
    ("matplotlib==3.11.2", "the ServerApp's plots (tools/report.py)"),
    ("contourpy==1.3.3", "matplotlib"),
    ("cycler==0.12.1", "matplotlib"),
    ("fonttools==4.69.1", "matplotlib"),
    ("kiwisolver==1.5.1", "matplotlib"),
    ("pyparsing==3.3.3", "matplotlib"),
    ("python-dateutil==4.0.0", "matplotlib"),
    ("tzdata==2026.6", "python-dateutil"),
)
# glibc tags accepted for binary wheels (pip does not widen a --platform itself); 2.34: cryptography's
PLATFORMS = ("manylinux_2_34", "manylinux_2_28", "manylinux_2_27", "manylinux_2_24", "manylinux_2_17",
             "manylinux2014", "manylinux_2_5", "manylinux1")  # fmt: skip


def names() -> list[str]:
    return [pin.split("==")[0] for pin, _ in CARRY]


def download_argv(dest: Path, python_version: str, arch: str) -> list[str]:
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest)]
    argv += ["--python-version", python_version, "--implementation", "cp"]
    for tag in PLATFORMS:
        argv += ["--platform", f"{tag}_{arch}"]
    return argv + [pin for pin, _ in CARRY]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", default=str(ROOT / "wheels"), help="the folder to carry (default: wheels/)")
    ap.add_argument("--python-version", default="3.11", help="the GPU host's Python, e.g. 3.11")
    ap.add_argument("--arch", default="x86_64", help="the GPU host's machine (x86_64, aarch64)")
    a = ap.parse_args(argv)
    dest = Path(a.dest).expanduser()
    if dest.exists() and not dest.is_dir():
        print(f"scripts/carry_wheels.py: error: --dest {dest} is a file; name a folder", file=sys.stderr)
        return 2
    dest.mkdir(parents=True, exist_ok=True)
    rc = subprocess.run(download_argv(dest, a.python_version, a.arch)).returncode
    if rc != 0:
        return rc
    (dest / "carry.txt").write_text("\n".join(names()) + "\n")
    wheels = sorted(dest.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB ({total:,} bytes) in {dest}")
    if total > LIMIT_BYTES:
        limit = LIMIT_BYTES / 2**20
        print(f"over the {limit:.0f} MiB a device call carries: empty {dest} and rerun", file=sys.stderr)
        return 1
    print("on the GPU host, in the checkout:\n  " + INSTALL.format(d=dest.name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
