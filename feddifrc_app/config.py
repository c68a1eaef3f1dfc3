"""The typed run and node configuration: every key, its type and its range, in one place.

Every default lives once, in ``[tool.flwr.app.config]`` of pyproject.toml; every key, its type
and its range live once, in the dataclasses below (a key is its section and field name, ``_``
spelled ``-``). ``config_loader.load_config`` casts a flat run config into ``Config`` and runs the
rules that span keys (a rule of one strategy, DP or method lives in its module).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Any, get_type_hints

from feddifrc_app import casting
from feddifrc_app.casting import (
    FLOAT32_TINY,
    MAX_Q,
    MAX_STEP,
    MAX_TIMEOUT_S,
    ConfigError,
    invalid,
)

DATASETS = ("digits", "mnist-5k", "mnist-5k-pool", "cifar10", "cifar100", "tiny-imagenet", "image-folder")
PARTITIONS = ("iid", "dirichlet", "pathological")
MODELS = ("resnet10",)
# Flower's own strategies; a method module adds those it brings (its ``STRATEGIES``), composed by
# config_loader.keys() into what ``strategy.name`` accepts.
STRATEGIES = ("fedavg", "fedavgm", "fedprox", "fedadam", "fedyogi", "fedadagrad", "fedmedian")
STRATEGIES += ("fedtrimmedavg", "krum", "multikrum", "bulyan", "qfedavg")
DP_MODES = ("none", "server-fixed", "server-adaptive", "client-fixed", "client-adaptive")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "float16", "bfloat16")

# ResNet-10's stage strides (model.py builds it from these): a 3x3 stride-2 conv, padding 1,
# maps S to ceil(S / 2), so the last stage is ceil(S / 8) pixels wide.
RESNET10_STRIDES = (1, 2, 2, 2)


def last_stage_size(image_size: int) -> int:
    """Side of ResNet-10's last feature map for ``image_size`` px inputs (8 px -> 1x1)."""
    s = image_size
    for stride in RESNET10_STRIDES:
        s = -(-s // stride)
    return s


DEFAULT_CACHE_DIR = "~/.cache/feddifrc"
DEFAULT_OUTPUTS_DIR = "~/feddifrc-runs"


def key(
    *,
    choices: tuple[str, ...] = (),
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    hi_open: bool = False,
    path: bool = False,
    empty: str = "",
    resume: bool = False,
    cast: Callable[[str, str], Any] | None = None,
) -> Any:
    """A config key's rule: allowed names, a range, or a path (``empty`` = the path used for "").

    ``resume=True``: a resumed run may change it (where and how long it runs, not what it
    computes); every other key must match the run's own config.json. ``cast(key, text)``: a
    string key's own reading (a teacher: a hub id, or a local folder made absolute)."""
    return field(
        metadata=dict(
            choices=choices,
            range=(lo, hi, lo_open, hi_open),
            path=path,
            empty=empty,
            resume=resume,
            cast=cast,
        )
    )


# --------------------------------------------------------------------------- the keys


@dataclass(frozen=True)
class DatasetConfig:
    name: str = key(choices=DATASETS)
    data_dir: str = key(path=True, empty=DEFAULT_CACHE_DIR + "/data")
    image_size: int = key(lo=8, hi=1024)
    num_workers: int = key(lo=0, hi=64, resume=True)
    train_limit: int = key(lo=0)  # 0 = all training images
    eval_limit: int = key(lo=0)  # 0 = all validation / test images; N = a fixed stratified N (smoke runs)
    # Share of the training split held out for the server's validation, before partitioning
    # (0 = none: the nodes train on the whole split, the server reports test only).
    val_fraction: float = key(lo=0.0, hi=0.5)
    classes: tuple[str, ...] = key()  # image-folder: the federation's class folders in label order


@dataclass(frozen=True)
class PartitionConfig:
    name: str = key(choices=PARTITIONS)
    alpha: float = key(lo=1e-3, hi=1e6)  # outside it, Dirichlet draws underflow or overflow
    classes_per_client: int = key(lo=1)
    imb_factor: float = key(lo=0.0, hi=1.0, lo_open=True)


@dataclass(frozen=True)
class ModelConfig:
    name: str = key(choices=MODELS)
    # ResNet-10 base width; the embedding is 8 * width (paper: 64 -> 512). Parameters grow as
    # width^2: 256 is ~78 M (16x the paper's network); 1024 would be ~1.25 G, not a client model.
    width: int = key(lo=1, hi=256)


@dataclass(frozen=True)
class TrainConfig:
    local_epochs: int = key(lo=1)
    batch_size: int = key(lo=1)
    lr: float = key(lo=0.0, lo_open=True)
    momentum: float = key(lo=0.0, hi=1.0, hi_open=True)
    weight_decay: float = key(lo=0.0)
    keep_momentum: bool = key()
    augment: bool = key()
    max_grad_norm: float = key(lo=0.0)  # every method's local gradient clipping; 0 = none
    eval_batch_size: int = key(lo=1, resume=True)
    device: str = key(choices=DEVICES, resume=True)
    threads: int = key(lo=0, hi=1024, resume=True)  # torch's threads in a node: device.node_threads
    deterministic: bool = key(resume=True)  # torch.use_deterministic_algorithms in a node (GPU runs)


@dataclass(frozen=True)
class ServerConfig:
    # The ServerApp's own torch work (central evaluation): its machine need not be the nodes'.
    device: str = key(choices=DEVICES, resume=True)
    # Central evaluation every k rounds (and always round 0 and the last): which rows results.json scores.
    evaluate_every: int = key(lo=1)


@dataclass(frozen=True)
class StrategyConfig:
    name: str = key(choices=STRATEGIES)
    proximal_mu: float = key(lo=0.0)
    # The step sizes' upper bounds are far above any published setting; past them a run only
    # diverges (FedAvgM at 1e9 reaches a NaN loss in one round).
    server_learning_rate: float = key(lo=0.0, lo_open=True, hi=MAX_STEP)
    server_momentum: float = key(lo=0.0, hi=1.0, hi_open=True)
    eta: float = key(lo=0.0, lo_open=True, hi=MAX_STEP)
    eta_l: float = key(lo=0.0, lo_open=True, hi=MAX_STEP)
    beta_1: float = key(lo=0.0, hi=1.0, hi_open=True)
    beta_2: float = key(lo=0.0, hi=1.0, hi_open=True)
    tau: float = key(lo=FLOAT32_TINY, hi=MAX_STEP)  # below float32's smallest normal it is 0 in the arrays
    trim_beta: float = key(lo=0.0, hi=0.5, hi_open=True)
    num_malicious_nodes: int = key(lo=0)  # krum / multikrum / bulyan: f, the Byzantine nodes tolerated
    num_nodes_to_select: int = key(lo=1)  # multikrum: m, the lowest-scoring updates averaged
    q: float = key(lo=0.0, hi=MAX_Q)  # qfedavg: the fairness exponent (0 = FedAvg)
    dp: str = key(choices=DP_MODES)  # differential privacy: Flower's wrapper around the strategy (privacy.py)
    dp_noise_multiplier: float = key(lo=0.0)
    dp_clipping_norm: float = key(lo=0.0, lo_open=True)  # the fixed modes
    dp_initial_clipping_norm: float = key(lo=0.0, lo_open=True)  # the adaptive modes
    dp_target_clipped_quantile: float = key(lo=0.0, hi=1.0)
    # A round scales the clipping norm by up to e^lr (Flower: 0.2).
    dp_clip_norm_lr: float = key(lo=0.0, lo_open=True, hi=1.0)
    dp_clipped_count_stddev: float = key(lo=0.0)  # 0 = derived: clipped_count_stddev
    # The accountant's delta: the chance the epsilon bound fails. Above 0.01 it is no guarantee (and
    # epsilon tends to 0 as delta tends to 1, so a large one reports a reassuring 0.0).
    dp_delta: float = key(lo=0.0, hi=0.01, lo_open=True)
    round_timeout: float = key(lo=0.0, lo_open=True, hi=MAX_TIMEOUT_S, resume=True)
    setup_timeout: float = key(lo=0.0, lo_open=True, hi=MAX_TIMEOUT_S, resume=True)


@dataclass(frozen=True)
class TrackingConfig:  # tracking.py: the server streams rows and config; never what a run computes
    backend: str = key(choices=("none", "tensorboard", "mlflow", "wandb"), resume=True)
    dir: str = key(path=True, resume=True)  # "" = the run folder
    project: str = key(resume=True)  # MLflow's experiment, W&B's project
    tags: tuple[str, ...] = key(resume=True)  # "name:value" or "name"; a sweep adds its cell's


@dataclass(frozen=True)
class Config:
    method: str = key()  # "fedavg" or a method module's (methods/: its NAMES); the loader checks it
    seed: int = key(lo=0, hi=2**32 - 1)  # numpy seeds are 32-bit
    num_server_rounds: int = key(lo=1, resume=True)
    fraction_train: float = key(lo=0.0, hi=1.0, lo_open=True)
    fraction_evaluate: float = key(lo=0.0, hi=1.0)
    evaluate_holdout: float = key(lo=0.0, hi=1.0, hi_open=True)  # share of each node's data it evaluates on
    min_nodes: int = key(lo=1, resume=True)
    min_nodes_timeout: float = key(lo=0.0, lo_open=True, hi=MAX_TIMEOUT_S, resume=True)
    outputs_dir: str = key(path=True, empty=DEFAULT_OUTPUTS_DIR, resume=True)
    run_name: str = key(resume=True)
    resume_from: str = key(path=True, resume=True)
    keep_checkpoints: int = key(lo=0, resume=True)
    max_frozen_rounds: int = key(lo=0, resume=True)  # 0 = never judge a run by an unchanged global model
    server: ServerConfig = key()
    dataset: DatasetConfig = key()
    partition: PartitionConfig = key()
    model: ModelConfig = key()
    train: TrainConfig = key()
    strategy: StrategyConfig = key()
    tracking: TrackingConfig = key()
    # Each method's own sections (a method module's SECTIONS, composed by config_loader), in
    # module order, read as attributes: ``cfg.moon``, ``cfg.diffusion``.
    sections: tuple[tuple[str, Any], ...] = field(default=(), metadata=dict(sections=True))

    def __getattr__(self, name: str) -> Any:
        # Reached only when no field has ``name``: a method's section (never while unpickling,
        # when ``sections`` itself is not set yet).
        if name != "sections" and not name.startswith("__"):
            for section, value in self.sections:
                if section == name:
                    return value
        raise AttributeError(f"{type(self).__name__!r} has no field or method section {name!r}")

    def replace(self, **changes: Any) -> Config:
        """``dataclasses.replace`` that also takes a method's section by name (``diffusion=...``)."""
        own = {f.name for f in dataclasses.fields(self)}
        sections = dict(self.sections)
        for name in set(changes) - own:
            if name not in sections:
                raise TypeError(f"Config has no field or method section {name!r}")
            sections[name] = changes.pop(name)
        return dataclasses.replace(self, **changes, sections=tuple(sections.items()))

    @property
    def embedding_dim(self) -> int:
        """Width of the classifier embedding z, which the fused teacher feature must match."""
        return 8 * self.model.width

    def to_flat(self) -> dict[str, Any]:
        """Back to the flat dotted-key form (lists joined by commas); round-trips load_config."""
        return {k: ",".join(map(str, v)) if isinstance(v, tuple) else v for k, v in _flat(self)}


@dataclass(frozen=True)
class NodeConfig:
    """What a node knows about itself (Flower ``node_config``)."""

    partition_id: int | None
    num_partitions: int | None
    data_dir: str  # a node's own image-folder data; "" = use the benchmark partition
    cache_dir: str  # "" = run config / default


@cache
def fields_of(cls: type) -> tuple[tuple[str, dataclasses.Field, Any], ...]:
    # Once per class: get_type_hints was 2/3 of load_config, which every ClientApp message runs.
    hints = get_type_hints(cls)
    return tuple((f.name, f, hints[f.name]) for f in dataclasses.fields(cls))


def key_specs(cls: type, prefix: str = "") -> Iterator[tuple[str, Any, Mapping[str, Any]]]:
    """(dotted key, type, rule) of every key of ``cls`` (a section under ``prefix``), in field
    order; ``Config``'s method sections are the loader's (``config_loader.keys``)."""
    for name, f, typ in fields_of(cls):
        if f.metadata.get("sections"):
            continue
        if dataclasses.is_dataclass(typ):
            yield from key_specs(typ, f"{prefix}{name}.")
        else:
            yield prefix + name.replace("_", "-"), typ, f.metadata


def _flat(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every key of a built config, its method sections last."""
    for name, f, typ in fields_of(type(obj)):
        if f.metadata.get("sections"):
            for section, value in getattr(obj, name):
                yield from _flat(value, f"{section}.")
        elif dataclasses.is_dataclass(typ):
            yield from _flat(getattr(obj, name), f"{prefix}{name}.")
        else:
            yield prefix + name.replace("_", "-"), getattr(obj, name)


def load_node_config(node_config: Mapping[str, Any]) -> NodeConfig:
    """Validate Flower's ``node_config``: partition-id/num-partitions and/or data-dir, cache-dir."""
    known = {"partition-id", "num-partitions", "data-dir", "cache-dir"}
    if unknown := sorted(set(node_config) - known):
        raise ConfigError(f"unknown node config key(s) {unknown}; recognised: {sorted(known)}")
    pid, n = node_config.get("partition-id"), node_config.get("num-partitions")
    pid = None if pid is None else casting.as_int("node partition-id", pid)
    n = None if n is None else casting.as_int("node num-partitions", n)
    data_dir = casting.as_path(
        "node data-dir", casting.as_str("node data-dir", node_config.get("data-dir", "")).strip()
    )
    cache_dir = casting.as_path(
        "node cache-dir", casting.as_str("node cache-dir", node_config.get("cache-dir", "")).strip()
    )
    if n is not None and n < 1:
        raise invalid("node num-partitions", n, "expected an integer >= 1")
    if (pid is None) != (n is None):
        raise ConfigError("node config needs both 'partition-id' and 'num-partitions' (or neither)")
    if pid is not None and not 0 <= pid < n:
        raise invalid("node partition-id", pid, f"expected 0 <= partition-id < num-partitions ({n})")
    if pid is None and not data_dir:
        raise ConfigError(
            "node config needs 'partition-id' and 'num-partitions' (benchmark split) or 'data-dir' "
            f"(the node's own class-per-folder images); got keys {sorted(node_config)} "
            f"(recognised: {sorted(known)})"
        )
    return NodeConfig(partition_id=pid, num_partitions=n, data_dir=data_dir, cache_dir=cache_dir)
