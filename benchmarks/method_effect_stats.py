"""The statistics of benchmarks/method_effect.py: endpoints from a cell's curves, paired t-tests
over seeds, Holm's step-down adjustment and the verdict words. Pure functions of numbers."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

ALPHA = 0.05  # family-wise error rate of the Holm-adjusted tests
SECONDARY_WIDTH = 5  # rounds in the secondary endpoint's window, centred on the validation-best round


def window_mean(test: Sequence[float], first: int, last: int) -> float:
    """Mean test accuracy (%) over rounds ``first``..``last`` (1-based, inclusive) of a curve
    whose element i is round i + 1."""
    if not 1 <= first <= last <= len(test):
        raise ValueError(f"window rounds {first}-{last} outside the curve's rounds 1-{len(test)}")
    return 100 * float(np.mean(np.asarray(test, dtype=float)[first - 1 : last]))


def val_best_window(val: Sequence[float], width: int = SECONDARY_WIDTH) -> tuple[int, int]:
    """Rounds (first, last) of the secondary window: ``width`` rounds centred on the round of best
    validation accuracy (the first such round), SHIFTED (not shortened) to lie within rounds
    1..R, so every cell averages the same number of rounds; the whole curve if R < width."""
    rounds = len(val)
    if rounds <= width:
        return 1, rounds
    best = int(np.argmax(np.asarray(val, dtype=float))) + 1  # argmax keeps the first maximum
    first = min(max(best - width // 2, 1), rounds - width + 1)
    return first, first + width - 1


def endpoints(val: Sequence[float], test: Sequence[float], window: tuple[int, int]) -> dict[str, float]:
    """The primary (mean test accuracy over the declared ``window``) and secondary (mean test
    accuracy over the validation-best window) endpoints of one cell, in %, and (described, never
    tested) its final, best and mean-of-the-last-5 test accuracy."""
    r = len(test)
    return {
        "primary": window_mean(test, *window),
        "secondary": window_mean(test, *val_best_window(val)),
        "final": window_mean(test, r, r),
        "best": 100 * float(np.max(test)),
        "last5": window_mean(test, max(1, r - 4), r),
    }


def paired(deltas: Sequence[float]) -> dict[str, float]:
    """Mean, SD, 95% t-interval, two-sided one-sample t-test p (H0: mean 0) and sign counts of
    per-seed differences."""
    from scipy import stats

    d = np.asarray(deltas, dtype=float)
    n, mean = len(d), float(d.mean()) if len(d) else math.nan
    sd = float(d.std(ddof=1)) if n > 1 else math.nan
    se = sd / math.sqrt(n) if n > 1 else math.nan
    half = float(stats.t.ppf(0.975, n - 1) * se) if n > 1 else math.nan
    if n < 2:
        p = math.nan
    elif se == 0:
        p = 1.0 if mean == 0 else 0.0
    else:
        p = float(2 * stats.t.sf(abs(mean / se), n - 1))
    return {
        "n": n,
        "mean": mean,
        "sd": sd,
        "lo": mean - half,
        "hi": mean + half,
        "p": p,
        "pos": int((d > 0).sum()),
        "neg": int((d < 0).sum()),
    }


def holm(p: Sequence[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values, in the input's order: the k-th smallest of m p-values
    times (m - k + 1), made non-decreasing along that order, capped at 1. NaN (a test that could
    not be run) stays NaN and does not count in m."""
    ranked = sorted((v, i) for i, v in enumerate(p) if not math.isnan(v))
    m, out, running = len(ranked), [math.nan] * len(p), 0.0
    for k, (v, i) in enumerate(ranked):
        running = max(running, min(1.0, (m - k) * v))
        out[i] = running
    return out


def verdict(test: dict[str, float], p_adjusted: float) -> str:
    """ "helps" / "hurts" only where the Holm-adjusted test rejects at ALPHA."""
    if test["n"] < 2 or math.isnan(p_adjusted):
        return "n < 2"
    if p_adjusted < ALPHA:
        return "helps" if test["mean"] > 0 else "hurts"
    return "no detectable difference"


def fmt_paired(t: dict[str, float]) -> str:
    return f"{t['mean']:+.1f} [{t['lo']:+.1f}, {t['hi']:+.1f}] ({t['pos']}/{t['neg']})"
