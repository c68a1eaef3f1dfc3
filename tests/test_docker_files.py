"""docker/ and scripts/make_certs.sh: consistent with each other and with the installed flwr.

No Docker daemon is needed: the Compose files are parsed as YAML, every flag they
(and docs/deploy.md) pass to a Flower command must exist in that command's
``--help`` (the installed flwr 1.42), every file they mount must exist or be
written by scripts/make_certs.sh, and the committed Compose files must equal the
output of docker/make_compose.py. If a ``docker compose`` plugin is installed,
``docker compose config`` validates the files too.
"""

from __future__ import annotations

import functools
import importlib.metadata
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

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
MAKE_CERTS = ROOT / "scripts" / "make_certs.sh"
MAKE_COMPOSE = DOCKER / "make_compose.py"
DEPLOY_DOC = ROOT / "docs" / "deploy.md"
COMPOSE_FILES = ["compose.yml", "compose.insecure.yml", "compose.superlink.yml", "compose.supernode.yml"]
SECURE_FILES = ["compose.yml", "compose.superlink.yml", "compose.supernode.yml"]
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


class ComposeLoader(yaml.SafeLoader):
    """YAML loader that knows Compose's merge tags (!override, !reset)."""


def _tagged(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node)
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node)
    return loader.construct_scalar(node)


ComposeLoader.add_constructor("!override", _tagged)
ComposeLoader.add_constructor("!reset", _tagged)


def load_compose(name: str) -> dict[str, Any]:
    data = yaml.load((DOCKER / name).read_text(), Loader=ComposeLoader)
    assert isinstance(data, dict) and isinstance(data.get("services"), dict), name
    return data


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
    if compose == "compose.insecure.yml":  # an override: the base file says what it is
        base = load_compose("compose.yml")["services"][name]
        return service_binary(name, base, "compose.yml")
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


def test_dockerfile_copy_sources_exist_and_pass_the_dockerignore() -> None:
    contexts = {}
    for compose in COMPOSE_FILES:
        for svc in load_compose(compose)["services"].values():
            if "build" in svc:
                context, dockerfile = build_paths(svc, compose)
                assert context.is_dir(), context
                assert (DOCKER / dockerfile).is_file(), dockerfile
                contexts[dockerfile] = context
    for dockerfile, context in contexts.items():
        text = (DOCKER / dockerfile).read_text()
        ignore = DOCKER / f"{dockerfile}.dockerignore"
        allowed = re.findall(r"^!(\S+?)/?$", ignore.read_text(), re.M) if ignore.exists() else None
        for line in re.findall(r"^COPY (.+)$", text, re.M):
            srcs = [a for a in line.split() if not a.startswith("--")][:-1]
            for src in srcs:
                assert (context / src).exists(), f"{dockerfile}: COPY {src}: not in {context}"
                if allowed is not None:
                    assert src.rstrip("/") in allowed, f"{ignore.name} excludes {src}"


# ----------------------------------------------------------------------------- Compose files


def test_compose_files_parse_and_pin_the_flwr_images() -> None:
    base = load_compose("compose.yml")["services"]
    for compose in COMPOSE_FILES:
        services = load_compose(compose)["services"]
        assert services, compose
        for name, svc in services.items():
            if compose == "compose.insecure.yml":
                assert name in base, f"override for unknown service {name}"
                continue
            assert "image" in svc or "build" in svc, f"{compose}/{name}"
            image = str(svc.get("image", ""))
            if image.startswith("flwr/"):
                assert image.endswith(f":${{FLWR_VERSION:-{FLWR_VERSION}}}"), image
            args = (svc.get("build") or {}).get("args") or {}
            if "FLWR_VERSION" in args:
                assert args["FLWR_VERSION"] == f"${{FLWR_VERSION:-{FLWR_VERSION}}}"


def health_probe(compose: str = "compose.yml") -> tuple[str, str]:
    """(the healthcheck's Python probe, the host:port it dials) of ``compose``."""
    test = load_compose(compose)["x-healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"], test
    m = re.search(r"insecure_channel\('([^']+)'\)", test[3])
    assert m, test[3]
    return test[3], m.group(1)


@pytest.mark.parametrize("compose", SECURE_FILES)
def test_every_service_is_health_checked_and_its_logs_rotate(compose: str) -> None:
    probe, address = health_probe(compose)
    assert health_probe() == (probe, address)  # one probe for every file
    insecure = load_compose("compose.insecure.yml")["services"] if compose == "compose.yml" else {}
    for name, svc in load_compose(compose)["services"].items():
        # The probe dials the health server that the service's own command starts...
        for cmd in (svc["command"], *([insecure[name]["command"]] if name in insecure else [])):
            assert f"--health-server-address={address}" in cmd, f"{compose}/{name}: {cmd}"
        assert svc["healthcheck"]["test"][3] == probe and svc["healthcheck"]["retries"] >= 1
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
        execs = [
            s
            for n, s in services.items()
            if f"--runtime-api-address={name}:{port}" in [interpolate(str(a)) for a in s.get("command", [])]
        ]
        assert len(execs) == 1, f"{compose}/{name}: needs exactly one SuperExec on {name}:{port}"
        pairs.append((svc, execs[0]))
    return pairs


def _gpu_ids(svc: dict[str, Any]) -> list[str]:
    devices = svc["deploy"]["resources"]["reservations"]["devices"]
    assert len(devices) == 1 and devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    return [interpolate(str(d)) for d in devices[0]["device_ids"]]


@pytest.mark.parametrize("compose", ["compose.yml", "compose.supernode.yml"])
def test_each_supernode_has_its_partition_gpu_and_cache(compose: str) -> None:
    pairs = _pairs(compose)
    assert pairs
    configs = [node_config([interpolate(str(a)) for a in sn["command"]]) for sn, _ in pairs]
    n = len(pairs) if compose == "compose.yml" else int(configs[0]["num-partitions"])
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
    for compose in ("compose.yml", "compose.superlink.yml"):
        services = load_compose(compose)["services"]
        link = [interpolate(str(a)) for a in services["superlink"]["command"]]
        port = next(a.partition("=")[2] for a in link if a.startswith("--port="))
        exe = [interpolate(str(a)) for a in services["superexec-serverapp"]["command"]]
        assert f"--runtime-api-address=superlink:{port}" in exe
        published = [interpolate(str(p)) for p in services["superlink"]["ports"]]
        assert any(p.endswith(f":{port}") for p in published), published


def test_committed_compose_files_are_the_generator_output() -> None:
    for args, name in (
        (["--gpus", "0,1"], "compose.yml"),
        (["--gpus", "0,1", "--insecure"], "compose.insecure.yml"),
    ):
        cp = subprocess.run(
            [sys.executable, str(MAKE_COMPOSE), *args], capture_output=True, text=True, check=True
        )
        assert cp.stdout == (DOCKER / name).read_text(), (
            f"docker/{name} differs from `python docker/make_compose.py {' '.join(args)}`: regenerate it"
        )


def test_generator_scales_to_more_gpus(tmp_path: Path) -> None:
    out = tmp_path / "compose.4gpu.yml"
    subprocess.run([sys.executable, str(MAKE_COMPOSE), "--gpus", "0,1,2,3", "-o", str(out)], check=True)
    data = yaml.load(out.read_text(), Loader=ComposeLoader)
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


def test_docker_compose_config_accepts_the_files(certs: Path, tmp_path: Path) -> None:
    probe = (
        subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
        if shutil.which("docker")
        else None
    )
    if probe is None or probe.returncode != 0:
        pytest.skip("no `docker compose` plugin on this machine")
    env = {**os.environ, **REQUIRED_ENV}
    for files in (
        ["compose.yml"],
        ["compose.yml", "compose.insecure.yml"],
        ["compose.superlink.yml"],
        ["compose.supernode.yml"],
    ):
        args = [a for f in files for a in ("-f", str(DOCKER / f))]
        cp = subprocess.run(
            ["docker", "compose", *args, "config", "-q"], capture_output=True, text=True, env=env
        )
        assert cp.returncode == 0, f"{files}: {cp.stderr}"


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
    assert bad.returncode == 2 and "non-negative integer" in bad.stderr


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


@pytest.mark.skipif(not DEPLOY_DOC.exists(), reason="docs/deploy.md not written")
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
            if value.endswith(".toml"):
                assert (ROOT / value).is_file(), f"docs/deploy.md: no {value}"
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
