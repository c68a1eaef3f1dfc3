"""docker/ and scripts/make_certs.sh: consistent with each other and with the installed flwr.

No Docker daemon is needed: the Compose files are parsed as YAML, every flag they
(and docs/deploy.md) pass to a Flower command must exist in that command's
``--help`` (the installed flwr 1.42), every file they mount must exist or be
written by scripts/make_certs.sh, and the committed Compose files must equal the
output of docker/make_compose.py. They must be accepted by Compose v1 (Debian 12's
docker-compose 1.29.2) as well as v2: checked for the constructs v1 refuses (no
``docker-compose`` here to ask). If a ``docker compose`` plugin is installed,
``docker compose config`` validates the files too.
"""

from __future__ import annotations

import functools
import glob
import importlib.metadata
import importlib.util
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from docker_helpers import DOCKER, ROOT, e2e_script, health_probe, load_compose, script_module

MAKE_CERTS = ROOT / "scripts" / "make_certs.sh"
MAKE_COMPOSE = DOCKER / "make_compose.py"
DEPLOY_DOC = ROOT / "docs" / "deploy.md"
COMPOSE_FILES = [
    "compose.yml",
    "compose.insecure.yml",
    "compose.loopback.yml",
    "compose.superlink.yml",
    "compose.supernode.yml",
]
SECURE_FILES = ["compose.yml", "compose.loopback.yml", "compose.superlink.yml", "compose.supernode.yml"]
GENERATED = {  # committed file -> make_compose.py arguments
    "compose.yml": ["--gpus", "0,1"],
    "compose.insecure.yml": ["--gpus", "0,1", "--insecure"],
    "compose.loopback.yml": ["--gpus", "0,1", "--loopback"],
}
# The Compose project of each file (`-p`): v1 has no top-level `name:`, and the default (the
# folder's name) would put the server's and a node's volumes in one project.
PROJECTS = {
    "compose.yml": "feddifrc",
    "compose.insecure.yml": "feddifrc",
    "compose.loopback.yml": "feddifrc",
    "compose.superlink.yml": "feddifrc-server",
    "compose.supernode.yml": r"feddifrc-node-\d+",
}
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))
# Values for the variables that compose.supernode.yml requires (${VAR:?...}).
REQUIRED_ENV = {
    "SUPERLINK_ADDRESS": "superlink.lab.example.org:8000",
    "NODE_CONFIG": 'partition-id=0 num-partitions=2 cache-dir="/app/.cache/feddifrc"',
}
FLWR_VERSION = importlib.metadata.version("flwr")  # the installed flwr (no `import flwr`: slow, noisy)
IMAGE_BINARY = {
    "superlink": "flower-superlink",
    "supernode": "flower-supernode",
    "superexec": "flower-superexec",
}

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="make_certs.sh needs openssl")


# ----------------------------------------------------------------------------- helpers


def make_compose():
    """docker/make_compose.py as a module (stdlib only): its constants are the files' one source."""
    return script_module(MAKE_COMPOSE)


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def interpolate(text: str, env: dict[str, str] | None = None) -> str:
    """Compose variable interpolation with defaults: ${X}, ${X:-default}, ${X:?error}."""
    env = {**REQUIRED_ENV, **(env or {})}

    def sub(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if op in (":-", "-"):
            return env.get(name) or arg
        if op in (":?", "?"):
            assert env.get(name), f"${{{name}}} is required: {arg}"
            return env[name]
        return env.get(name, "")

    return _VAR.sub(sub, text)


@functools.cache
def help_text(*cmd: str) -> str:
    cp = subprocess.run(
        [*cmd, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={
            **os.environ,
            "COLUMNS": "200",
            "NO_COLOR": "1",
            "TERM": "dumb",
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
        },
    )
    assert cp.returncode == 0, f"{cmd} --help failed: {cp.stderr}"
    return re.sub(r"\x1b\[[0-9;]*m", "", cp.stdout + cp.stderr)


_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


@functools.cache
def help_options(*cmd: str) -> dict[str, str]:
    """flag -> its help entry (the flag's line and continuation lines) from ``cmd --help``."""
    text = help_text(*cmd)
    options: dict[str, str] = {}
    current: list[str] = []
    for line in text.splitlines():
        body = line.strip().strip("│").strip()
        if body.startswith("-"):
            current = [f for f in _FLAG.findall(body.split("  ")[0])] or current
            for f in current:
                options[f] = body
        elif current and body:
            for f in current:
                options[f] += " " + body
    return options


def check_flags(cmd: tuple[str, ...], args: list[str], where: str) -> None:
    """Every --flag in ``args`` exists in ``cmd --help``, is not deprecated, and choices hold."""
    options = help_options(*cmd)
    for arg in args:
        if not arg.startswith("--"):
            continue
        flag, _, value = arg.partition("=")
        assert flag in options, f"{where}: `{' '.join(cmd)}` has no {flag} (flwr {FLWR_VERSION})"
        entry = options[flag]
        assert "deprecated" not in entry.lower(), f"{where}: {flag} is deprecated: {entry}"
        choices = re.search(re.escape(flag) + r" \{([^}]*)\}", entry)
        if choices and value:
            assert value in choices.group(1).split(","), f"{where}: {arg} not in {{{choices.group(1)}}}"


def dockerfile_entrypoint(path: Path) -> str:
    m = re.search(r'^ENTRYPOINT \["([^"]+)"', path.read_text(), re.M)
    assert m, f"{path.name}: no ENTRYPOINT"
    return m.group(1)


def service_binary(name: str, svc: dict[str, Any], compose: str) -> str:
    """Which Flower command a service runs (from its Dockerfile or its flwr/* image)."""
    if "build" in svc:
        return dockerfile_entrypoint(ROOT / "docker" / build_paths(svc, compose)[1])
    m = re.match(r"flwr/(superlink|supernode|superexec):", interpolate(svc["image"]))
    assert m, f"{compose}/{name}: image {svc['image']!r} is not a flwr/* image"
    return IMAGE_BINARY[m.group(1)]


def build_paths(svc: dict[str, Any], compose: str) -> tuple[Path, str]:
    """(build context, Dockerfile path relative to docker/) of a service."""
    build = svc["build"]
    context = (DOCKER / interpolate(build["context"])).resolve()
    dockerfile = (context / build.get("dockerfile", "Dockerfile")).resolve()
    return context, str(dockerfile.relative_to(DOCKER))


def commands() -> list[tuple[str, str, dict[str, Any], list[str]]]:
    out = []
    for compose in COMPOSE_FILES:
        for name, svc in load_compose(compose)["services"].items():
            if "command" in svc:
                out.append((compose, name, svc, [interpolate(str(a)) for a in svc["command"]]))
    return out


def node_config(args: list[str]) -> dict[str, str]:
    value = next(a.partition("=")[2] for a in args if a.startswith("--node-config="))
    return {k: v.strip('"') for k, _, v in (item.partition("=") for item in shlex.split(value))}


def run_make_certs(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(MAKE_CERTS), "-o", str(out), *args], capture_output=True, text=True, check=True
    )


def bind_mounts(svc: dict[str, Any]) -> list[tuple[str, str]]:
    """(host source, container target) of the service's bind mounts (sources with a path)."""
    mounts = []
    for v in svc.get("volumes") or []:
        parts = interpolate(str(v)).split(":")
        if parts[0].startswith((".", "/")):
            mounts.append((parts[0], parts[1]))
    return mounts


def volume_targets(svc: dict[str, Any]) -> list[str]:
    return [interpolate(str(v)).split(":")[1] for v in svc.get("volumes") or []]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("make_certs.sh needs openssl")
    out = tmp_path_factory.mktemp("certs") / "certs"
    run_make_certs(out, "-n", "2", "superlink.lab.example.org", "10.0.0.5")
    return out


# ----------------------------------------------------------------------------- Dockerfiles


def test_dockerfiles_build_on_official_images_at_the_installed_flwr() -> None:
    assert {p.name for p in DOCKERFILES} >= {"superlink.Dockerfile", "superexec.Dockerfile"}
    for path in DOCKERFILES:
        text = path.read_text()
        m = re.search(r"^ARG FLWR_VERSION=(\S+)", text, re.M)
        assert m and m.group(1) == FLWR_VERSION, f"{path.name}: FLWR_VERSION must be {FLWR_VERSION}"
        base = re.search(r"^FROM (flwr/(\w+)):\$\{FLWR_VERSION\}\s*$", text, re.M)
        assert base, f"{path.name}: FROM must be flwr/<image>:${{FLWR_VERSION}}"
        assert dockerfile_entrypoint(path) == IMAGE_BINARY[base.group(2)], path.name
        assert "FLWR_TELEMETRY_ENABLED=0" in text, path.name
        assert re.search(r"^USER app\s*$", text, re.M), f"{path.name}: must end as the non-root user"


def test_superexec_dockerfile_installs_the_app_dependencies_with_cuda_torch() -> None:
    path = DOCKER / "superexec.Dockerfile"
    text = path.read_text()
    assert re.search(r"^ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cu\d+$", text, re.M)
    assert re.search(r"^ARG REQUIRE_CUDA_TORCH=1$", text, re.M)
    code = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
    assert " -U" not in code and "--upgrade" not in code, "upgrading would replace the CUDA torch build"
    # The sed that drops the flwr requirement removes exactly that line of pyproject.toml.
    sed = re.search(r"sed -i '/(.+?)/d'", text)
    assert sed, "no sed dropping the flwr requirement"
    pattern = re.compile(sed.group(1))  # this BRE means the same as a Python regex
    lines = (ROOT / "pyproject.toml").read_text().splitlines(keepends=True)
    dropped = [ln for ln in lines if pattern.search(ln)]
    assert len(dropped) == 1 and "flwr[" in dropped[0], dropped
    kept = tomllib.loads("".join(ln for ln in lines if not pattern.search(ln)))
    deps = kept["project"]["dependencies"]
    assert not any(re.match(r"flwr\b(?!-)", d) for d in deps), deps
    assert any(d.startswith("torch") for d in deps) and any(d.startswith("diffusers") for d in deps)


def test_check_image_fails_a_build_without_the_torch_it_requires() -> None:
    """docker/check_image.py: REQUIRE_CUDA_TORCH=1 refuses a CPU torch, REQUIRE_CPU_TORCH=1 a CUDA one
    (an index that serves the CUDA wheel to a "CPU" build), and a replaced flwr fails either way."""
    problems = script_module(DOCKER / "check_image.py").problems
    assert problems("1.42.0", "cuda", "2.14.1+cu130", "13.0", "1.42.0") == []
    assert problems("1.42.0", "cpu", "2.14.1+cpu", None, "1.42.0") == []
    assert problems("1.42.0", "any", "2.14.1+cu130", "13.0", "1.42.0") == []
    assert "CUDA build of torch was required" in problems("1.42.0", "cuda", "2.14.1+cpu", None, "1.42.0")[0]
    assert "CPU build of torch was required" in problems("1.42.0", "cpu", "2.14.1", "13.0", "1.42.0")[0]
    assert "flwr changed" in problems("1.43.0", "any", "2.14.1", "13.0", "1.42.0")[0]
    # As the Dockerfile runs it, against this environment's own torch: the build it is not fails.
    import torch

    wrong = ["--require-cpu", "1"] if torch.version.cuda else ["--require-cuda", "1"]
    cmd = [sys.executable, str(DOCKER / "check_image.py"), "--flwr", FLWR_VERSION]
    bad = subprocess.run([*cmd, *wrong], capture_output=True, text=True)
    assert bad.returncode == 1 and "build of torch was required" in bad.stderr, bad.stderr
    ok = subprocess.run(cmd, capture_output=True, text=True)
    assert ok.returncode == 0 and f"flwr {FLWR_VERSION}" in ok.stdout, ok.stderr
    both = subprocess.run([*cmd, "--require-cpu", "1", "--require-cuda", "1"], capture_output=True, text=True)
    assert both.returncode == 2 and "contradict" in both.stderr


def test_every_image_build_checks_the_torch_its_index_serves() -> None:
    """A build from PyTorch's CPU index requires a CPU torch, one from a CUDA index a CUDA torch."""
    text = (DOCKER / "superexec.Dockerfile").read_text()
    assert re.search(r"^ARG REQUIRE_CPU_TORCH=0$", text, re.M)
    assert '--require-cpu "${REQUIRE_CPU_TORCH}"' in text and '--require-cuda "${REQUIRE_CUDA_TORCH}"' in text
    for compose in COMPOSE_FILES:
        for name, svc in load_compose(compose)["services"].items():
            args = (svc.get("build") or {}).get("args") or {}
            if "TORCH_INDEX_URL" not in args:
                continue
            index = interpolate(str(args["TORCH_INDEX_URL"]))
            cpu, cuda = (
                interpolate(str(args["REQUIRE_CPU_TORCH"])),
                interpolate(str(args["REQUIRE_CUDA_TORCH"])),
            )
            want = ("1", "0") if index.endswith("/whl/cpu") else ("0", "1")
            assert (cpu, cuda) == want, f"{compose}/{name}: {index} with CPU={cpu} CUDA={cuda}"


def _dockerignore(context: Path, dockerfile: str) -> Path:
    """The ignore file a build uses: BuildKit prefers <Dockerfile>.dockerignore, the legacy builder
    (docker.io 20.10, docker-compose v1) reads only the context's .dockerignore."""
    per_file = DOCKER / f"{dockerfile}.dockerignore"
    assert not per_file.exists(), (
        f"{per_file.name}: the legacy builder ignores it; use {context}/.dockerignore"
    )
    return context / ".dockerignore"


def test_dockerfile_copy_sources_exist_and_pass_the_dockerignore() -> None:
    contexts = {}
    for compose in COMPOSE_FILES:
        for svc in load_compose(compose)["services"].values():
            if "build" in svc:
                context, dockerfile = build_paths(svc, compose)
                assert context.is_dir(), context
                assert (DOCKER / dockerfile).is_file(), dockerfile
                contexts[dockerfile] = context
    assert set(contexts) == {"superlink.Dockerfile", "superexec.Dockerfile"}
    for dockerfile, context in contexts.items():
        text = (DOCKER / dockerfile).read_text()
        ignore = _dockerignore(context, dockerfile)
        assert ignore.is_file(), (
            f"{dockerfile}: no {ignore} (the whole context, docker/certs/ca.key too, is sent)"
        )
        rules = [
            ln.strip() for ln in ignore.read_text().splitlines() if ln.strip() and not ln.startswith("#")
        ]
        assert rules[0] == "*", f"{ignore}: must exclude everything first, then allow what the image copies"
        allowed = [r[1:].rstrip("/") for r in rules if r.startswith("!")]
        certs = (DOCKER / "certs").relative_to(context) if DOCKER.is_relative_to(context) else None
        assert not any(certs is not None and (certs.is_relative_to(a) or a == ".") for a in allowed), allowed
        for line in re.findall(r"^COPY (.+)$", text, re.M):
            srcs = [a for a in line.split() if not a.startswith("--")][:-1]
            for src in srcs:
                assert (context / src).exists(), f"{dockerfile}: COPY {src}: not in {context}"
                assert src.rstrip("/") in allowed, f"{ignore} excludes {src}"


# ----------------------------------------------------------------------------- Compose files


def test_compose_files_parse_and_pin_the_flwr_images() -> None:
    assert sorted(COMPOSE_FILES) == sorted(p.name for p in DOCKER.glob("compose*.yml"))
    for compose in COMPOSE_FILES:
        services = load_compose(compose)["services"]
        assert services, compose
        for name, svc in services.items():
            assert "image" in svc or "build" in svc, f"{compose}/{name}"
            image = str(svc.get("image", ""))
            if image.startswith("flwr/"):
                assert image.endswith(f":${{FLWR_VERSION:-{FLWR_VERSION}}}"), image
            args = (svc.get("build") or {}).get("args") or {}
            if "FLWR_VERSION" in args:
                assert args["FLWR_VERSION"] == f"${{FLWR_VERSION:-{FLWR_VERSION}}}"


@pytest.mark.parametrize("compose", COMPOSE_FILES)
def test_every_service_is_health_checked_and_its_logs_rotate(compose: str) -> None:
    probe_of = make_compose().health_probe  # one probe for every file, hand-written ones too
    for name, svc in load_compose(compose)["services"].items():
        # The probe dials the health server that the service's own command starts...
        probe, address = health_probe(svc)
        assert f"--health-server-address={address}" in svc["command"], f"{compose}/{name}: {svc['command']}"
        assert probe == probe_of(int(address.rpartition(":")[2])), f"{compose}/{name}"
        assert svc["healthcheck"]["retries"] >= 1 and svc["healthcheck"]["start_period"] == "60s"
        # ...json-file logs are capped (unbounded by default)...
        assert svc["logging"]["driver"] == "json-file", name
        assert re.fullmatch(r"\d+m", svc["logging"]["options"]["max-size"]), name
        assert int(svc["logging"]["options"]["max-file"]) >= 1, name
        # ...and a service starts once what it dials is healthy, not merely started.
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert cond == {"condition": "service_healthy"}, f"{compose}/{name} -> {dep}: {cond}"


@pytest.mark.parametrize(("compose", "name"), [(c, n) for c, n, _, _ in commands()])
def test_compose_flags_exist_in_the_installed_flower_commands(compose: str, name: str) -> None:
    svc = load_compose(compose)["services"][name]
    args = [interpolate(str(a)) for a in svc["command"]]
    assert all(a.startswith("--") for a in args), f"{compose}/{name}: use --flag=value items: {args}"
    check_flags((service_binary(name, svc, compose),), args, f"{compose}/{name}")


def test_compose_is_tls_and_supernode_auth_by_default() -> None:
    for compose in SECURE_FILES:
        for name, svc in load_compose(compose)["services"].items():
            args = [interpolate(str(a)) for a in svc["command"]]
            flags = {a.partition("=")[0] for a in args}
            binary = service_binary(name, svc, compose)
            assert "--insecure" not in flags, f"{compose}/{name}"
            if binary == "flower-superlink":
                assert {
                    "--enable-supernode-auth",
                    "--ssl-ca-certfile",
                    "--ssl-certfile",
                    "--ssl-keyfile",
                } <= flags
                assert "--database" in flags and "--disable-runtime-dependency-installation" in flags
                assert "--isolation=process" in args
            elif binary == "flower-supernode":
                assert {"--root-certificates", "--auth-supernode-private-key"} <= flags, f"{compose}/{name}"
                assert {"--ssl-certfile", "--ssl-keyfile", "--ssl-ca-certfile"} <= flags, f"{compose}/{name}"
                assert "--isolation=process" in args
            else:
                assert "--root-certificates" in flags, f"{compose}/{name}"
    for name, svc in load_compose("compose.insecure.yml")["services"].items():
        flags = {str(a).partition("=")[0] for a in svc["command"]}
        assert "--insecure" in flags, name
        assert not flags & {
            "--enable-supernode-auth",
            "--root-certificates",
            "--ssl-certfile",
            "--auth-supernode-private-key",
        }, name
        assert not any("/app/certs" in str(v) for v in svc.get("volumes") or []), name


def test_compose_mounts_exist_or_are_written_by_make_certs(certs: Path) -> None:
    for compose in COMPOSE_FILES:
        for name, svc in load_compose(compose)["services"].items():
            for source, target in bind_mounts(svc):
                where = f"{compose}/{name}: {source}:{target}"
                if source.startswith("./certs"):
                    produced = certs / source.removeprefix("./certs").lstrip("/")
                    assert produced.exists(), f"{where}: make_certs.sh writes no {produced.name}"
                elif target == "/app/data":
                    continue  # a site's own images: DATA_DIR, created by Docker if missing
                else:
                    assert (DOCKER / source).exists(), where


def test_compose_container_paths_are_mounted(certs: Path) -> None:
    for compose in SECURE_FILES:
        services = load_compose(compose)["services"]
        for name, svc in services.items():
            mounts = dict((t, s) for s, t in bind_mounts(svc))
            targets = volume_targets(svc)
            for arg in (interpolate(str(a)) for a in svc["command"]):
                value = arg.partition("=")[2]
                if value.startswith("/app/certs/"):
                    target = next((t for t in mounts if value == t or value.startswith(t + "/")), None)
                    assert target, f"{compose}/{name}: {value} is not mounted"
                    host = certs / (mounts[target] + value[len(target) :]).removeprefix("./certs/")
                    assert host.is_file(), f"{compose}/{name}: {value} -> {host} missing"
                if value.startswith("/app/state/"):
                    assert "/app/state" in targets, f"{compose}/{name}: --database not on a volume"


def _pairs(compose: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(supernode service, the superexec-clientapp service that talks to it)."""
    services = load_compose(compose)["services"]
    pairs = []
    for name, svc in services.items():
        if service_binary(name, svc, compose) != "flower-supernode":
            continue
        args = [interpolate(str(a)) for a in svc["command"]]
        port = next(a.partition("=")[2] for a in args if a.startswith("--port="))
        host = "127.0.0.1" if svc.get("network_mode") == "host" else name  # else its container's name
        execs = [
            s
            for n, s in services.items()
            if f"--runtime-api-address={host}:{port}" in [interpolate(str(a)) for a in s.get("command", [])]
        ]
        assert len(execs) == 1, f"{compose}/{name}: needs exactly one SuperExec on {host}:{port}"
        pairs.append((svc, execs[0]))
    return pairs


def _gpu_ids(svc: dict[str, Any]) -> list[str]:
    devices = svc["deploy"]["resources"]["reservations"]["devices"]
    assert len(devices) == 1 and devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    return [interpolate(str(d)) for d in devices[0]["device_ids"]]


@pytest.mark.parametrize("compose", ["compose.yml", "compose.loopback.yml", "compose.supernode.yml"])
def test_each_supernode_has_its_partition_gpu_and_cache(compose: str) -> None:
    pairs = _pairs(compose)
    assert pairs
    configs = [node_config([interpolate(str(a)) for a in sn["command"]]) for sn, _ in pairs]
    n = int(configs[0]["num-partitions"]) if compose == "compose.supernode.yml" else len(pairs)
    assert sorted(int(c["partition-id"]) for c in configs) == list(range(len(pairs)))
    assert all(int(c["num-partitions"]) == n for c in configs), configs
    gpus = [g for _, ex in pairs for g in _gpu_ids(ex)]
    assert len(gpus) == len(set(gpus)) == len(pairs), f"each node needs its own GPU: {gpus}"
    for (_, ex), cfg in zip(pairs, configs, strict=False):
        cache = cfg["cache-dir"]
        assert any(cache == t or cache.startswith(t + "/") for t in volume_targets(ex)), (
            f"cache-dir {cache} is not on a volume of the ClientApp's SuperExec"
        )
        assert any(t == "/app/.cache" for t in volume_targets(ex)), "HF_HOME (/app/.cache) not persistent"
        assert "build" in ex and "cu" in interpolate(ex["build"]["args"]["TORCH_INDEX_URL"])
        assert str(ex["build"]["args"]["REQUIRE_CUDA_TORCH"]) == "1"


def test_superexec_serverapp_points_at_the_superlink() -> None:
    for compose in ("compose.yml", "compose.insecure.yml", "compose.loopback.yml", "compose.superlink.yml"):
        services = load_compose(compose)["services"]
        link = [interpolate(str(a)) for a in services["superlink"]["command"]]
        port = next(a.partition("=")[2] for a in link if a.startswith("--port="))
        exe = [interpolate(str(a)) for a in services["superexec-serverapp"]["command"]]
        if services["superlink"].get("network_mode") == "host":  # nothing to publish: it is the host's
            assert f"--runtime-api-address=127.0.0.1:{port}" in exe and "ports" not in services["superlink"]
            continue
        assert f"--runtime-api-address=superlink:{port}" in exe
        published = [interpolate(str(p)) for p in services["superlink"]["ports"]]
        assert any(p.endswith(f":{port}") for p in published), published


def test_single_host_results_reach_the_host_as_on_the_server_machine() -> None:
    """RUNS_DIR bind-mounts a host folder at the ServerApp's outputs-dir in every file that runs it."""

    def runs(compose: str) -> str:
        vols = [str(v) for v in load_compose(compose)["services"]["superexec-serverapp"]["volumes"]]
        (source,) = [v.partition(":/app/feddifrc-runs")[0] for v in vols if ":/app/feddifrc-runs" in v]
        return source

    assert runs("compose.superlink.yml") == "${RUNS_DIR:-runs}"
    for compose in GENERATED:
        assert runs(compose) == "${RUNS_DIR:-runs}", compose
        mount = interpolate(runs(compose), {"RUNS_DIR": "/srv/feddifrc-runs"})
        assert mount == "/srv/feddifrc-runs" and interpolate(runs(compose)) == "runs"


def test_compose_files_are_accepted_by_compose_v1_and_v2() -> None:
    """Debian 12 ships docker-compose 1.29.2: no top-level `name:` (v2.3.3+), no `!override` /
    `!reset` (v2.24.4+), and no published ports on a host-network service (v1.28+ refuses them)."""
    for compose in COMPOSE_FILES:
        text = (DOCKER / compose).read_text()
        data = load_compose(compose)  # safe YAML: an unknown tag fails here
        assert "name" not in data and "version" not in data, compose
        assert not re.search(r"!(override|reset)\b", text), compose
        assert set(data) <= {"services", "volumes"} | {k for k in data if k.startswith("x-")}, compose
        for name, svc in data["services"].items():
            if svc.get("network_mode") == "host":
                assert not svc.get("ports") and not svc.get("networks"), f"{compose}/{name}"


def test_every_flower_process_polls_for_work_every_0_2_s() -> None:
    """FLWR_SUPEREXEC_TASK_POLL_INTERVAL (Flower 1.42; 1 s by default, paid by every message) in every
    service, in the loopback test's processes and in the doc's commands without Docker."""
    from flower_procs import flower_env

    value = make_compose().TASK_POLL_INTERVAL
    assert 0.01 <= float(value) <= 60  # what flower-superexec accepts
    for compose in COMPOSE_FILES:
        for name, svc in load_compose(compose)["services"].items():
            assert svc["environment"]["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] == value, f"{compose}/{name}"
    assert flower_env(Path("/tmp/unused"))["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] == value
    starts = [
        line
        for block in re.findall(r"```bash\n(.*?)```", DEPLOY_DOC.read_text(), re.S)
        for line in re.sub(r"\\\n\s*", " ", block).splitlines()
        if re.search(r"\bflower-(superlink|supernode)\b", line)
    ]
    assert starts, "no flower-superlink / flower-supernode command in docs/deploy.md"
    for line in starts:  # --isolation subprocess: the child SuperExec inherits the variable
        assert f"FLWR_SUPEREXEC_TASK_POLL_INTERVAL={value} " in line, line


def test_clientapps_take_omp_num_threads_from_the_env_file_or_the_shell() -> None:
    """Several SuperNodes on one machine need OMP_NUM_THREADS = their share of the cores (deploy.md,
    section 5): every ClientApp SuperExec passes it through (no value: the env file's or the shell's,
    unset when neither sets it), and the shipped env file shows where to set it."""
    for compose in COMPOSE_FILES:
        for name, svc in load_compose(compose)["services"].items():
            env = svc["environment"]
            if name.startswith("superexec-clientapp"):
                assert "OMP_NUM_THREADS" in env and env["OMP_NUM_THREADS"] is None, f"{compose}/{name}"
            else:
                assert "OMP_NUM_THREADS" not in env, f"{compose}/{name}"
    assert re.search(r"^# OMP_NUM_THREADS=\d+$", (DOCKER / "node.env.example").read_text(), re.M)


def _listens(svc: dict[str, Any]) -> list[str]:
    """host:port addresses a service's command listens on."""
    args = dict(str(a).partition("=")[::2] for a in svc["command"])
    out = [args["--health-server-address"]]
    if "--port" in args:
        out.append(f"{args['--host']}:{args['--port']}")
    return out


def test_the_loopback_file_puts_every_service_on_127_0_0_1_with_its_own_ports() -> None:
    data = load_compose("compose.loopback.yml")
    services = data["services"]
    listening: dict[str, str] = {}
    for name, svc in services.items():
        assert svc["network_mode"] == "host", name
        for arg in map(str, svc["command"]):
            flag, _, value = arg.partition("=")
            if flag in ("--superlink", "--runtime-api-address", "--health-server-address"):
                assert value.startswith("127.0.0.1:"), f"{name}: {arg}"
            if flag == "--host":
                assert value == "127.0.0.1", f"{name}: {arg}"
        for address in _listens(svc):
            assert address not in listening, f"{name} and {listening.get(address)} both listen on {address}"
            listening[address] = name
        if "build" in svc:
            assert svc["build"]["network"] == "host", name  # no bridge to build on either
    for name, svc in services.items():  # everything dialled is something listening
        for arg in map(str, svc["command"]):
            flag, _, value = arg.partition("=")
            if flag in ("--superlink", "--runtime-api-address"):
                assert value in listening, f"{name}: nothing listens on {value}"
    # The same topology as compose.yml otherwise: services, images, mounts, GPUs.
    base = load_compose("compose.yml")
    assert list(services) == list(base["services"]) and data["volumes"] == base["volumes"]
    for name, svc in services.items():
        for key in ("image", "volumes", "deploy", "depends_on", "restart"):
            assert svc.get(key) == base["services"][name].get(key), f"{name}: {key}"


def test_committed_compose_files_are_the_generator_output() -> None:
    for name, args in GENERATED.items():
        cp = subprocess.run(
            [sys.executable, str(MAKE_COMPOSE), *args], capture_output=True, text=True, check=True
        )
        assert cp.stdout == (DOCKER / name).read_text(), (
            f"docker/{name} differs from `python docker/make_compose.py {' '.join(args)}`: regenerate it"
        )


def test_generator_scales_to_more_gpus(tmp_path: Path) -> None:
    out = tmp_path / "compose.4gpu.yml"
    subprocess.run([sys.executable, str(MAKE_COMPOSE), "--gpus", "0,1,2,3", "-o", str(out)], check=True)
    data = yaml.safe_load(out.read_text())
    nodes = [n for n in data["services"] if n.startswith("supernode-")]
    assert nodes == [f"supernode-{i}" for i in range(1, 5)]
    cfgs = [node_config([str(a) for a in data["services"][n]["command"]]) for n in nodes]
    assert [c["partition-id"] for c in cfgs] == ["0", "1", "2", "3"] and {
        c["num-partitions"] for c in cfgs
    } == {"4"}
    gpus = [
        data["services"][f"superexec-clientapp-{i}"]["deploy"]["resources"]["reservations"]["devices"][0][
            "device_ids"
        ]
        for i in range(1, 5)
    ]
    assert gpus == [["0"], ["1"], ["2"], ["3"]]
    bad = subprocess.run([sys.executable, str(MAKE_COMPOSE), "--gpus", "0,0"], capture_output=True, text=True)
    assert bad.returncode != 0 and "distinct" in bad.stderr


def _device_ids(data: dict[str, Any], n: int) -> list[list[Any]]:
    services = data["services"]
    return [
        services[f"superexec-clientapp-{i}"]["deploy"]["resources"]["reservations"]["devices"][0][
            "device_ids"
        ]
        for i in range(1, n + 1)
    ]


def test_generator_quotes_gpu_ids_and_refuses_what_yaml_or_compose_would_read(tmp_path: Path) -> None:
    """Issue 33 case 10: GPU ids went into the YAML unescaped. Ids that YAML would type (null, a
    hex or exponent number, a MIG UUID with ':' and '/') stay the strings given; characters that
    YAML or Compose read (quotes, '#', ': ', '$', a newline) are refused in one line."""
    gpus = ["null", "0x1A", "1e3", "GPU-5c2b:7/1/0", "007", "true"]
    out = tmp_path / "c.yml"
    subprocess.run(
        [sys.executable, str(MAKE_COMPOSE), f"--gpus={','.join(gpus)}", "-o", str(out)], check=True
    )
    assert _device_ids(yaml.safe_load(out.read_text()), len(gpus)) == [[g] for g in gpus]
    for bad in ['0"]\n  evil: x', "0 #c", "a: b", "${HOME}", "'q'", "-1", "[0]", "0\t1"]:
        cp = subprocess.run(
            [sys.executable, str(MAKE_COMPOSE), f"--gpus=1,{bad}"], capture_output=True, text=True
        )
        assert (cp.returncode, cp.stdout) == (2, ""), bad
        assert cp.stderr.splitlines()[-1] == (
            f"make_compose.py: error: --gpus: {bad.strip()!r} is not a GPU id (an index or a GPU/MIG UUID: "
            "letters, digits, and _ . : / - after the first)"
        ), cp.stderr


@pytest.mark.parametrize(
    ("where", "why"), [("missing/c.yml", "No such file or directory"), ("", "Is a directory")]
)
def test_generator_names_an_output_it_cannot_write_in_one_line(tmp_path: Path, where: str, why: str) -> None:
    cp = subprocess.run(
        [sys.executable, str(MAKE_COMPOSE), "-o", str(tmp_path / where)], capture_output=True, text=True
    )
    assert (cp.returncode, cp.stdout) == (2, "")
    assert cp.stderr == f"make_compose.py: error: -o {tmp_path / where}: cannot write it ({why})\n"


def test_generator_cpu_nodes_run_the_cpu_image_without_gpus(tmp_path: Path) -> None:
    """--cpu-nodes N (what scripts/docker_e2e.py brings up): no GPU reservation, the CPU image."""
    out = tmp_path / "compose.e2e.yml"
    cmd = [sys.executable, str(MAKE_COMPOSE), "--cpu-nodes", "2", "--loopback", "-o", str(out)]
    subprocess.run(cmd, check=True)
    services = yaml.safe_load(out.read_text())["services"]
    loopback = load_compose("compose.loopback.yml")["services"]
    for i in range(1, 3):
        clientapp = services[f"superexec-clientapp-{i}"]
        assert "deploy" not in clientapp and clientapp["image"] == "feddifrc-superexec:cpu"
        assert clientapp["build"] == services["superexec-serverapp"]["build"]
    for name in ("superlink", "superexec-serverapp", "supernode-1", "superexec-clientapp-1"):
        assert services[name]["command"] == loopback[name]["command"], name  # only the image differs
    both = subprocess.run(
        [sys.executable, str(MAKE_COMPOSE), "--gpus", "0", "--cpu-nodes", "2"], capture_output=True, text=True
    )
    assert both.returncode != 0 and "not allowed with" in both.stderr


def _compose_clis() -> list[list[str]]:
    """The Compose CLIs on this machine: v2 (`docker compose`) and v1 (`docker-compose`)."""
    out = []
    if (
        shutil.which("docker")
        and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0
    ):
        out.append(["docker", "compose"])
    if shutil.which("docker-compose"):
        out.append(["docker-compose"])
    return out


def test_docker_compose_config_accepts_the_files(certs: Path, tmp_path: Path) -> None:
    clis = _compose_clis()
    if not clis:
        pytest.skip("neither `docker compose` (v2) nor `docker-compose` (v1) on this machine")
    env = {**os.environ, **REQUIRED_ENV}
    cpu = tmp_path / "compose.cpu.yml"  # the e2e topology, checked by the same CLIs
    subprocess.run(
        [sys.executable, str(MAKE_COMPOSE), "--cpu-nodes", "2", "--loopback", "-o", str(cpu)], check=True
    )
    for cli in clis:
        for compose in [*(DOCKER / c for c in COMPOSE_FILES), cpu]:  # each a whole file, used alone
            cp = subprocess.run(
                [*cli, "-f", str(compose), "config", "-q"], capture_output=True, text=True, env=env
            )
            assert cp.returncode == 0, f"{' '.join(cli)} {compose.name}: {cp.stderr}"


# ----------------------------------------------------------------------------- make_certs.sh


def _sans(cert: Path) -> str:
    return subprocess.run(
        ["openssl", "x509", "-in", str(cert), "-noout", "-ext", "subjectAltName"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


@needs_openssl
def test_make_certs_writes_a_verifiable_tls_chain_with_the_sans(certs: Path) -> None:
    sans = _sans(certs / "superlink" / "server.pem")
    for want in (
        "DNS:localhost",
        "IP Address:127.0.0.1",
        "DNS:superlink",
        "DNS:superlink.lab.example.org",
        "IP Address:10.0.0.5",
    ):
        assert want in sans, sans
    for i in (1, 2):
        node_sans = _sans(certs / f"supernode-{i}" / "runtime.pem")
        assert f"DNS:supernode-{i}" in node_sans and "DNS:supernode," in node_sans + ",", node_sans
    for cert in (certs / "superlink" / "server.pem", *certs.glob("supernode-*/runtime.pem")):
        subprocess.run(
            ["openssl", "verify", "-CAfile", str(certs / "ca.crt"), str(cert)],
            check=True,
            capture_output=True,
        )


@needs_openssl
def test_make_certs_supernode_keys_load_as_flower_loads_them(certs: Path) -> None:
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key

    for i in (1, 2):
        d = certs / f"supernode-{i}"
        key = load_ssh_private_key((d / "auth.key").read_bytes(), None)  # as flower-supernode does
        pub = load_ssh_public_key((d / "auth.key.pub").read_bytes())  # as `flwr supernode register`
        assert isinstance(key, ec.EllipticCurvePrivateKey) and isinstance(pub, ec.EllipticCurvePublicKey)
        assert key.public_key().public_numbers() == pub.public_numbers()
    private = [
        certs / "ca.key",
        certs / "superlink" / "server.key",
        *certs.glob("supernode-*/auth.key"),
        *certs.glob("supernode-*/runtime.key"),
    ]
    for p in private:
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    assert stat.S_IMODE((certs / "ca.crt").stat().st_mode) == 0o644


@needs_openssl
def test_make_certs_is_incremental_and_force_renews(tmp_path: Path) -> None:
    out = tmp_path / "c"
    run_make_certs(out, "-n", "1")
    ca, key1 = (out / "ca.crt").read_bytes(), (out / "supernode-1" / "auth.key").read_bytes()
    cp = run_make_certs(out, "-n", "2")
    assert (out / "ca.crt").read_bytes() == ca and (out / "supernode-1" / "auth.key").read_bytes() == key1
    assert (out / "supernode-2" / "auth.key.pub").is_file() and "supernode-2/auth.key" in cp.stdout
    subprocess.run(
        ["openssl", "verify", "-CAfile", str(out / "ca.crt"), str(out / "supernode-2" / "runtime.pem")],
        check=True,
        capture_output=True,
    )
    run_make_certs(out, "-n", "2", "--force")
    assert (out / "ca.crt").read_bytes() != ca
    bad = subprocess.run(
        ["bash", str(MAKE_CERTS), "-o", str(out), "-n", "two"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "-n expects an integer from 0 to 9999" in bad.stderr


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _signers(d: Path) -> list[str]:
    """The certificates under ``d`` whose key usage allows signing certificates."""
    out = []
    for p in [*d.rglob("*.pem"), *d.rglob("*.crt")]:
        ku = subprocess.run(
            ["openssl", "x509", "-in", str(p), "-noout", "-ext", "keyUsage"], capture_output=True, text=True
        ).stdout
        if "Certificate Sign" in ku:
            out.append(str(p.relative_to(d)))
    return sorted(out)


@needs_openssl
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["DNS:a\nkeyUsage = critical, keyCertSign"],
            "SAN $'DNS:a\\nkeyUsage = critical, keyCertSign' is not a DNS name",
        ),
        (["lab.example.org\nkeyUsage = critical, keyCertSign"], "is neither a DNS name"),
        ([""], "an empty SAN argument; pass a DNS name or an IP address"),
        (["a,b"], "SAN a\\,b is neither a DNS name"),
        (["a.*"], "is neither a DNS name"),
        (["IP:1.2.3.256"], "SAN IP:1.2.3.256 is not an IPv4 or IPv6 address"),
        (["DNS:a b"], "is not a DNS name"),
        (["-n", "08"], "-n expects an integer from 0 to 9999 (no sign, no leading zero), got 08"),
        (["-n", "-1"], "-n expects an integer from 0 to 9999"),
        (["-n", "99999999999999999999"], "-n expects an integer from 0 to 9999"),
        (["-n"], "-n needs a value"),
        (["-d", "0x10"], "-d expects a positive integer"),
    ],
)
def test_make_certs_refuses_a_bad_argument_in_one_line_before_writing_anything(
    tmp_path: Path, args: list[str], message: str
) -> None:
    """Issue 33 case 10: a SAN with a newline wrote an extension of its own (keyUsage keyCertSign:
    a SuperLink certificate that signs certificates); -n 08 was bash arithmetic errors and exit 0."""
    out = tmp_path / "c"
    argv = args if args[0].startswith("-") else ["-n", "1", *args]
    cp = subprocess.run(["bash", str(MAKE_CERTS), "-o", str(out), *argv], capture_output=True, text=True)
    assert (cp.returncode, cp.stdout) == (2, "") and cp.stderr.startswith("make_certs.sh: "), cp.stderr
    assert message in cp.stderr and cp.stderr.count("\n") == 1, cp.stderr
    assert not out.exists()  # nothing written, not even the folder
    run_make_certs(out, "-n", "1")  # into an existing folder: refused the same, nothing changes
    (out / "superlink" / "server.pem").unlink()  # the certificate the SAN would go into
    before = _tree(out)
    cp = subprocess.run(["bash", str(MAKE_CERTS), "-o", str(out), *argv], capture_output=True, text=True)
    assert cp.returncode == 2 and message in cp.stderr
    assert _tree(out) == before
    assert [Path(p).name for p in _signers(out)] == ["ca.crt"] * 4  # the CA and its 3 bundle copies


@needs_openssl
def test_make_certs_prints_an_openssl_failure_and_leaves_no_half_written_output(tmp_path: Path) -> None:
    """An address of the right characters that openssl refuses (nine groups): its own message is
    printed, exit 1, and nothing of the run is left (it exited 1 silently with a lone server.key)."""
    out = tmp_path / "c"
    bad = ["bash", str(MAKE_CERTS), "-o", str(out), "-n", "1", "IP:1:2:3:4:5:6:7:8:9"]
    cp = subprocess.run(bad, capture_output=True, text=True)
    assert cp.returncode == 1, cp
    assert cp.stderr.startswith("make_certs.sh: signing the certificate of superlink (SANs ")
    assert "(openssl x509 exited non-zero): " in cp.stderr and "bad ip address" in cp.stderr
    assert not out.exists()
    run_make_certs(out, "-n", "1")
    shutil.rmtree(out / "superlink")  # as the header says, to change the SANs
    before = _tree(out)
    assert subprocess.run(bad, capture_output=True, text=True).returncode == 1
    assert _tree(out) == before and sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []


@needs_openssl
def test_make_certs_bundles_give_each_machine_only_its_own_keys(certs: Path) -> None:
    def files(d: Path) -> set[str]:
        return {str(f.relative_to(d)) for f in d.rglob("*") if f.is_file()}

    node = ["auth.key", "auth.key.pub", "runtime.key", "runtime.pem", "superexec.secret"]
    want = {
        "server": {"ca.crt", "superlink/server.pem", "superlink/server.key", "superlink/superexec.secret"},
        "supernode-1": {"ca.crt", *(f"supernode-1/{n}" for n in node)},
        "supernode-2": {"ca.crt", *(f"supernode-2/{n}" for n in node)},
        "workstation": {"ca.crt", "supernode-1/auth.key.pub", "supernode-2/auth.key.pub"},
    }
    bundles = certs / "bundles"
    assert {d.name for d in bundles.iterdir()} == set(want)
    for name, expected in want.items():
        assert files(bundles / name) == expected, name  # no ca.key, no other machine's keys
        for rel in expected:
            assert (bundles / name / rel).read_bytes() == (certs / rel).read_bytes()
    # One Runtime API secret per SuperLink/SuperNode, shared with its SuperExec, private to its owner.
    secrets = [
        certs / "superlink" / "superexec.secret",
        *(certs / f"supernode-{i}" / "superexec.secret" for i in (1, 2)),
    ]
    values = [p.read_text() for p in secrets]
    assert len(set(values)) == 3 and all(re.fullmatch(r"[0-9a-f]{64}", v) for v in values)
    assert all(p.stat().st_mode & 0o077 == 0 for p in secrets)


# ----------------------------------------------------------------------------- docs/deploy.md

FLWR_GROUPS = {"supernode", "federation", "config", "app"}


def _doc_commands(text: str) -> list[list[str]]:
    """Shell commands of the fenced code blocks (continuation lines joined, prompts dropped)."""
    cmds = []
    for block in re.findall(r"```(?:bash|console|sh|shell)\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.strip().removeprefix("$ ")
            argv = shlex.split(line, comments=True) if line else []
            while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):  # VAR=value prefixes
                argv.pop(0)
            if argv and (argv[0].startswith("flower-") or argv[0] == "flwr"):
                cmds.append(argv)
    return cmds


def test_deploy_doc_commands_use_existing_flags() -> None:
    cmds = _doc_commands(DEPLOY_DOC.read_text())
    assert cmds, "no Flower commands found in docs/deploy.md code blocks"
    for argv in cmds:
        cmd = [argv[0]]
        if argv[0] == "flwr":
            cmd.append(argv[1])
            if argv[1] in FLWR_GROUPS and len(argv) > 2:
                cmd.append(argv[2])
        check_flags(tuple(cmd), argv[len(cmd) :], f"docs/deploy.md: {' '.join(argv)}")
        if cmd == ["flwr", "run"] and "--run-config" in argv:
            value = argv[argv.index("--run-config") + 1]
            if value.endswith(".toml"):  # a conf of the repository, or one the doc writes first
                written = f"> {value}\n" in DEPLOY_DOC.read_text()
                assert (ROOT / value).is_file() or written, f"docs/deploy.md: no {value}"
            else:
                keys = {pair.partition("=")[0] for pair in shlex.split(value)}
                known = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
                flat = set(_flatten_keys(known))
                assert keys <= flat, f"docs/deploy.md: unknown run-config keys {keys - flat}"


def _image_paths() -> dict[str, Path]:
    """Where the superexec image's COPY lines put repository paths: {image path: repo path}."""
    text = (DOCKER / "superexec.Dockerfile").read_text()
    out = {}
    for line in re.findall(r"^COPY (?:--\S+ )*(.+)$", text, re.M):
        *srcs, dest = line.split()
        for src in srcs:
            out[dest.rstrip("/") + ("/" + src if dest.endswith("/") else "")] = ROOT / src
    return out


def _doc_feddifrc_commands(text: str) -> list[list[str]]:
    """`feddifrc <sub> ...` of the code blocks, also when run as a container's entrypoint."""
    cmds = []
    for block in re.findall(r"```(?:bash|console|sh|shell)\n(.*?)```", text, re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            argv = [a for a in shlex.split(line.strip(), comments=True) if not a.startswith("$")]
            if "--entrypoint" in argv and argv[argv.index("--entrypoint") + 1] == "feddifrc":
                argv = ["feddifrc", *argv[argv.index("--entrypoint") + 3 :]]  # skip the service name
            if argv[:1] == ["feddifrc"] and len(argv) > 1:
                cmds.append(argv)
    return cmds


def test_deploy_doc_feddifrc_commands_use_existing_flags_and_files_the_image_has() -> None:
    cmds = _doc_feddifrc_commands(DEPLOY_DOC.read_text())
    assert any(c[1] == "extract" and "--check" in c for c in cmds), "no `feddifrc extract --check` in the doc"
    image = _image_paths()
    for argv in cmds:
        check_flags(tuple(argv[:2]), argv[2:], f"docs/deploy.md: {' '.join(argv)}")
        for arg in argv[2:]:
            src = next((image[d] / arg[len(d) :].lstrip("/") for d in image if arg.startswith(d + "/")), None)
            if arg.startswith("/app/") and arg.endswith(".toml"):
                assert src is not None and src.is_file(), f"docs/deploy.md: the image has no {arg}"


def _flatten_keys(table: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for k, v in table.items():
        out += _flatten_keys(v, f"{prefix}{k}.") if isinstance(v, dict) else [prefix + k]
    return out


def _compose_commands(text: str) -> list[list[str]]:
    """`docker compose ...` / `docker-compose ...` of the code blocks and inline code, as argv
    (``$(...)`` substitutions included)."""
    out = []
    joined = re.sub(r"\\\n\s*", " ", text)
    for m in re.finditer(r"(?:docker compose|docker-compose)\s[^`\n]*", joined):
        line = m.group(0)
        if joined[max(m.start() - 2, 0) : m.start()] == "$(":
            line = line.partition(")")[0]  # a command substitution ends at its parenthesis
        argv = shlex.split(line.split(" #")[0])
        if any(a.startswith("-") or a.endswith(".yml") for a in argv[2:]):
            out.append(argv)
    return out


@pytest.mark.parametrize("doc", [DEPLOY_DOC, ROOT / "README.md"], ids=lambda p: p.name)
def test_every_compose_command_names_its_project(doc: Path) -> None:
    """Without `name:` (Compose v1) the project is `-p`'s: the same for every command on a file,
    or `logs`, `exec` and a node's second GPU would address another project's containers."""
    cmds = _compose_commands(doc.read_text())
    assert len(cmds) >= 2, doc
    for argv in cmds:
        if "version" in argv or argv[-1] == "ps" and "-f" not in argv:
            continue  # prose: `docker compose version`, `docker compose ps`
        files = [Path(argv[i + 1]).name for i, a in enumerate(argv) if a == "-f"]
        assert files, f"{doc.name}: name the file with -f: {' '.join(argv)}"
        assert "-p" in argv, f"{doc.name}: no -p: {' '.join(argv)}"
        project = argv[argv.index("-p") + 1]
        want = PROJECTS.get(files[0], "feddifrc")  # generated variants (compose.4gpu.yml) as compose.yml
        assert re.fullmatch(want, project), f"{doc.name}: -p {project} for {files[0]} (want {want})"


def _chowned(section: str, certs: Path) -> set[str]:
    """Files (relative to docker/certs) that the `sudo chown 49999:49999 ...` lines of ``section``
    name, their globs expanded against a make_certs.sh output."""
    out = set()
    for line in re.sub(r"\\\n\s*", " ", section).splitlines():
        argv = shlex.split(line.split("#")[0]) if "chown 49999:49999" in line else []
        for arg in argv[3:]:
            rel = arg.removeprefix("docker/certs/")
            out |= {str(Path(p).relative_to(certs)) for p in glob.glob(str(certs / rel))}
    return out


def _private_mounted(compose: str, certs: Path, env: dict[str, str] | None = None) -> set[str]:
    """The owner-only (mode 600) files under the ./certs paths that ``compose`` mounts."""
    out = set()
    for svc in load_compose(compose)["services"].values():
        for v in svc.get("volumes") or []:
            source = interpolate(str(v), env).split(":")[0]
            if source.startswith("./certs/"):
                root = certs / source.removeprefix("./certs/")
                for f in [root] if root.is_file() else root.rglob("*"):
                    if f.is_file() and f.stat().st_mode & 0o077 == 0:
                        out.add(str(f.relative_to(certs)))
    return out


def test_the_doc_gives_uid_49999_every_private_file_a_container_reads(certs: Path) -> None:
    text = DEPLOY_DOC.read_text()
    sections = dict(re.findall(r"^## (\d+)\. .*?\n(.*?)(?=^## |\Z)", text, re.S | re.M))
    single = _private_mounted("compose.yml", certs)
    assert "superlink/superexec.secret" in single and "supernode-2/superexec.secret" in single
    assert _chowned(sections["7"], certs) >= single, single - _chowned(sections["7"], certs)
    machines = _private_mounted("compose.superlink.yml", certs) | _private_mounted(
        "compose.supernode.yml", certs, {"NODE": "1"}
    )
    assert _chowned(sections["2"], certs) >= machines, machines - _chowned(sections["2"], certs)
    assert "ca.key" not in _chowned(text, certs)  # never mounted, never handed to a container


# ----------------------------------------------------------------------------- scripts/docker_e2e.py


def test_e2e_local_base_images_follow_flowers_layout(tmp_path: Path) -> None:
    """The stand-ins for flwr/{superlink,supernode,superexec}: Flower's entry points, the pinned
    flwr, user app (uid 49999) with HOME=WORKDIR=/app, the venv first on PATH."""
    e2e = e2e_script()
    assert e2e.FLWR_VERSION == FLWR_VERSION
    text = script_module(ROOT / "scripts" / "docker_e2e_bases.py").BASE_DOCKERFILE
    stages = dict(re.findall(r'^FROM base AS (\w+)\nENTRYPOINT \["([\w-]+)"\]$', text, re.M))
    assert stages == IMAGE_BINARY
    for want in ("--uid 49999 app", "WORKDIR /app", "USER app", "ENV HOME=/app", "PATH=/python/venv/bin:"):
        assert want in text, want
    assert '"flwr==${FLWR_VERSION}"' in text


def test_e2e_copies_only_the_pip_settings_that_reach_a_registry(tmp_path: Path) -> None:
    """file:// indexes, find-links and constraint files are paths of this machine: left out."""
    e2e = e2e_script()
    listing = (
        "global.index-url='https://mirror.example.org/simple'\n"
        "global.extra-index-url='file:///opt/pypi/simple https://extra.example.org/simple'\n"
        "global.constraint='/etc/xdg/pip/constraints.txt'\n"
        "global.find-links='/opt/wheels'\n"
        ":env:.default-timeout='180'\n"
    )
    run = e2e.E2E(tmp_path, None, False)
    run.sh = lambda *a, **k: subprocess.CompletedProcess(a, 0, listing, "")
    conf = run.pip_conf()
    assert conf.splitlines()[:2] == ["[global]", "cert = /etc/ssl/certs/ca-certificates.crt"]
    assert "index-url = https://mirror.example.org/simple" in conf
    assert "extra-index-url = https://extra.example.org/simple" in conf
    assert "timeout = 180" in conf
    assert "file://" not in conf and "constraint" not in conf and "find-links" not in conf
    assert run.registry_index() == "https://mirror.example.org/simple"


def _rounds(*accuracies: float) -> list[dict[str, Any]]:
    return [{"round": n, "test-accuracy": a} for n, a in enumerate(accuracies)]


def test_e2e_learning_criterion_fails_a_flat_run_and_passes_a_rising_one() -> None:
    """not_learned (shared with tests/test_deployment.py): the last round at least the floor and
    above round 1. The images' run before the criterion went 0.10 -> 0.10 (no update needed)."""
    not_learned = e2e_script().not_learned
    assert e2e_script().LEARNED_FLOOR == 0.3
    flat = not_learned(_rounds(0.10, 0.10, 0.10))
    assert flat is not None and "0.100 -> 0.100 -> 0.100" in flat and ">= 0.3" in flat, flat
    assert not_learned(_rounds(0.10, 0.10, 0.555)) is None  # the run phase as measured
    assert not_learned(_rounds(0.10, 0.20, 0.36, 0.30, 0.31)) is None  # dips, ends on the floor
    assert not_learned(_rounds(0.10, 0.15, 0.299)) is not None  # rising, below the floor
    assert not_learned(_rounds(0.10, 0.60, 0.50)) is not None  # above the floor, below round 1
    assert not_learned(_rounds(0.10, 0.45, 0.45)) is not None  # not above round 1: no update
    assert not_learned(_rounds(0.10, 0.10, 0.25), floor=0.2) is None
    # One trained round cannot show a rise; a round without a test accuracy is no evidence.
    assert "round 1 and a later round" in not_learned(_rounds(0.10, 0.90))
    assert not_learned(_rounds(0.10, 0.10) + [{"round": 2, "test-accuracy": None}]) is not None
    # Order in results.json does not matter: rounds are read by number.
    assert not_learned(list(reversed(_rounds(0.10, 0.10, 0.555)))) is None
