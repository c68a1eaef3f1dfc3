"""The run config's rules for ``strategy.*``: the aggregation's (Krum / MultiKrum / Bulyan's
Byzantine bound) and ``strategy.dp``'s, with each method's ``dp_refusal`` (passed in by the loader); and
the keys behind a strategy's aggregate, as an error names them (``strategy_settings``).

No Flower here: ``config_loader.load_config`` runs these rules, and it runs where Flower is not
installed (a bare GPU host's check, benchmarks/gpu_check.py). The strategies themselves are
built in strategy.py and privacy.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from feddifrc_app.casting import ConfigError, invalid

if TYPE_CHECKING:
    from feddifrc_app.config import Config

# Why a method whose replies carry more than the model cannot run under DP (its dp_refusal).
TWO_RECORDS = "replies with a second ArrayRecord, which Flower's DP cannot clip"


def sampled_per_round(fraction: float, num_nodes: int) -> int:
    """Nodes sampled per round: ``fraction`` (``fraction-train``, or ``fraction-evaluate``) of the
    connected nodes, at least 1."""
    return max(1, int(math.floor(num_nodes * fraction + 1e-9)))


def robust_aggregation_error(name: str, f: int, m: int, sampled: int) -> str:
    """Why ``sampled`` nodes per round are too few for Krum / MultiKrum / Bulyan with ``f`` =
    strategy.num-malicious-nodes and ``m`` = strategy.num-nodes-to-select ("" = enough).

    Krum and MultiKrum tolerate f Byzantine nodes among n when n > 2f + 2 (Blanchard et al.,
    2017; with f = 0 they are a selection rule, any n); MultiKrum averages m <= n - f of them.
    Bulyan needs n >= 4f + 3 (El Mhamdi et al., 2018): Flower's Bulyan skips aggregation below.
    """
    tolerate = f"strategy '{name}' with strategy.num-malicious-nodes = {f} needs at least"
    if name in ("krum", "multikrum") and f > 0 and sampled < 2 * f + 3:
        return f"{tolerate} 2 * {f} + 3 = {2 * f + 3} nodes per round"
    if name == "multikrum" and m > sampled - f:
        return (
            f"strategy 'multikrum' averages strategy.num-nodes-to-select = {m} updates, at most the "
            f"sampled nodes minus strategy.num-malicious-nodes ({sampled} - {f} = {sampled - f})"
        )
    if name == "bulyan" and sampled < 4 * f + 3:
        return f"{tolerate} 4 * {f} + 3 = {4 * f + 3} nodes per round"
    return ""


def check_config(v: Mapping[str, Any], dp_refusals: Sequence[Callable[[Mapping[str, Any]], str]]) -> None:
    """config_loader.load_config's rules for the strategy, then for strategy.dp; ``dp_refusals``:
    the methods' ``dp_refusal`` hooks (the loader passes them: this module imports no method)."""
    check_robust(v)
    check_dp(v, dp_refusals)


def check_robust(v: Mapping[str, Any]) -> None:
    """Krum / MultiKrum / Bulyan against the nodes a round samples once min-nodes are connected
    (the ServerApp waits for them); the nodes really sampled are checked again every round
    (strategy.RobustBound)."""
    sampled = sampled_per_round(v["fraction-train"], v["min-nodes"])
    why = robust_aggregation_error(
        v["strategy.name"], v["strategy.num-malicious-nodes"], v["strategy.num-nodes-to-select"], sampled
    )
    if why:
        raise ConfigError(
            f"config keys 'strategy.num-malicious-nodes' / 'strategy.num-nodes-to-select': {why}, but "
            f"min-nodes = {v['min-nodes']} with fraction-train = {v['fraction-train']:g} samples {sampled}; "
            "lower them, or raise min-nodes (the SuperNodes you start) and fraction-train"
        )


def check_dp(v: Mapping[str, Any], dp_refusals: Sequence[Callable[[Mapping[str, Any]], str]]) -> None:
    """strategy.dp with what Flower's wrappers and client mods can handle: each method's
    ``dp_refusal`` (why it cannot be wrapped, "" = it can), then adaptive clipping's count noise."""
    dp = v["strategy.dp"]
    if dp == "none":
        return
    for refusal in dp_refusals:
        if why := refusal(v):
            raise invalid("strategy.dp", dp, why)
    given, z = v["strategy.dp-clipped-count-stddev"], v["strategy.dp-noise-multiplier"]
    if dp.endswith("adaptive") and given > (
        most := 100 * sampled_per_round(v["fraction-train"], v["min-nodes"])
    ):
        # The noisy clipped fraction is (count + N(0, s)) / m: at s far above m it is noise alone,
        # and Flower's exp(-lr (fraction - target)) overflows.
        raise invalid(
            "strategy.dp-clipped-count-stddev",
            given,
            f"at most 100 x the nodes a round samples (min-nodes x fraction-train: {most // 100}), "
            "or 0 to derive it",
        )
    if dp.endswith("adaptive") and given and z >= 2 * given:  # 0 derives a value that works
        raise ConfigError(
            f"config keys 'strategy.dp-noise-multiplier' = {z:g} and "
            f"'strategy.dp-clipped-count-stddev' = {given:g}: adaptive clipping needs the noise "
            f"multiplier below 2 x that count noise ({2 * given:g}); raise "
            "strategy.dp-clipped-count-stddev (0 derives one) or lower strategy.dp-noise-multiplier"
        )


# The strategy.* keys that shape each strategy's aggregate, and DP's by kind of clipping: what an
# error names when the server's aggregate (not a node's training) went wrong.
STRATEGY_KEYS = {
    "fedavgm": ("server-learning-rate", "server-momentum"),
    "fedprox": ("proximal-mu",),
    "fedadam": ("eta", "eta-l", "tau", "beta-1", "beta-2"),
    "fedyogi": ("eta", "eta-l", "tau", "beta-1", "beta-2"),
    "fedadagrad": ("eta", "eta-l", "tau"),
    "fedtrimmedavg": ("trim-beta",),
    "krum": ("num-malicious-nodes",),
    "multikrum": ("num-malicious-nodes", "num-nodes-to-select"),
    "bulyan": ("num-malicious-nodes",),
    "qfedavg": ("q",),
}  # a strategy a method brings: its package's STRATEGIES (methods.strategy_keys)
DP_KEYS = {
    "fixed": ("dp-noise-multiplier", "dp-clipping-norm"),
    "adaptive": (
        "dp-noise-multiplier",
        "dp-initial-clipping-norm",
        "dp-target-clipped-quantile",
        "dp-clip-norm-lr",
        "dp-clipped-count-stddev",
    ),
}


def strategy_settings(cfg: Config, brought: Mapping[str, Sequence[str]]) -> str:
    """The keys behind the server's aggregate, with their values:
    ``strategy.name = 'qfedavg', strategy.q = 15.0`` (and strategy.dp's keys under DP).
    ``brought``: the methods' strategies' keys (``methods.strategy_keys()``)."""
    s = cfg.strategy
    names = ["name", *{**STRATEGY_KEYS, **brought}.get(s.name, ())]
    if s.dp != "none":
        names += ["dp", *DP_KEYS[s.dp.split("-")[1]]]
    flat = cfg.to_flat()
    return ", ".join(f"strategy.{n} = {flat[f'strategy.{n}']!r}" for n in names)
