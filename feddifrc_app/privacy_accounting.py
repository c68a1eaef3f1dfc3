"""(epsilon, delta) of a run under ``strategy.dp``: dp-accounting's RDP accountant, round by round.

Node-level DP: the unit is one node's whole update. Each round the server draws m of the N
connected nodes without replacement, clips every update to C and adds Gaussian noise of std
``z C / m`` to the aggregate (privacy.py). N is public, so neighbouring federations differ by
REPLACING one node (the only relation dp-accounting's ``SampledWithoutReplacementDpEvent``
takes), and one replaced update moves the sum of clipped updates by up to 2C:

- uniform mean (fedavg, fedprox: the release is ``x + mean of the m' aggregated clipped
  updates + noise``; fedavgm and the FedOpt family step on that noisy mean, privacy.NoisyMean,
  which is post-processing): sensitivity 2C / m', so the accounted noise multiplier is
  ``z m' / (2 m)`` (= z / 2 when every sampled node replied);
- krum, multikrum (the release is ``x +`` one clipped update, or the mean of a selection of
  them: a point of the ball of radius C, whichever update is replaced): sensitivity 2C, so
  ``z / (2 m)``;
- adaptive clipping (Andrew et al., 2021) also releases the clipped count (a sum of norm bits
  in {0, 1}: sensitivity 1) with noise std s; Flower gives the update the multiplier
  ``z_u = (z^-2 - (2 s)^-2)^-1/2``, and the two Gaussians compose into
  ``(sigma_u^-2 + s^-2)^-1/2``, which is exactly z / 2 for the uniform mean with every reply in.
  (Under add/remove the update's sensitivity would be C, but Flower's uncentered 0/1 count
  still has sensitivity 1, so the pair would compose to less than z: replace-one has no gap.)

Every other strategy is not accounted (``not_accounted`` says why): FedMedian, FedTrimmedAvg
and Bulyan work coordinate by coordinate, and QFedAvg weighs each update by the node's own loss.

Two epsilons per round, both cumulative: ``epsilon`` composes every round as the full Gaussian
mechanism (the sample is drawn from the public seed and results.json lists the sampled nodes,
so amplification by subsampling cannot be claimed; an upper bound for every node, tight with
``fraction-train = 1``), and ``epsilon-if-sample-secret`` with the amplification of sampling m
of N without replacement (Wang, Balle & Kasiviswanathan, 2019), the figure that would hold if
the round's sample were uniformly random and secret (never above ``epsilon``: the smaller of
the two bounds).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict
from typing import Any

from feddifrc_app.config import Config
from feddifrc_app.privacy import SERVER_STEP, Release
from feddifrc_app.results import RoundRow, json_key

ACCOUNTANT = "dp_accounting.rdp.RdpAccountant (REPLACE_ONE), one Gaussian release per round"
# The release is the uniform mean of the clipped updates plus noise (or a server step on it).
MEAN = ("fedavg", "fedprox", *SERVER_STEP)
SELECTION = ("krum", "multikrum")  # one clipped update, or the mean of a selection of them


def not_accounted(cfg: Config) -> str:
    """Why this run's epsilon cannot be computed ("" = it can)."""
    if cfg.strategy.dp == "none":
        return "strategy.dp = 'none'"
    if cfg.strategy.name in MEAN + SELECTION:
        return ""
    return (
        f"strategy.name = '{cfg.strategy.name}' is not the noisy mean of the clipped updates (a "
        "coordinate-wise rule, or weights from the nodes' losses), so Flower's noise has no "
        "sensitivity the accountant could use"
    )


def accounted_multiplier(strategy_name: str, r: Release) -> float:
    """The release's noise std over its replace-one sensitivity (0 = no noise: epsilon is inf)."""
    if r.update_multiplier == 0 or r.count_stddev == 0:
        return 0.0
    if strategy_name in MEAN:  # std z C / m on a mean of m' updates of sensitivity 2 C / m'
        update = r.update_multiplier * r.aggregated / (2 * r.sampled)
    elif strategy_name in SELECTION:  # std z C / m on a point of the ball of radius C
        update = r.update_multiplier / (2 * r.sampled)
    else:
        raise ValueError(f"strategy {strategy_name!r} is not accounted")
    if r.count_stddev is None:
        return update
    return (update**-2 + r.count_stddev**-2) ** -0.5  # the count: a sum of 0/1 bits, sensitivity 1


def epsilon(events: list[tuple[int, int, float]], delta: float, amplified: bool) -> float:
    """Cumulative epsilon at ``delta`` of (N, m, accounted multiplier) releases, composed with
    dp-accounting's RDP accountant; ``amplified``: each sampled m of N without replacement."""
    # Imported here: dp-accounting pulls in scipy.stats and scipy.signal, 1.7 s of every
    # ServerApp's start, which only a run with an accounted DP mode needs.
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    acc = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    for (n, m, sigma), count in Counter(events).items():  # identical rounds composed at once
        if sigma == 0:
            return math.inf
        gaussian = dp_accounting.GaussianDpEvent(sigma)
        event = dp_accounting.SampledWithoutReplacementDpEvent(n, m, gaussian) if amplified else gaussian
        acc.compose(event, count)
    return float(acc.get_epsilon(delta))


def account_round(cfg: Config, row: RoundRow, earlier: list[RoundRow], release: Release | None) -> None:
    """A trained round's release (None: nothing was released) and the epsilons over it and the
    ``earlier`` rows' releases, set in its ``row``; nothing when the run is not accounted."""
    if not_accounted(cfg):
        return
    row.dp_release = None if release is None else _to_row(release)
    releases = [_from_row(r.dp_release) for r in [*earlier, row] if r.dp_release]
    events = [(r.population, r.sampled, accounted_multiplier(cfg.strategy.name, r)) for r in releases]
    plain = epsilon(events, cfg.strategy.dp_delta, amplified=False)
    secret = min(plain, epsilon(events, cfg.strategy.dp_delta, amplified=True)) if events else 0.0
    row.epsilon, row.epsilon_if_sample_secret = (plain if events else 0.0), secret


def _to_row(r: Release) -> dict[str, Any]:
    return {k.replace("_", "-"): v for k, v in asdict(r).items()}


def _from_row(row: dict[str, Any]) -> Release:
    return Release(**{k.replace("-", "_"): v for k, v in row.items()})


def settings(cfg: Config) -> dict[str, Any]:
    """What results.json's ``privacy`` block adds about the accounting (privacy.settings has the rest)."""
    why = not_accounted(cfg)
    out: dict[str, Any] = {
        "weighting": "uniform: every reply weighs 1 (num-examples is not used under DP)",
        "delta": cfg.strategy.dp_delta,
    }
    if why:
        return out | {"accountant": None, "not-accounted": why}
    sensitivity = "2 C / m' (uniform mean)" if cfg.strategy.name in MEAN else "2 C (one point of the C-ball)"
    return out | {
        "accountant": ACCOUNTANT,
        "unit": "node-level: one node's whole update, neighbouring federations replace one node",
        "sensitivity": sensitivity,
        # What the rows' two epsilons (results.RoundRow) are, under their keys.
        json_key(
            "epsilon"
        ): "every round composed without amplification (the sample is seeded and published)",
        json_key("epsilon_if_sample_secret"): "with the amplification of sampling m of N without replacement",
        "assumptions": [
            "client-side modes: the nodes clip as told (Flower's mods)",
            "it covers the released model (and adaptive clipping's norm); the rounds' train-metrics "
            "(mean losses, client-adaptive's clipped fraction) are written without noise",
            "Flower draws the noise from numpy's global generator, not a cryptographic one",
        ],
    }
