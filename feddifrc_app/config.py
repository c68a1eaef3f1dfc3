"""Typed run/node configuration, built and validated in one place.

Every default lives once, in ``[tool.flwr.app.config]`` of pyproject.toml. Flower
hands the run config over as a flat ``{"dotted.key": scalar}`` mapping and does
not type-check overrides (``2.5`` can arrive in an int key, ``"1"`` in a float
key), so this module casts and validates EVERY key before any data or model is
touched. It is the only module that knows the key strings. Stdlib only.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

METHODS = ("fedavg", "feddifrc", "feddifrc-ssl")
DATASETS = ("digits", "mnist-5k", "cifar10", "cifar100", "tiny-imagenet", "image-folder")
PARTITIONS = ("iid", "dirichlet", "pathological")
MODELS = ("resnet10",)
STRATEGIES = (
    "fedavg",
    "fedavgm",
    "fedprox",
    "fedadam",
    "fedyogi",
    "fedadagrad",
    "fedmedian",
    "fedtrimmedavg",
)
PROJECTIONS = ("federated-pca", "local-pca", "random", "per-batch")
CONDITIONS = ("none", "global-model")
LOSS_VARIANTS = ("paper", "code")
NORMALISERS = ("none", "mean-distance")
NDCR_SPACES = ("unit", "raw")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "float16", "bfloat16")

DEFAULT_CACHE_DIR = "~/.cache/feddifrc"


class ConfigError(ValueError):
    """A config key is missing, unknown, of the wrong type or out of range."""


# --------------------------------------------------------------------------- dataclasses


@dataclass(frozen=True)
class DatasetConfig:
    name: str
    data_dir: str  # absolute; "" resolved to ~/.cache/feddifrc/data
    image_size: int
    num_workers: int
    train_limit: int  # 0 = all training images


@dataclass(frozen=True)
class PartitionConfig:
    name: str
    alpha: float
    classes_per_client: int
    imb_factor: float


@dataclass(frozen=True)
class TrainConfig:
    local_epochs: int
    batch_size: int
    lr: float
    momentum: float
    weight_decay: float
    keep_momentum: bool
    augment: bool
    eval_batch_size: int
    device: str


@dataclass(frozen=True)
class StrategyConfig:
    name: str
    proximal_mu: float
    server_learning_rate: float
    server_momentum: float
    eta: float
    eta_l: float
    beta_1: float
    beta_2: float
    tau: float
    trim_beta: float
    round_timeout: float


@dataclass(frozen=True)
class DiffusionConfig:
    model: str  # "tiny", a hub id, or an absolute local folder
    resolution: int
    timestep: int
    blocks: tuple[int, ...]
    channels: tuple[int, ...]
    ensemble: int
    projection: str
    prompt_template: str
    ndcr_prompt: str
    batch_size: int
    device: str
    dtype: str
    cache_dir: str  # "" = take the node's cache-dir (see NodeConfig.resolve_cache_dir)
    condition: str


@dataclass(frozen=True)
class LossConfig:
    variant: str
    tdcl_weight: float
    ndcr_weight: float
    temperature: float
    num_negatives: int
    tdcl_normaliser: str
    ndcr_space: str


@dataclass(frozen=True)
class SSLConfig:
    positive_prompt: str
    ndcr_prompt: str
    negatives: tuple[str, ...]  # () = built-in Tiny-ImageNet class names
    num_negatives: int
    probe_epochs: int


@dataclass(frozen=True)
class Config:
    method: str
    seed: int
    num_server_rounds: int
    fraction_train: float
    fraction_evaluate: float
    min_nodes: int
    outputs_dir: str  # absolute
    run_name: str
    resume_from: str  # absolute or ""
    keep_checkpoints: int
    dataset: DatasetConfig
    partition: PartitionConfig
    model_name: str
    model_width: int  # ResNet-10 base width; the embedding is 8 * width (paper: 64 -> 512)
    train: TrainConfig
    strategy: StrategyConfig
    diffusion: DiffusionConfig
    loss: LossConfig
    ssl: SSLConfig

    @property
    def embedding_dim(self) -> int:
        """Width of the classifier embedding z, which the fused teacher feature must match."""
        return 8 * self.model_width

    @property
    def uses_diffusion(self) -> bool:
        return self.method in ("feddifrc", "feddifrc-ssl")

    def to_flat(self) -> dict[str, Any]:
        """Back to the flat dotted-key form (lists joined by commas); round-trips load_config."""
        return dict(_to_flat(self))


@dataclass(frozen=True)
class NodeConfig:
    """What a node knows about itself (Flower ``node_config``)."""

    partition_id: int | None
    num_partitions: int | None
    data_dir: str  # a node's own image-folder data; "" = use the benchmark partition
    cache_dir: str  # "" = run config / default

    def resolve_cache_dir(self, cfg: Config) -> Path:
        """Node's cache-dir wins, then the run config's, then ~/.cache/feddifrc."""
        raw = self.cache_dir or cfg.diffusion.cache_dir or DEFAULT_CACHE_DIR
        return Path(os.path.expanduser(raw)).resolve()


# --------------------------------------------------------------------------- casting


def _fail(key: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"config key '{key}' = {value!r} is invalid: {allowed}")


def _as_int(key: str, v: Any) -> int:
    if isinstance(v, bool):
        raise _fail(key, v, "expected an integer")
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            pass
    raise _fail(key, v, "expected an integer")


def _as_float(key: str, v: Any) -> float:
    if isinstance(v, bool):
        raise _fail(key, v, "expected a number")
    if isinstance(v, (int, float)):
        out = float(v)
    elif isinstance(v, str):
        try:
            out = float(v.strip())
        except ValueError:
            raise _fail(key, v, "expected a number") from None
    else:
        raise _fail(key, v, "expected a number")
    if not math.isfinite(out):
        raise _fail(key, v, "expected a finite number")
    return out


def _as_bool(key: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("true", "false", "1", "0", "yes", "no"):
        return v.strip().lower() in ("true", "1", "yes")
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    raise _fail(key, v, "expected true or false")


def _as_str(key: str, v: Any) -> str:
    if not isinstance(v, str):
        raise _fail(key, v, "expected a string")
    return v


def _choice(key: str, v: Any, choices: tuple[str, ...]) -> str:
    s = _as_str(key, v).strip().lower()
    if s not in choices:
        raise _fail(key, v, f"expected one of {', '.join(choices)}")
    return s


def _int_list(key: str, v: Any) -> tuple[int, ...]:
    if isinstance(v, int) and not isinstance(v, bool):
        return (v,)
    s = _as_str(key, v)
    try:
        out = tuple(int(p) for p in s.split(",") if p.strip())
    except ValueError:
        raise _fail(key, v, "expected comma-separated integers, e.g. '1,2,3'") from None
    if not out:
        raise _fail(key, v, "expected at least one integer")
    return out


def _in_range(key: str, v: float, lo: float | None = None, hi: float | None = None,
              lo_open: bool = False, hi_open: bool = False) -> None:
    bad = (lo is not None and (v <= lo if lo_open else v < lo)) or (
        hi is not None and (v >= hi if hi_open else v > hi)
    )
    if bad:
        lb = "(" if lo_open else "["
        rb = ")" if hi_open else "]"
        lo_s = "-inf" if lo is None else f"{lo:g}"
        hi_s = "inf" if hi is None else f"{hi:g}"
        raise _fail(key, v, f"expected a value in {lb}{lo_s}, {hi_s}{rb}")


def _path(v: str) -> str:
    return str(Path(os.path.expanduser(v)).resolve()) if v else ""


# --------------------------------------------------------------------------- key table

# key -> (kind, extra) ; kinds: int, float, bool, str, choice, intlist, strlist, path
_KEYS: dict[str, tuple[str, Any]] = {
    "method": ("choice", METHODS),
    "seed": ("int", (0, None)),
    "num-server-rounds": ("int", (1, None)),
    "fraction-train": ("float", (0.0, 1.0, True, False)),
    "fraction-evaluate": ("float", (0.0, 1.0)),
    "min-nodes": ("int", (1, None)),
    "outputs-dir": ("path", None),
    "run-name": ("str", None),
    "resume-from": ("path", None),
    "keep-checkpoints": ("int", (0, None)),
    "dataset.name": ("choice", DATASETS),
    "dataset.data-dir": ("path", None),
    "dataset.image-size": ("int", (8, 1024)),
    "dataset.num-workers": ("int", (0, 64)),
    "dataset.train-limit": ("int", (0, None)),
    "partition.name": ("choice", PARTITIONS),
    "partition.alpha": ("float", (0.0, None, True, False)),
    "partition.classes-per-client": ("int", (1, None)),
    "partition.imb-factor": ("float", (0.0, 1.0, True, False)),
    "model.name": ("choice", MODELS),
    "model.width": ("int", (1, 1024)),
    "train.local-epochs": ("int", (1, None)),
    "train.batch-size": ("int", (1, None)),
    "train.lr": ("float", (0.0, None, True, False)),
    "train.momentum": ("float", (0.0, 1.0, False, True)),
    "train.weight-decay": ("float", (0.0, None)),
    "train.keep-momentum": ("bool", None),
    "train.augment": ("bool", None),
    "train.eval-batch-size": ("int", (1, None)),
    "train.device": ("choice", DEVICES),
    "strategy.name": ("choice", STRATEGIES),
    "strategy.proximal-mu": ("float", (0.0, None)),
    "strategy.server-learning-rate": ("float", (0.0, None, True, False)),
    "strategy.server-momentum": ("float", (0.0, 1.0, False, True)),
    "strategy.eta": ("float", (0.0, None, True, False)),
    "strategy.eta-l": ("float", (0.0, None, True, False)),
    "strategy.beta-1": ("float", (0.0, 1.0, False, True)),
    "strategy.beta-2": ("float", (0.0, 1.0, False, True)),
    "strategy.tau": ("float", (0.0, None, True, False)),
    "strategy.trim-beta": ("float", (0.0, 0.5, False, True)),
    "strategy.round-timeout": ("float", (0.0, None, True, False)),
    "diffusion.model": ("str", None),
    "diffusion.resolution": ("int", (8, 1024)),
    "diffusion.timestep": ("int", (0, 999)),
    "diffusion.blocks": ("intlist", None),
    "diffusion.channels": ("intlist", None),
    "diffusion.ensemble": ("int", (1, 64)),
    "diffusion.projection": ("choice", PROJECTIONS),
    "diffusion.prompt-template": ("str", None),
    "diffusion.ndcr-prompt": ("str", None),
    "diffusion.batch-size": ("int", (1, None)),
    "diffusion.device": ("choice", DEVICES),
    "diffusion.dtype": ("choice", DTYPES),
    "diffusion.cache-dir": ("path", None),
    "diffusion.condition": ("choice", CONDITIONS),
    "loss.variant": ("choice", LOSS_VARIANTS),
    "loss.tdcl-weight": ("float", (0.0, None)),
    "loss.ndcr-weight": ("float", (0.0, None)),
    "loss.temperature": ("float", (0.0, None, True, False)),
    "loss.num-negatives": ("int", (0, None)),
    "loss.tdcl-normaliser": ("choice", NORMALISERS),
    "loss.ndcr-space": ("choice", NDCR_SPACES),
    "ssl.positive-prompt": ("str", None),
    "ssl.ndcr-prompt": ("str", None),
    "ssl.negatives": ("strlist", None),
    "ssl.num-negatives": ("int", (1, None)),
    "ssl.probe-epochs": ("int", (1, None)),
}


def _cast(key: str, raw: Any) -> Any:
    kind, extra = _KEYS[key]
    if kind == "choice":
        return _choice(key, raw, extra)
    if kind == "int":
        v = _as_int(key, raw)
        _in_range(key, v, *extra)
        return v
    if kind == "float":
        v = _as_float(key, raw)
        _in_range(key, v, *extra)
        return v
    if kind == "bool":
        return _as_bool(key, raw)
    if kind == "str":
        return _as_str(key, raw)
    if kind == "path":
        return _path(_as_str(key, raw).strip())
    if kind == "intlist":
        return _int_list(key, raw)
    if kind == "strlist":
        return tuple(p.strip() for p in _as_str(key, raw).split(",") if p.strip())
    raise AssertionError(kind)


def load_config(run_config: Mapping[str, Any]) -> Config:
    """Cast and validate a flat Flower run config into a frozen ``Config``.

    Raises ``ConfigError`` naming the key, the value and what is allowed, for
    unknown keys, missing keys, bad types, out-of-range values and bad names.
    """
    unknown = sorted(set(run_config) - set(_KEYS))
    if unknown:
        raise ConfigError(
            f"unknown config key(s) {', '.join(map(repr, unknown))}; "
            f"valid keys are listed in [tool.flwr.app.config] of pyproject.toml"
        )
    missing = sorted(set(_KEYS) - set(run_config))
    if missing:
        raise ConfigError(f"missing config key(s) {', '.join(map(repr, missing))}")
    v = {k: _cast(k, run_config[k]) for k in _KEYS}

    # Cross-key rules.
    blocks, channels = v["diffusion.blocks"], v["diffusion.channels"]
    if len(blocks) != len(channels):
        raise ConfigError(
            f"config keys 'diffusion.blocks' = {run_config['diffusion.blocks']!r} and "
            f"'diffusion.channels' = {run_config['diffusion.channels']!r} must have the same length"
        )
    if len(set(blocks)) != len(blocks) or any(b < 0 or b > 3 for b in blocks):
        raise _fail("diffusion.blocks", run_config["diffusion.blocks"],
                    "expected distinct up_block indices in 0..3")
    if any(c < 1 for c in channels):
        raise _fail("diffusion.channels", run_config["diffusion.channels"], "expected positive widths")
    if sum(channels) != 8 * v["model.width"]:
        # The fused teacher feature is compared with the ResNet-10 embedding (8 * model.width).
        raise _fail("diffusion.channels", run_config["diffusion.channels"],
                    f"widths must sum to {8 * v['model.width']}, the ResNet-10 embedding width "
                    f"(8 * model.width = 8 * {v['model.width']})")
    if v["diffusion.model"].strip() == "":
        raise _fail("diffusion.model", "", "expected 'tiny-mnist', 'tiny', a hub id or a local folder")
    if "{}" not in v["diffusion.prompt-template"]:
        raise _fail("diffusion.prompt-template", v["diffusion.prompt-template"],
                    "must contain '{}' where the class name goes")
    if v["dataset.name"] == "image-folder" and not v["dataset.data-dir"]:
        raise _fail("dataset.data-dir", "", "dataset 'image-folder' needs a class-per-folder root")
    if v["loss.variant"] == "code" and (v["loss.num-negatives"] != 0 or v["loss.tdcl-normaliser"] != "none"):
        raise ConfigError(
            "config key 'loss.variant' = 'code' reproduces the public code, which has neither sampled "
            "negatives nor a normaliser: set 'loss.num-negatives' = 0 and 'loss.tdcl-normaliser' = 'none'"
        )
    if v["diffusion.condition"] == "global-model" and v["diffusion.projection"] == "per-batch":
        raise _fail("diffusion.condition", "global-model", "needs a shared basis (not diffusion.projection = 'per-batch')")
    model = v["diffusion.model"].strip()
    if model.startswith(("~", "/", ".")):
        model = _path(model)

    return Config(
        method=v["method"],
        seed=v["seed"],
        num_server_rounds=v["num-server-rounds"],
        fraction_train=v["fraction-train"],
        fraction_evaluate=v["fraction-evaluate"],
        min_nodes=v["min-nodes"],
        outputs_dir=v["outputs-dir"] or _path("~/feddifrc-runs"),
        run_name=v["run-name"].strip(),
        resume_from=v["resume-from"],
        keep_checkpoints=v["keep-checkpoints"],
        dataset=DatasetConfig(
            name=v["dataset.name"],
            data_dir=v["dataset.data-dir"] or _path(DEFAULT_CACHE_DIR + "/data"),
            image_size=v["dataset.image-size"],
            num_workers=v["dataset.num-workers"],
            train_limit=v["dataset.train-limit"],
        ),
        partition=PartitionConfig(
            name=v["partition.name"],
            alpha=v["partition.alpha"],
            classes_per_client=v["partition.classes-per-client"],
            imb_factor=v["partition.imb-factor"],
        ),
        model_name=v["model.name"],
        model_width=v["model.width"],
        train=TrainConfig(
            local_epochs=v["train.local-epochs"],
            batch_size=v["train.batch-size"],
            lr=v["train.lr"],
            momentum=v["train.momentum"],
            weight_decay=v["train.weight-decay"],
            keep_momentum=v["train.keep-momentum"],
            augment=v["train.augment"],
            eval_batch_size=v["train.eval-batch-size"],
            device=v["train.device"],
        ),
        strategy=StrategyConfig(
            name=v["strategy.name"],
            proximal_mu=v["strategy.proximal-mu"],
            server_learning_rate=v["strategy.server-learning-rate"],
            server_momentum=v["strategy.server-momentum"],
            eta=v["strategy.eta"],
            eta_l=v["strategy.eta-l"],
            beta_1=v["strategy.beta-1"],
            beta_2=v["strategy.beta-2"],
            tau=v["strategy.tau"],
            trim_beta=v["strategy.trim-beta"],
            round_timeout=v["strategy.round-timeout"],
        ),
        diffusion=DiffusionConfig(
            model=model,
            resolution=v["diffusion.resolution"],
            timestep=v["diffusion.timestep"],
            blocks=blocks,
            channels=channels,
            ensemble=v["diffusion.ensemble"],
            projection=v["diffusion.projection"],
            prompt_template=v["diffusion.prompt-template"],
            ndcr_prompt=v["diffusion.ndcr-prompt"],
            batch_size=v["diffusion.batch-size"],
            device=v["diffusion.device"],
            dtype=v["diffusion.dtype"],
            cache_dir=v["diffusion.cache-dir"],
            condition=v["diffusion.condition"],
        ),
        loss=LossConfig(
            variant=v["loss.variant"],
            tdcl_weight=v["loss.tdcl-weight"],
            ndcr_weight=v["loss.ndcr-weight"],
            temperature=v["loss.temperature"],
            num_negatives=v["loss.num-negatives"],
            tdcl_normaliser=v["loss.tdcl-normaliser"],
            ndcr_space=v["loss.ndcr-space"],
        ),
        ssl=SSLConfig(
            positive_prompt=v["ssl.positive-prompt"],
            ndcr_prompt=v["ssl.ndcr-prompt"],
            negatives=v["ssl.negatives"],
            num_negatives=v["ssl.num-negatives"],
            probe_epochs=v["ssl.probe-epochs"],
        ),
    )


def load_node_config(node_config: Mapping[str, Any]) -> NodeConfig:
    """Validate Flower's ``node_config``: partition-id/num-partitions and/or data-dir, cache-dir."""
    known = {"partition-id", "num-partitions", "data-dir", "cache-dir"}
    pid = node_config.get("partition-id")
    n = node_config.get("num-partitions")
    pid = None if pid is None else _as_int("node partition-id", pid)
    n = None if n is None else _as_int("node num-partitions", n)
    data_dir = _path(_as_str("node data-dir", node_config.get("data-dir", "")).strip())
    cache_dir = _path(_as_str("node cache-dir", node_config.get("cache-dir", "")).strip())
    if n is not None and n < 1:
        raise _fail("node num-partitions", n, "expected an integer >= 1")
    if (pid is None) != (n is None):
        raise ConfigError("node config needs both 'partition-id' and 'num-partitions' (or neither)")
    if pid is not None and not 0 <= pid < n:
        raise _fail("node partition-id", pid, f"expected 0 <= partition-id < num-partitions ({n})")
    if pid is None and not data_dir:
        raise ConfigError(
            "node config needs 'partition-id' and 'num-partitions' (benchmark split) or 'data-dir' "
            f"(the node's own class-per-folder images); got keys {sorted(node_config)} "
            f"(recognised: {sorted(known)})"
        )
    return NodeConfig(partition_id=pid, num_partitions=n, data_dir=data_dir, cache_dir=cache_dir)


def read_app_defaults(pyproject: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``[tool.flwr.app.config]`` table of an app's pyproject.toml (flat dotted keys)."""
    with open(pyproject, "rb") as f:
        data = tomllib.load(f)
    table = data["tool"]["flwr"]["app"]["config"]
    return dict(_flatten(table))


def _flatten(table: Mapping[str, Any], prefix: str = ""):
    for k, val in table.items():
        key = f"{prefix}{k}"
        if isinstance(val, Mapping):
            yield from _flatten(val, key + ".")
        else:
            yield key, val


def read_override_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A conf/*.toml override file, flattened to dotted keys."""
    with open(path, "rb") as f:
        return dict(_flatten(tomllib.load(f)))


def _to_flat(cfg: Config):
    inv = {
        "method": cfg.method, "seed": cfg.seed, "num-server-rounds": cfg.num_server_rounds,
        "fraction-train": cfg.fraction_train, "fraction-evaluate": cfg.fraction_evaluate, "min-nodes": cfg.min_nodes,
        "outputs-dir": cfg.outputs_dir, "run-name": cfg.run_name, "resume-from": cfg.resume_from,
        "keep-checkpoints": cfg.keep_checkpoints, "model.name": cfg.model_name,
        "model.width": cfg.model_width,
    }
    yield from inv.items()
    for section, obj in (("dataset", cfg.dataset), ("partition", cfg.partition),
                         ("train", cfg.train), ("strategy", cfg.strategy),
                         ("diffusion", cfg.diffusion), ("loss", cfg.loss), ("ssl", cfg.ssl)):
        for f in dataclasses.fields(obj):
            val = getattr(obj, f.name)
            if isinstance(val, tuple):
                val = ",".join(str(x) for x in val)
            yield f"{section}.{f.name.replace('_', '-')}", val
