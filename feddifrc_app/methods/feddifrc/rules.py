"""FedDifRC's config: its sections (``diffusion.*``: the teacher; ``loss.*``: TDCL and NDCR;
``ssl.*``: the self-supervised variant) and its rules: the teacher's layers, model and prompt, the
loss variant, and what the self-supervised variant cannot do (run by ``config_loader.load_config``
through ``methods.hooks``).

The diffusion.* rules hold whatever the method: every run's config names a teacher, and the
keys are checked where they are defined, before any work.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from feddifrc_app import casting
from feddifrc_app.casting import MIN_TEMPERATURE, ConfigError, invalid, resolve_path
from feddifrc_app.config import DEFAULT_CACHE_DIR, DEVICES, DTYPES, key
from feddifrc_app.diffusion.dit_features import MODES as DIT_FEATURES

if TYPE_CHECKING:
    from feddifrc_app.config import Config

NAMES = ("feddifrc", "feddifrc-ssl")  # the method values of this package
PROJECTIONS = ("federated-pca", "local-pca", "random", "per-batch")
CONDITIONS = ("none", "global-model")
LOSS_VARIANTS = ("paper", "code")
NORMALISERS = ("none", "mean-distance")
NDCR_SPACES = ("unit", "raw")
NDCR_VIEWS = ("clean", "augmented")


def hub_id_or_folder(name: str, text: str) -> str:
    """A teacher: a hub id as given, or a local folder (``~``, ``/``, ``.``) made absolute."""
    text = text.strip()
    return casting.as_path(name, text) if text.startswith(("~", "/", ".")) else text


@dataclass(frozen=True)
class DiffusionConfig:
    model: str = key(cast=hub_id_or_folder)  # "tiny-mnist", "tiny", a hub id, or a local folder
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
    cache_dir: str = key(path=True, resume=True)  # "" = the node's cache-dir (resolve_cache_dir)
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


SECTIONS = {"diffusion": DiffusionConfig, "loss": LossConfig, "ssl": SSLConfig}


def uses_diffusion(cfg: Config) -> bool:
    """The run trains with the teacher (FedDifRC or its self-supervised variant)."""
    return cfg.method in NAMES


def self_supervised(cfg: Config) -> bool:
    """FedDifRC without labels: a positive prompt and negatives instead of class prompts."""
    return cfg.method == "feddifrc-ssl"


def resolve_cache_dir(cfg: Config, override: str | None, name: str = "--cache-dir") -> Path:
    """The teacher cache folder: ``override`` (a node's cache-dir, or ``feddifrc --cache-dir``,
    named ``name`` in an error) wins, then the run config's diffusion.cache-dir, then ~/.cache/feddifrc."""
    if override:
        return resolve_path(override, name)
    return resolve_path(cfg.diffusion.cache_dir or DEFAULT_CACHE_DIR, "diffusion.cache-dir")


def check_inputs(v: Mapping[str, Any], raw: Mapping[str, Any]) -> None:
    """The teacher's keys (``v``: cast values; ``raw``: as given): checked before any other rule."""
    _check_layers(v, raw)
    _check_teacher(v)


def check_config(v: Mapping[str, Any], raw: Mapping[str, Any]) -> None:
    """FedDifRC's loss and self-supervised keys that cannot work together."""
    if v["loss.variant"] == "code" and (v["loss.num-negatives"] != 0 or v["loss.tdcl-normaliser"] != "none"):
        raise ConfigError(
            "config key 'loss.variant' = 'code' reproduces the public code, which has neither sampled "
            "negatives nor a normaliser: set 'loss.num-negatives' = 0 and 'loss.tdcl-normaliser' = 'none'"
        )
    _check_anchors(v)
    if v["diffusion.basis-nodes"] > 0 and v["diffusion.projection"] != "federated-pca":
        projection = v["diffusion.projection"]
        why = f"samples the nodes of the federated basis; diffusion.projection = {projection!r} fits none"
        raise invalid("diffusion.basis-nodes", v["diffusion.basis-nodes"], why)
    if v["method"] == "feddifrc-ssl" and (fraction := v["fraction-evaluate"]) > 0:
        raise invalid(
            "fraction-evaluate",
            fraction,
            "method 'feddifrc-ssl' trains no classifier for the nodes to score (the server evaluates "
            "it with a linear probe): use fraction-evaluate = 0",
        )


def _check_layers(v: Mapping[str, Any], raw: Mapping[str, Any]) -> None:
    """diffusion.blocks and .channels: distinct layers whose widths fuse into the student's embedding."""
    blocks, channels, width = v["diffusion.blocks"], v["diffusion.channels"], v["model.width"]
    if len(blocks) != len(channels):
        raise ConfigError(
            f"config keys 'diffusion.blocks' = {raw['diffusion.blocks']!r} and "
            f"'diffusion.channels' = {raw['diffusion.channels']!r} must have the same length"
        )
    if len(set(blocks)) != len(blocks) or any(b < -1 for b in blocks):  # -1: the UNet's mid-block
        # the upper bound is the model's (4 up_blocks for SD 1.x/2.x, 3 for SDXL, the number of
        # transformer blocks for PixArt/SD3): checked against its config when the teacher is resolved
        raise invalid(
            "diffusion.blocks",
            raw["diffusion.blocks"],
            "expected distinct layer indices (SD: unet.up_blocks 0..3; SDXL: 0..2; -1: their mid-block; "
            "PixArt/SD3: transformer_blocks 0..num_layers-1)",
        )
    if any(c < 1 for c in channels):
        raise invalid("diffusion.channels", raw["diffusion.channels"], "expected positive widths")
    if v["method"] in ("feddifrc", "feddifrc-ssl") and sum(channels) != 8 * width:
        # (the methods without a teacher never read diffusion.*)
        # The fused teacher feature is compared with the ResNet-10 embedding (8 * model.width).
        raise invalid(
            "diffusion.channels",
            raw["diffusion.channels"],
            f"widths must sum to {8 * width}, the ResNet-10 embedding width (8 * model.width = 8 * {width})",
        )


def _check_teacher(v: Mapping[str, Any]) -> None:
    """diffusion.*: a model, a prompt template every node can fill, a basis to condition on."""
    if not v["diffusion.model"]:
        raise invalid("diffusion.model", "", "expected 'tiny-mnist', 'tiny', a hub id or a local folder")
    if "{}" not in v["diffusion.prompt-template"]:
        raise invalid(
            "diffusion.prompt-template",
            v["diffusion.prompt-template"],
            "must contain '{}' where the class name goes",
        )
    try:  # what teacher_prompts does with it on every node
        v["diffusion.prompt-template"].format("class name")
    except (IndexError, KeyError, ValueError) as e:
        raise invalid(
            "diffusion.prompt-template",
            v["diffusion.prompt-template"],
            f"str.format(class_name) fails ({type(e).__name__}: {e}); use exactly one '{{}}' "
            "and write a literal brace as '{{' or '}}'",
        ) from None
    if v["diffusion.condition"] == "global-model" and v["diffusion.projection"] == "per-batch":
        raise invalid(
            "diffusion.condition",
            "global-model",
            "needs a shared basis (not diffusion.projection = 'per-batch')",
        )


def _check_anchors(v: Mapping[str, Any]) -> None:
    """loss.tdcl-targets = 'anchors' is exact only with one basis for every node (federated-pca:
    the mean of fused rows is the fused mean of the nodes' sums; local-pca has one per node,
    per-batch one per batch) and static class-prompt targets."""
    if v["loss.tdcl-targets"] != "anchors":
        return
    why = None
    if v["method"] != "feddifrc":
        why = f"replaces the class-prompt targets of method 'feddifrc' (not {v['method']!r})"
    elif (projection := v["diffusion.projection"]) != "federated-pca":
        why = f"needs diffusion.projection = 'federated-pca', one basis for all nodes (not {projection!r})"
    elif v["diffusion.condition"] != "none":
        why = (
            "replaces the per-image targets that diffusion.condition = 'global-model' recomputes: use 'none'"
        )
    elif v["loss.tdcl-weight"] == 0:
        why = "replaces TDCL's targets, but loss.tdcl-weight = 0 turns TDCL off"
    if why:
        raise invalid("loss.tdcl-targets", "anchors", why)
