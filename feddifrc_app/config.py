"""Typed run/node configuration, built and validated in one place.

Every default lives once, in ``[tool.flwr.app.config]`` of pyproject.toml; every key,
its type and its range live once, in the dataclasses below (a key is its section and
field name, ``_`` spelled ``-``). Flower does not type-check overrides (``2.5`` can
arrive in an int key, ``"1"`` in a float key), so every key is cast (casting.py) and validated
before any data or model is touched; a rule of one strategy, DP or method lives in its module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cache, reduce
from pathlib import Path
from typing import Any, get_type_hints

from feddifrc_app import casting
from feddifrc_app.casting import (
    FLOAT32_TINY,
    MAX_Q,
    MAX_STEP,
    MAX_TIMEOUT_S,
    MIN_TEMPERATURE,
    ConfigError,
    invalid,
    resolve_path,
)

METHODS = ("fedavg", "feddifrc", "feddifrc-ssl", "moon", "fednh")
DATASETS = ("digits", "mnist-5k", "mnist-5k-pool", "cifar10", "cifar100", "tiny-imagenet", "image-folder")
PARTITIONS = ("iid", "dirichlet", "pathological")
MODELS = ("resnet10",)
STRATEGIES = ("fedavg", "fedavgm", "fedprox", "fedadam", "fedyogi", "fedadagrad", "fedmedian")
STRATEGIES += ("fedtrimmedavg", "krum", "multikrum", "bulyan", "qfedavg", "scaffold", "fednova")
DP_MODES = ("none", "server-fixed", "server-adaptive", "client-fixed", "client-adaptive")
PROJECTIONS = ("federated-pca", "local-pca", "random", "per-batch")
CONDITIONS = ("none", "global-model")
DIT_FEATURES = ("raw", "adaln", "adaln-drop", "adaln-rescale")  # diffusion/dit_features.py
LOSS_VARIANTS = ("paper", "code")
NORMALISERS = ("none", "mean-distance")
NDCR_SPACES = ("unit", "raw")
NDCR_VIEWS = ("clean", "augmented")
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
) -> Any:
    """A config key's rule: allowed names, a range, or a path (``empty`` = the path used for "").

    ``resume=True``: a resumed run may change it (where and how long it runs, not what it
    computes); every other key must match the run's own config.json."""
    return field(
        metadata=dict(
            choices=choices, range=(lo, hi, lo_open, hi_open), path=path, empty=empty, resume=resume
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
class DiffusionConfig:
    model: str = key()  # "tiny-mnist", "tiny", a hub id, or a local folder (made absolute)
    resolution: int = key(lo=8, hi=1024)
    timestep: int = key(lo=0, hi=999)
    blocks: tuple[int, ...] = key()  # -1 = the UNet's mid-block (family.MID_BLOCK)
    pooling: str = key(choices=("mean", "grid"))
    pool_grid: int = key(lo=1, hi=16)  # g of pooling = "grid": a g x g grid of each map, C g^2 features
    dit_features: str = key(choices=DIT_FEATURES)  # pixart / sd3: raw block outputs or AdaLN-normalised
    channels: tuple[int, ...] = key()
    ensemble: int = key(lo=1, hi=64)
    # The teacher's noise draws: fixed by default, so runs differing only in `seed` share the
    # feature cache (one extraction per sweep); -1 = the run seed (a draw per seed, extracted per seed).
    noise_seed: int = key(lo=-1)
    projection: str = key(choices=PROJECTIONS)
    # federated-pca's basis from a seeded sample of this many nodes' statistics (0 = every node)
    basis_nodes: int = key(lo=0)
    prompt_template: str = key()
    ndcr_prompt: str = key()
    batch_size: int = key(lo=1, resume=True)
    device: str = key(choices=DEVICES, resume=True)
    dtype: str = key(choices=DTYPES)
    cache_dir: str = key(path=True, resume=True)  # "" = the node's cache-dir (NodeConfig.resolve_cache_dir)
    condition: str = key(choices=CONDITIONS)


@dataclass(frozen=True)
class LossConfig:
    variant: str = key(choices=LOSS_VARIANTS)
    tdcl_weight: float = key(lo=0.0)
    ndcr_weight: float = key(lo=0.0)
    temperature: float = key(lo=MIN_TEMPERATURE)  # below it the logits overflow (casting.py)
    num_negatives: int = key(lo=0)
    tdcl_normaliser: str = key(choices=NORMALISERS)
    tdcl_targets: str = key(choices=("image", "anchors"))  # anchors: the class-prompt means (rules.py)
    ndcr_space: str = key(choices=NDCR_SPACES)
    ndcr_view: str = key(choices=NDCR_VIEWS)  # which view NDCR aligns: the student's or the target's


@dataclass(frozen=True)
class SSLConfig:
    positive_prompt: str = key()
    ndcr_prompt: str = key()
    negatives: tuple[str, ...] = key()  # () = built-in Tiny-ImageNet class names
    num_negatives: int = key(lo=1)
    probe_epochs: int = key(lo=1)


@dataclass(frozen=True)
class MoonConfig:
    mu: float = key(lo=0.0)  # weight of the model-contrastive term (MOON: 5 for CIFAR-10, 1 otherwise)
    tau: float = key(lo=MIN_TEMPERATURE)  # its temperature (MOON: 0.5); MIN_TEMPERATURE: casting.py


@dataclass(frozen=True)
class FedNHConfig:
    rho: float = key(lo=0.0, hi=1.0)  # prototype smoothing (FedNH: 0.9)
    scale: float = key(lo=0.0, lo_open=True)  # initial learnable logit scale (FedNH's ResNet: 20, CNN: 1)
    max_grad_norm: float = key(lo=0.0)  # local gradient clipping (FedNH's code: 10); 0 = none


@dataclass(frozen=True)
class TrackingConfig:  # tracking.py: the server streams rows and config; never what a run computes
    backend: str = key(choices=("none", "tensorboard", "mlflow", "wandb"), resume=True)
    dir: str = key(path=True, resume=True)  # "" = the run folder
    project: str = key(resume=True)  # MLflow's experiment, W&B's project
    tags: tuple[str, ...] = key(resume=True)  # "name:value" or "name"; a sweep adds its cell's


@dataclass(frozen=True)
class Config:
    method: str = key(choices=METHODS)
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
    diffusion: DiffusionConfig = key()
    loss: LossConfig = key()
    ssl: SSLConfig = key()
    moon: MoonConfig = key()
    fednh: FedNHConfig = key()
    tracking: TrackingConfig = key()

    @property
    def embedding_dim(self) -> int:
        """Width of the classifier embedding z, which the fused teacher feature must match."""
        return 8 * self.model.width

    @property
    def uses_diffusion(self) -> bool:
        return self.method in ("feddifrc", "feddifrc-ssl")

    @property
    def self_supervised(self) -> bool:
        """FedDifRC without labels: a positive prompt and negatives instead of class prompts."""
        return self.method == "feddifrc-ssl"

    def to_flat(self) -> dict[str, Any]:
        """Back to the flat dotted-key form (lists joined by commas); round-trips load_config."""
        flat = {k: reduce(getattr, k.replace("-", "_").split("."), self) for k in KEYS}
        return {k: ",".join(map(str, v)) if isinstance(v, tuple) else v for k, v in flat.items()}


@dataclass(frozen=True)
class NodeConfig:
    """What a node knows about itself (Flower ``node_config``)."""

    partition_id: int | None
    num_partitions: int | None
    data_dir: str  # a node's own image-folder data; "" = use the benchmark partition
    cache_dir: str  # "" = run config / default

    def resolve_cache_dir(self, cfg: Config) -> Path:
        return resolve_cache_dir(cfg, self.cache_dir, "node cache-dir")


def resolve_cache_dir(cfg: Config, override: str | None, name: str = "--cache-dir") -> Path:
    """The teacher cache folder: ``override`` (a node's cache-dir, or ``feddifrc --cache-dir``,
    named ``name`` in an error) wins, then the run config's diffusion.cache-dir, then ~/.cache/feddifrc."""
    if override:
        return resolve_path(override, name)
    return resolve_path(cfg.diffusion.cache_dir or DEFAULT_CACHE_DIR, "diffusion.cache-dir")


@cache
def _fields(cls: type) -> tuple[tuple[str, dataclasses.Field, Any], ...]:
    # Once per class: get_type_hints was 2/3 of load_config, which every ClientApp message runs.
    hints = get_type_hints(cls)
    return tuple((f.name, f, hints[f.name]) for f in dataclasses.fields(cls))


def _key_specs(cls: type = Config, prefix: str = "") -> Iterator[tuple[str, Any, Mapping[str, Any]]]:
    """(dotted key, type, rule) of every key, in pyproject order."""
    for name, f, typ in _fields(cls):
        if dataclasses.is_dataclass(typ):
            yield from _key_specs(typ, f"{prefix}{name}.")
        else:
            yield prefix + name.replace("_", "-"), typ, f.metadata


KEYS: dict[str, tuple[Any, Mapping[str, Any]]] = {k: (t, m) for k, t, m in _key_specs()}
# The keys marked ``resume=True`` above: what a resumed run may change.
RESUME_MAY_CHANGE = frozenset(k for k, (_, rule) in KEYS.items() if rule["resume"])


# --------------------------------------------------------------------------- building


def _cast(key: str, raw: Any, typ: Any, rule: Mapping[str, Any]) -> Any:
    if typ is bool:
        return casting.as_bool(key, raw)
    if typ in (int, float):
        v = casting.as_int(key, raw) if typ is int else casting.as_float(key, raw)
        casting.check_range(key, v, *casting.bounds(typ, rule["range"]))
        return v
    if typ == tuple[int, ...]:
        return casting.int_list(key, raw)
    s = casting.as_str(key, raw)
    if typ == tuple[str, ...]:
        return tuple(p.strip() for p in s.split(",") if p.strip())
    if rule["choices"]:
        if s.strip().lower() not in rule["choices"]:
            raise invalid(key, raw, f"expected one of {', '.join(rule['choices'])}")
        return s.strip().lower()
    if rule["path"]:  # every path key is a folder (written into, or a run directory)
        return casting.as_folder(key, raw, s.strip() or rule["empty"])
    return s


def _build(cls: type, values: Mapping[str, Any], prefix: str = "") -> Any:
    kwargs = {}
    for name, _, typ in _fields(cls):
        dotted = prefix + name.replace("_", "-")
        kwargs[name] = _build(typ, values, dotted + ".") if dataclasses.is_dataclass(typ) else values[dotted]
    return cls(**kwargs)


# --------------------------------------------------------------------------- loading


def load_config(run_config: Mapping[str, Any]) -> Config:
    """Cast and validate a flat Flower run config into a frozen ``Config``.

    Raises ``ConfigError`` naming the key, the value and what is allowed, for unknown
    keys, missing keys, bad types, out-of-range values, bad names and cross-key rules.
    """
    unknown = sorted(set(run_config) - set(KEYS))
    if unknown:
        raise ConfigError(
            f"unknown config key(s) {', '.join(casting.did_you_mean(k, KEYS) for k in unknown)}; "
            "valid keys are listed in [tool.flwr.app.config] of pyproject.toml"
        )
    missing = [k for k in KEYS if k not in run_config]
    if missing:
        raise ConfigError(f"missing config key(s) {', '.join(map(repr, missing))}")
    values = {k: _cast(k, run_config[k], typ, rule) for k, (typ, rule) in KEYS.items()}
    values["run-name"] = values["run-name"].strip()
    model = values["diffusion.model"].strip()
    if model.startswith(("~", "/", ".")):  # a local folder, not a hub id
        model = casting.as_path("diffusion.model", model)
    values["diffusion.model"] = model
    _check_rules(values, run_config)
    return _build(Config, values)


def _check_rules(v: Mapping[str, Any], raw: Mapping[str, Any]) -> None:
    """Rules that span keys, in the order they always ran: each method's (``methods.hooks``),
    the strategies' and DP's live in their modules."""
    from feddifrc_app import methods, strategy_rules

    for check in methods.hooks("check_inputs"):
        check(v, raw)
    _check_data(v, raw)
    strategy_rules.check_config(v)  # the strategy's, then DP's
    for check in methods.hooks("check_config"):
        check(v, raw)
    if v["resume-from"] and (node_state := _node_state(v)):
        # Context.state lives in the SuperNode of one Flower run; a resumed run starts without it.
        raise invalid(
            "resume-from", v["resume-from"], f"{node_state} keeps per-node state that a new run lacks"
        )
    _check_evaluation(v)


def _check_data(v: Mapping[str, Any], raw: Mapping[str, Any]) -> None:
    """dataset.*, train.batch-size and run-name: inputs every node and the server can use."""
    if v["train.batch-size"] == 1 and last_stage_size(v["dataset.image-size"]) == 1:
        # Training BatchNorm needs more than one value per channel: 1 image x 1x1 pixel fails
        # every step on every node, so refuse it before any work.
        raise ConfigError(
            f"config keys 'train.batch-size' = 1 and 'dataset.image-size' = {v['dataset.image-size']}: "
            "ResNet-10's last stage is 1x1 at this size, so a batch of one image gives BatchNorm one "
            "value per channel and every training step fails; use train.batch-size >= 2 or "
            "dataset.image-size >= 9"
        )
    name = v["run-name"]
    if name.startswith(".") or any(c in name for c in "/\\") or not name.isprintable():
        # <outputs-dir>/<run-name>: a path would write elsewhere, a newline or U+202E disguise it.
        why = "expected a plain folder name (no '/', '\\', control or bidi characters; no leading '.')"
        raise invalid("run-name", name, why)
    if 0 < (fraction := v["dataset.val-fraction"]) < 0.01:  # 3e-4 of digits' 1,438 images is 0
        why = "expected 0 (no validation) or 0.01 to 0.5: a smaller share holds out few or no images"
        raise invalid("dataset.val-fraction", fraction, why)
    if v["dataset.name"] == "image-folder" and not raw["dataset.data-dir"].strip():
        raise invalid("dataset.data-dir", "", "dataset 'image-folder' needs a class-per-folder root")
    if v["dataset.classes"] and (v["dataset.name"] != "image-folder" or len(set(v["dataset.classes"])) < 2):
        why = "expected 2 or more distinct class folder names, with dataset.name = 'image-folder'"
        raise invalid("dataset.classes", raw["dataset.classes"], why)


def _check_evaluation(v: Mapping[str, Any]) -> None:
    """Federated evaluation needs held-out data on the nodes, and held-out data needs evaluation."""
    fraction, holdout = v["fraction-evaluate"], v["evaluate-holdout"]
    if fraction > 0 and holdout == 0:
        raise invalid(
            "evaluate-holdout",
            holdout,
            f"fraction-evaluate = {fraction:g} asks nodes to evaluate on a held-out part of their data: "
            "set evaluate-holdout to its share, e.g. 0.1",
        )
    if holdout > 0 and fraction == 0:
        raise invalid(
            "evaluate-holdout",
            holdout,
            "holds out training data that no node evaluates on (fraction-evaluate = 0); set "
            "fraction-evaluate > 0 or evaluate-holdout = 0",
        )


def _node_state(v: Mapping[str, Any]) -> str:
    """Which setting keeps state on the nodes across rounds ("" = none): resume cannot restore it."""
    from feddifrc_app import methods  # (as in _check_rules)

    kept = [s for hook in methods.hooks("node_state") if (s := hook(v))]
    kept.sort(key=lambda s: not s.startswith("strategy."))  # the strategy's named first, as always
    kept += ["train.keep-momentum = true"] if v["train.keep-momentum"] else []
    return kept[0] if kept else ""


def resumable(cfg: Config) -> bool:
    return not _node_state(cfg.to_flat())


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
