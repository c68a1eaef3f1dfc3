"""Flower's base images flwr/{superlink,supernode,superexec}:<flwr>, made on this host where the
daemon lacks them (``scripts/docker_e2e.py``'s ``bases`` phase): a Debian bookworm root file
system from ``debootstrap`` (cached as a tarball), Python 3.11, a venv with the pinned flwr, user
``app`` and Flower's entry points, plus this machine's CA bundle and pip settings."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the sibling modules, also when this file is loaded by its path (tests)
    sys.path.insert(0, str(HERE))

from docker_e2e_host import FLWR_VERSION, Failed, Host  # noqa: E402

# python3.11-venv needs python3.11-distutils, a virtual package (python3-distutils provides it),
# which debootstrap does not resolve.
ROOTFS_PACKAGES = "python3.11,python3.11-venv,python3-distutils,ca-certificates,passwd"

BASE_DOCKERFILE = """\
# Flower's base image layout (framework/docker/base/ubuntu/Dockerfile) on a Debian root file system.
ARG ROOTFS
FROM ${ROOTFS} AS base
ENV PATH=/python/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \\
    DEBIAN_FRONTEND=noninteractive \\
    PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PYTHONIOENCODING=UTF-8 LANG=C.UTF-8 LC_ALL=C.UTF-8
# This machine's CA bundle and pip settings: pip in every later build reaches the same registry.
COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY pip.conf /etc/pip.conf
ARG FLWR_VERSION
RUN python3.11 -m venv /python/venv \\
 && pip install --no-cache-dir "flwr==${FLWR_VERSION}" \\
 && useradd --no-create-home --home-dir /app -c "" --uid 49999 app \\
 && mkdir -p /app && chown -R app:app /app /python/venv \\
 && test "$(id -u app):$(id -g app)" = "49999:49999"
WORKDIR /app
USER app
ENV HOME=/app

FROM base AS superlink
ENTRYPOINT ["flower-superlink"]
FROM base AS supernode
ENTRYPOINT ["flower-supernode"]
FROM base AS superexec
ENTRYPOINT ["flower-superexec"]
"""


class LocalBases(Host):
    """``bases`` and what it needs from this machine (``FEDDIFRC_E2E_CACHE``: the rootfs tarball;
    ``FEDDIFRC_E2E_DEBIAN_MIRROR``)."""

    def __init__(self, work: Path) -> None:
        super().__init__(work)
        self.cache = Path(os.environ.get("FEDDIFRC_E2E_CACHE", Path.home() / ".cache" / "feddifrc-e2e"))
        self.mirror = os.environ.get("FEDDIFRC_E2E_DEBIAN_MIRROR", "http://deb.debian.org/debian")

    def bases(self) -> str:
        names = {role: f"flwr/{role}:{FLWR_VERSION}" for role in ("superlink", "supernode", "superexec")}
        missing = [role for role, ref in names.items() if not self.image_exists(ref)]
        if not missing:
            return "all three already present (kept)"
        rootfs = self.rootfs_image()
        context = self.work / "base-context"
        context.mkdir(exist_ok=True)
        (context / "Dockerfile").write_text(BASE_DOCKERFILE)
        (context / "pip.conf").write_text(self.pip_conf())
        shutil.copyfile(self.ca_bundle(), context / "ca-certificates.crt")
        for role in missing:
            self.sh(
                ["docker", "build", "--network", "host", "--target", role, "-t", names[role],
                 "--build-arg", f"ROOTFS={rootfs}", "--build-arg", f"FLWR_VERSION={FLWR_VERSION}",
                 str(context)],
                timeout=600,
            )  # fmt: skip
        return f"built locally: {', '.join(missing)}"

    def rootfs_image(self) -> str:
        """A Debian bookworm root file system with Python 3.11, as a local image (tarball cached)."""
        ref = "feddifrc-e2e/debian-python:bookworm"
        if self.image_exists(ref):
            return ref
        tarball = self.cache / "debian-bookworm-python3.11.tar"
        if not tarball.is_file():
            if shutil.which("debootstrap") is None:
                raise Failed("debootstrap not found (apt-get install debootstrap)")
            self.cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=self.work) as tmp:
                target = Path(tmp) / "rootfs"
                self.sh(["debootstrap", "--variant=minbase", f"--include={ROOTFS_PACKAGES}",
                         "bookworm", str(target), self.mirror], timeout=600)  # fmt: skip
                self.sh(["sh", "-c", "rm -rf var/cache/apt/archives/*.deb var/lib/apt/lists/*"], cwd=target)
                partial = tarball.with_suffix(".partial")
                self.sh(["tar", "-C", str(target), "--numeric-owner", "-cf", str(partial), "."], timeout=300)
                partial.rename(tarball)  # whole or absent: an interrupted run leaves no half tarball
        self.sh(["docker", "import", str(tarball), ref], timeout=300)
        return ref

    def pip_conf(self) -> str:
        """This machine's pip settings that reach a registry (file:// indexes, find-links and
        constraint files name paths of this machine and are left out)."""
        kept = {"index-url", "extra-index-url", "trusted-host", "timeout", "default-timeout", "retries"}
        values: dict[str, str] = {}
        cp = self.sh([sys.executable, "-m", "pip", "config", "list"], 60)
        for line in cp.stdout.splitlines():  # global.index-url='...' ; :env:.timeout='180'
            key, _, value = line.partition("=")
            name = key.rsplit(".", 1)[-1]
            if name in kept:
                values["timeout" if name == "default-timeout" else name] = value.strip("'\"")
        for name in ("index-url", "extra-index-url"):
            if name in values:
                urls = [u for u in values[name].split() if u.startswith(("http://", "https://"))]
                values[name] = " ".join(urls)
        lines = ["[global]", "cert = /etc/ssl/certs/ca-certificates.crt"]
        lines += [f"{k} = {v}" for k, v in sorted(values.items()) if v]
        return "\n".join(lines) + "\n"

    def ca_bundle(self) -> Path:
        cp = self.sh([sys.executable, "-m", "pip", "config", "list"], 60)
        for line in cp.stdout.splitlines():
            if line.partition("=")[0].endswith(".cert"):
                return Path(line.partition("=")[2].strip("'\""))
        for path in (Path("/etc/ssl/certs/ca-certificates.crt"), Path("/etc/pki/tls/certs/ca-bundle.crt")):
            if path.is_file():
                return path
        raise Failed("no CA bundle found (pip's cert setting, /etc/ssl/certs/ca-certificates.crt)")

    def registry_index(self) -> str:
        for line in self.sh([sys.executable, "-m", "pip", "config", "list"], 60).stdout.splitlines():
            if line.partition("=")[0].endswith(".index-url") and "extra" not in line.partition("=")[0]:
                return line.partition("=")[2].strip("'\"")
        return os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple")
