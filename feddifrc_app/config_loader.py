"""A flat Flower run config -> the typed ``Config`` (config.py), every key cast and every rule run.

Flower does not type-check overrides (``2.5`` can arrive in an int key, ``"1"`` in a float key),
so every key is cast (casting.py) and checked before any data or model is touched. The rules
that span keys run in a fixed order: each method's inputs (``methods.hooks``), the data's, the
strategy's and DP's (strategy_rules.py), each method's own, then resume and evaluation. This
module sits above ``methods/`` and ``strategy_rules``: the keys themselves (config.py) import
neither, so a method can read its ``Config`` without a loop back here.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from typing import Any

from feddifrc_app import casting, methods, strategy_rules
from feddifrc_app.casting import ConfigError, invalid
from feddifrc_app.config import STRATEGIES, Config, fields_of, key_specs, last_stage_size

BASE_METHOD = "fedavg"  # CE alone, under the run's strategy: no method module


@functools.cache
def keys() -> dict[str, tuple[Any, Mapping[str, Any]]]:
    """(type, rule) of every key: ``Config``'s in field order, then each method module's sections
    (``SECTIONS``) in module order; ``method`` takes "fedavg" or a module's ``NAMES``,
    ``strategy.name`` Flower's strategies or one a module brings (``strategy_names``)."""
    found = {k: (t, m) for k, t, m in key_specs(Config)}
    typ, rule = found["method"]
    found["method"] = (typ, {**rule, "choices": (BASE_METHOD, *methods.names())})
    typ, rule = found["strategy.name"]
    found["strategy.name"] = (typ, {**rule, "choices": strategy_names()})
    for name, cls in methods.sections().items():
        found.update((k, (t, m)) for k, t, m in key_specs(cls, f"{name}."))
    return found


def strategy_names() -> tuple[str, ...]:
    """What ``strategy.name`` accepts: Flower's strategies (config.STRATEGIES), then the methods'."""
    return (*STRATEGIES, *methods.strategy_keys())


@functools.cache
def resume_may_change() -> frozenset[str]:
    """The keys marked ``resume=True``: what a resumed run may change."""
    return frozenset(k for k, (_, rule) in keys().items() if rule["resume"])


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
    return rule["cast"](key, s) if rule["cast"] else s


def _build(cls: type, values: Mapping[str, Any], prefix: str = "") -> Any:
    kwargs = {}
    for name, f, typ in fields_of(cls):
        dotted = prefix + name.replace("_", "-")
        if f.metadata.get("sections"):
            kwargs[name] = tuple((n, _build(c, values, f"{n}.")) for n, c in methods.sections().items())
        elif dataclasses.is_dataclass(typ):
            kwargs[name] = _build(typ, values, dotted + ".")
        else:
            kwargs[name] = values[dotted]
    return cls(**kwargs)


# --------------------------------------------------------------------------- loading


def load_config(run_config: Mapping[str, Any]) -> Config:
    """Cast and validate a flat Flower run config into a frozen ``Config``.

    Raises ``ConfigError`` naming the key, the value and what is allowed, for unknown
    keys, missing keys, bad types, out-of-range values, bad names and cross-key rules.
    """
    known = keys()
    unknown = sorted(set(run_config) - set(known))
    if unknown:
        raise ConfigError(
            f"unknown config key(s) {', '.join(casting.did_you_mean(k, known) for k in unknown)}; "
            "valid keys are listed in [tool.flwr.app.config] of pyproject.toml"
        )
    missing = [k for k in known if k not in run_config]
    if missing:
        raise ConfigError(f"missing config key(s) {', '.join(map(repr, missing))}")
    values = {k: _cast(k, run_config[k], typ, rule) for k, (typ, rule) in known.items()}
    values["run-name"] = values["run-name"].strip()
    _check_rules(values, run_config)
    return _build(Config, values)


def process_config(run_config: Mapping[str, Any]) -> Config:
    """``load_config`` once per process per run config (a simulation actor serves thousands of
    messages of one run: casting and checking every key cost half a setup reply). Keyed by the
    whole run config, each value with its type, and the home folder (``~`` in a path key); a
    path key's symlinks are followed once per process and run config, as the ServerApp follows
    them once per run. A config that fails is not kept: every message is refused again."""
    return _process_config(_config_key(run_config), os.path.expanduser("~"))


def _config_key(run_config: Mapping[str, Any]) -> tuple[tuple[str, str, Any], ...]:
    # Each value with its type's name: True == 1 == 1.0 as dict keys, not as config values.
    return tuple(sorted((k, type(v).__name__, v) for k, v in run_config.items()))


@functools.lru_cache(maxsize=4)
def _process_config(key: tuple[tuple[str, str, Any], ...], home: str) -> Config:
    return load_config({k: v for k, _, v in key})


def _check_rules(v: Mapping[str, Any], raw: Mapping[str, Any]) -> None:
    """Rules that span keys, in the order they always ran: each method's (``methods.hooks``),
    the strategies' and DP's live in their modules."""
    for check in methods.hooks("check_inputs"):
        check(v, raw)
    _check_data(v, raw)
    strategy_rules.check_config(v, methods.hooks("dp_refusal"))  # the strategy's, then DP's
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
    kept = [s for hook in methods.hooks("node_state") if (s := hook(v))]
    kept.sort(key=lambda s: not s.startswith("strategy."))  # the strategy's named first, as always
    kept += ["train.keep-momentum = true"] if v["train.keep-momentum"] else []
    return kept[0] if kept else ""


def resumable(cfg: Config) -> bool:
    return not _node_state(cfg.to_flat())
