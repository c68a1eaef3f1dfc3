"""Differential privacy by ``strategy.dp``: Flower 1.42's wrappers around any strategy, both halves.

- ``server-fixed`` / ``server-adaptive``: ``DifferentialPrivacyServerSide{Fixed,Adaptive}Clipping``
  clip each reply's update ``y_i - x`` on the server, then add Gaussian noise of std
  ``noise-multiplier * clipping-norm / sampled nodes`` to the aggregate.
- ``client-fixed`` / ``client-adaptive``: ``DifferentialPrivacyClientSide{Fixed,Adaptive}Clipping``
  send ``clipping_norm`` in the train message; the node clips its own update with Flower's
  ``fixedclipping_mod`` / ``adaptiveclipping_mod`` (``client_mod``: only for a train message
  that carries the key) and the server adds the noise.

Adaptive clipping (Andrew et al., 2021) moves the clipping norm towards the
``dp-target-clipped-quantile`` of the update norms. Flower calibrates the noise to a fixed
number of sampled nodes; here it is set every round to the nodes really sampled
(``fraction-train`` of the connected ones). Flower's noise is calibrated to the plain mean of
the clipped updates, so under DP every reply weighs the same: the wrapper stamps
``WEIGHT = 1`` on each train reply (the server's, not a node's, word) and the named strategy
weighs by that key instead of ``num-examples`` (strategy._common). Each round's release (N, m,
replies, noise) is kept for the accountant (privacy_accounting.py). Two of Flower's choices are
changed so that the release is what the accountant assumes: the server optimisers (FedAvgM,
FedOpt) step on the noisy mean (NoisyMean) instead of having the noise added after their step,
and the adaptive modes scale the noise by the norm the round clipped to (_AdaptivePerRound).
What ``strategy.dp`` may be combined with is checked at config load (strategy_rules.check_dp).
"""

from __future__ import annotations

import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType
from flwr.clientapp.mod import adaptiveclipping_mod, fixedclipping_mod
from flwr.clientapp.typing import ClientAppCallable
from flwr.serverapp import Grid
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
    FedAvg,
    Strategy,
)
from flwr.supercore.differential_privacy import (
    KEY_CLIPPING_NORM,
    KEY_NORM_BIT,
    add_gaussian_noise_inplace,
    compute_adaptive_noise_params,
    compute_stdv,
)

from feddifrc_app import log, methods
from feddifrc_app.config import Config, ConfigError
from feddifrc_app.config_loader import process_config
from feddifrc_app.federation import POPULATION
from feddifrc_app.metric_keys import METRICS
from feddifrc_app.records import MODEL
from feddifrc_app.strategy_rules import sampled_per_round, strategy_settings

# The reply metric the named strategy weighs by under DP, set by the server (never a node's
# word): 1.0 on every train reply, so the model is the plain mean Flower's noise is calibrated
# to; an evaluate reply's num-examples, so the federated accuracy stays example-weighted.
WEIGHT = "dp-aggregation-weight"


def clipped_count_stddev(given: float, noise_multiplier: float, sampled: int) -> float:
    """strategy.dp-clipped-count-stddev as used: the value given, or for 0 Flower's default (sampled
    nodes / 20) raised to the noise multiplier where it is below it. Flower needs the multiplier
    below twice the count noise; at equal values the update keeps z x 1.15 (z_u = (z^-2 -
    (2 s)^-2)^-1/2), where Flower's default refused every adaptive run of at most 10 nodes at z = 1.
    Without noise (z = 0) the count is not noised either, as in Flower."""
    if given or noise_multiplier == 0:
        return given
    return max(sampled / 20, noise_multiplier)


class DPError(ArithmeticError):
    """Flower's clipping arithmetic failed (a zero update's norm, an overflowing clipping-norm step)."""


def _flower_dp_failure(e: BaseException, where: str, cfg: Config) -> DPError | None:
    """``e`` as a DPError naming the DP keys if Flower's DP code raised it, else None (not ours to
    rename: an error of the ClientApp itself passes through the mod unchanged)."""
    frames = traceback.extract_tb(e.__traceback__)
    last = Path(frames[-1].filename) if frames else Path()
    # flwr/supercore/differential_privacy.py (clipping), flwr/serverapp/strategy/dp_*.py (norm steps)
    if "flwr" not in last.parts or not (last.stem == "differential_privacy" or last.stem.startswith("dp_")):
        return None
    keys = strategy_settings(cfg, methods.strategy_keys())
    return DPError(
        f"{where}: Flower's differential privacy failed ({type(e).__name__}: {e}), e.g. an update of "
        f"norm 0 or a clipping norm out of float range; check {keys}"
    )


@dataclass(frozen=True)
class Release:
    """One round's noisy release as Flower's wrapper made it (privacy_accounting accounts it)."""

    population: int  # N: the connected nodes the round sampled from
    sampled: int  # m: the noise std is z C / m
    aggregated: int  # m': the replies averaged (fewer than m when a node failed)
    update_multiplier: float  # z on the update; adaptive: after Flower's split (z_u)
    count_stddev: float | None  # adaptive: std of the clipped-count noise; None for fixed clipping


# Strategies that take a server optimiser step on the mean (strategy._stepping builds them with
# NoisyMean under DP, so the noise lands on the mean, before the step).
SERVER_STEP = ("fedavgm", "fedadam", "fedyogi", "fedadagrad")


class NoisyMean(FedAvg):
    """FedAvg's mean plus the DP noise, BEFORE a server optimiser (FedAvgM, FedOpt) steps on it.

    Flower's wrappers add the noise to what the strategy returns, after the step, so FedAvgM's
    momentum and FedOpt's moments keep the noiseless mean and every later release depends on it.
    With the noise here they only ever see the noisy mean, and the released model is
    post-processing of it (DP-FedAvg with a server optimiser). ``noise_std``: set every round by
    the wrapper (Accounted), which then adds none itself."""

    noise_std: float | None = None

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[Any, Any]:
        arrays, metrics = super().aggregate_train(server_round, replies)
        if arrays is None:
            return arrays, metrics
        if self.noise_std is None:
            raise RuntimeError(f"{type(self).__name__} aggregates without a DP wrapper's noise std")
        nds = arrays.to_numpy_ndarrays()
        add_gaussian_noise_inplace(nds, self.noise_std)
        log.info("DP noise of std %.4g added to the mean, before the server step", self.noise_std)
        return ArrayRecord(
            {k: Array(np.asarray(v)) for k, v in zip(arrays.keys(), nds, strict=True)}
        ), metrics


def with_noisy_mean(cls: type[FedAvg]) -> type[FedAvg]:
    """``cls`` with NoisyMean between its server step and FedAvg's mean (MRO: cls, ..., NoisyMean,
    FedAvg): its ``super().aggregate_train`` then returns the noisy mean."""
    doc = f"{cls.__name__} stepping on the noisy mean (strategy.dp)."
    return type(cls.__name__, (cls, NoisyMean), {"__doc__": doc, "__module__": __name__})


class Accounted:
    """Equal weights for every reply, and a record of what the round released (``release``)."""

    cfg: Config  # set by wrap: what a DPError names
    release: Release | None = None
    population: int = 0

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self.release = None
        # N, the nodes the round loop drew its sample from; without one, the strategy samples
        # from the nodes it is shown (Flower's own Strategy.start).
        self.population = int(config.get(POPULATION, 0)) or len(grid.get_node_ids())
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> Any:
        replies = list(replies)
        for r in replies:
            r.content[METRICS][WEIGHT] = r.content[METRICS]["num-examples"]
        return super().aggregate_evaluate(server_round, replies)

    def _add_noise_to_aggregated_arrays(self, aggregated: ArrayRecord) -> ArrayRecord:
        if isinstance(self.strategy, NoisyMean):
            return aggregated  # the noise went onto the mean, before the server step
        return super()._add_noise_to_aggregated_arrays(aggregated)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[Any, Any]:
        replies = list(replies)
        for r in replies:
            r.content[METRICS][WEIGHT] = 1.0
        if isinstance(self.strategy, NoisyMean):  # C is still this round's C_t here (adaptive too)
            self.strategy.noise_std = compute_stdv(
                self.noise_multiplier, self.clipping_norm, self.num_sampled_clients
            )
        try:
            arrays, metrics = super().aggregate_train(server_round, replies)
        except (ArithmeticError, ValueError) as e:
            if (dp := _flower_dp_failure(e, f"round {server_round}", self.cfg)) is None:
                raise
            raise dp from e
        if arrays is not None:  # Flower added its noise
            count = getattr(self, "clipped_count_stddev", None)  # the adaptive modes only
            self.release = Release(
                self.population, self.num_sampled_clients, len(replies), self.noise_multiplier, count
            )
        return arrays, metrics


def release_of(strategy: Strategy) -> Release | None:
    """What the DP wrapper released in the round just aggregated (None: no DP, or no release)."""
    return strategy.release if isinstance(strategy, Accounted) else None


class _FixedPerRound(Accounted):
    """Noise calibrated to the nodes this round samples (Flower fixes one number at start)."""

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self.num_sampled_clients = len(grid.get_node_ids())
        return super().configure_train(server_round, arrays, config, grid)


class _AdaptivePerRound(Accounted):
    """As _FixedPerRound, with the adaptive noise split (count noise vs update noise) redone, and
    the noise scaled by the clipping norm this round's updates were clipped to: Flower moves the
    norm before it adds the noise, so its std is z C_{t+1} / m for updates clipped to C_t (too
    little noise whenever the norm shrinks; Andrew et al. use C_t)."""

    round_clipping_norm: float = 0.0

    def _add_noise_to_aggregated_arrays(self, aggregated: ArrayRecord) -> ArrayRecord:
        moved, self.clipping_norm = self.clipping_norm, self.round_clipping_norm
        try:
            return super()._add_noise_to_aggregated_arrays(aggregated)
        finally:
            self.clipping_norm = moved

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self.round_clipping_norm = self.clipping_norm  # C_t: what the nodes / the server clip to
        n = len(grid.get_node_ids())
        if n != self.num_sampled_clients:
            self.num_sampled_clients = n
            z, given = self.configured
            try:
                self.clipped_count_stddev, self.noise_multiplier = compute_adaptive_noise_params(
                    z, n, clipped_count_stddev(given, z, n)
                )
            except ValueError as e:
                raise ConfigError(f"round {server_round}, {n} sampled nodes: strategy.dp: {e}") from None
        return super().configure_train(server_round, arrays, config, grid)


class ServerFixed(_FixedPerRound, DifferentialPrivacyServerSideFixedClipping):
    pass


class ClientFixed(_FixedPerRound, DifferentialPrivacyClientSideFixedClipping):
    pass


class ServerAdaptive(_AdaptivePerRound, DifferentialPrivacyServerSideAdaptiveClipping):
    pass


class ClientAdaptive(_AdaptivePerRound, DifferentialPrivacyClientSideAdaptiveClipping):
    pass


def wrap(strategy: Strategy, cfg: Config) -> Strategy:
    """``strategy`` under the DP wrapper that ``strategy.dp`` names (itself for "none")."""
    s, mode = cfg.strategy, cfg.strategy.dp
    if mode == "none":
        return strategy
    n = sampled_per_round(cfg.fraction_train, cfg.min_nodes)  # reset every round to the real count
    if mode.endswith("fixed"):
        cls = ServerFixed if mode == "server-fixed" else ClientFixed
        out = cls(strategy, s.dp_noise_multiplier, s.dp_clipping_norm, n)
        out.cfg = cfg
        return out
    cls = ServerAdaptive if mode == "server-adaptive" else ClientAdaptive
    out = cls(
        strategy,
        s.dp_noise_multiplier,
        n,
        initial_clipping_norm=s.dp_initial_clipping_norm,
        target_clipped_quantile=s.dp_target_clipped_quantile,
        clip_norm_lr=s.dp_clip_norm_lr,
        clipped_count_stddev=clipped_count_stddev(s.dp_clipped_count_stddev, s.dp_noise_multiplier, n),
    )
    out.configured = (s.dp_noise_multiplier, s.dp_clipped_count_stddev)
    out.cfg = cfg
    return out


# Noise std per coordinate per round above which a model is unlikely to learn: a ResNet-10's conv
# weights start at He-init std 0.04-0.12 (width 64-16), and the noise adds up over the rounds.
ABSORBABLE_NOISE_STD = 0.01


def noise_warning(cfg: Config, nodes: int) -> str | None:
    """A warning when the DP noise per coordinate, z C / m with m the nodes a round samples of the
    ``nodes`` connected (fraction-train of them, as each round's noise is calibrated), is far above
    what a model can absorb; None otherwise. The ServerApp records it once the nodes are known."""
    s = cfg.strategy
    if s.dp == "none":
        return None
    fixed = s.dp.endswith("fixed")
    norm, key = (
        (s.dp_clipping_norm, "dp-clipping-norm")
        if fixed
        else (s.dp_initial_clipping_norm, "dp-initial-clipping-norm")
    )
    m = sampled_per_round(cfg.fraction_train, nodes)
    std = s.dp_noise_multiplier * norm / m
    if std <= ABSORBABLE_NOISE_STD:
        return None
    return (
        f"strategy.dp = {s.dp!r}: DP noise of std {std:.3g} per coordinate per round (strategy.dp-noise-"
        f"multiplier {s.dp_noise_multiplier:g} x strategy.{key} {norm:g} / {m} sampled node(s)) is far above "
        f"{ABSORBABLE_NOISE_STD:g}, about what a model absorbs: expect no learning; DP-FedAvg needs many "
        "nodes per round (min-nodes, fraction-train) or a smaller clipping norm"
    )


def settings(cfg: Config) -> dict[str, Any] | None:
    """What results.json records of the run's DP (None without DP)."""
    s = cfg.strategy
    if s.dp == "none":
        return None
    out: dict[str, Any] = {"mode": s.dp, "noise-multiplier": s.dp_noise_multiplier}
    if s.dp.endswith("fixed"):
        return out | {"clipping-norm": s.dp_clipping_norm}
    return out | {
        "initial-clipping-norm": s.dp_initial_clipping_norm,
        "target-clipped-quantile": s.dp_target_clipped_quantile,
        "clip-norm-lr": s.dp_clip_norm_lr,
        "clipped-count-stddev": s.dp_clipped_count_stddev or "max(sampled nodes / 20, noise multiplier)",
    }


def required_metrics(cfg: Config) -> frozenset[str]:
    """Client-side adaptive clipping reads each reply's ``norm_bit`` (was the update clipped)."""
    return frozenset({KEY_NORM_BIT}) if cfg.strategy.dp == "client-adaptive" else frozenset()


def client_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """The ClientApp's mod: Flower's clipping mod for a train message that asks for clipping
    (``clipping_norm`` in its config), by the run's ``strategy.dp``; every other message passes.
    (Flower's mods reject a message without the key, so they cannot simply always be on.)"""
    train = msg.metadata.message_type == MessageType.TRAIN and "config" in msg.content
    if not train or KEY_CLIPPING_NORM not in msg.content["config"]:
        return call_next(msg, ctxt)
    cfg = process_config(ctxt.run_config)  # the handlers' cast, kept for the process
    mode = cfg.strategy.dp
    mod = {"client-fixed": fixedclipping_mod, "client-adaptive": adaptiveclipping_mod}.get(mode)
    if mod is None:
        raise ConfigError(f"a train message asks for client-side clipping, but strategy.dp = {mode!r}")
    # Flower's mods take a train message with one ArrayRecord (the model): a method's own array
    # records (FedDifRC's basis) ride along to the ClientApp past them; the node clips only its
    # model update.
    riders = {k: r for k, r in msg.content.array_records.items() if k != MODEL}
    for k in riders:
        del msg.content[k]

    def with_riders(m: Message, c: Context) -> Message:
        for k, r in riders.items():
            m.content[k] = r
        return call_next(m, c)

    try:
        return mod(msg, ctxt, with_riders)
    except (ArithmeticError, ValueError) as e:
        if (dp := _flower_dp_failure(e, "this node's clipping", cfg)) is None:
            raise
        raise dp from e
