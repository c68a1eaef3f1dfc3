"""The gate of benchmarks/dose.py: does a teacher encode per-image class knowledge? Pure measures
of one teacher's features on labelled images, each per image, so every one gets a bootstrap 95%
interval over images (and a paired one against the pixels).

Input: ``reps`` (N, K + 1, D): each image's teacher features (pooled blocks, each L2-normalised,
concatenated: the teacher's own space) under the K class prompts in label order, then under the
empty prompt (the unconditioned features). ``labels`` (N,) in 0..K-1.

- **label-free matching**: the class prompt whose features are nearest (cosine) to the image's
  unconditioned features; correct when it is the image's class. No label is used to predict;
  chance is 1/K. A teacher that knows what a digit is should "agree with itself" most under the
  right prompt.
- **prompt effect**: per image, mean 1 - cos over ordered pairs of distinct class prompts.
- **probes**: cross-validated nearest-class-centroid (cosine) and logistic-regression accuracy of
  the per-image TDCL targets under ONE FIXED class prompt (each prompt probed on its own, per-image
  correctness averaged over the K prompts: the prompt cannot leak the label), of the
  unconditioned features, and of the pixels (the reference every student already has).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

BOOTSTRAP = 2000
BOOTSTRAP_SEED = 0
FOLDS = 5
CI_LEVEL = 0.95


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True).clip(1e-12)


def matching_correct(reps: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """(N,) 1.0 where the class prompt nearest (cosine) to the unconditioned features is the label."""
    u = unit(reps)
    cos = np.einsum("nkd,nd->nk", u[:, :-1], u[:, -1])
    return (cos.argmax(1) == labels).astype(float)


def prompt_effect_per_image(reps: np.ndarray) -> np.ndarray:
    """(N,) mean 1 - cos over ordered pairs of distinct class prompts (the last row, unconditioned,
    is not a class prompt)."""
    u = unit(reps[:, :-1])
    k = u.shape[1]
    cos = np.einsum("nkd,nld->nkl", u, u)
    return (1.0 - cos[:, ~np.eye(k, dtype=bool)]).mean(1)


def probe_correct(x: np.ndarray, labels: np.ndarray, folds: int = FOLDS) -> dict[str, np.ndarray]:
    """(N,) per-image correctness of cross-validated probes of ``x`` (N, D): nearest class centroid
    on unit vectors (cosine order) and logistic regression on standardised features."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold, cross_val_predict
    from sklearn.neighbors import NearestCentroid
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    cv = StratifiedKFold(folds, shuffle=True, random_state=0)
    ncc = cross_val_predict(NearestCentroid(), unit(x), labels, cv=cv)
    lin = make_pipeline(StandardScaler(), LogisticRegression(C=1.0, max_iter=2000))
    lr = cross_val_predict(lin, x, labels, cv=cv)
    return {"ncc": (ncc == labels).astype(float), "linear": (lr == labels).astype(float)}


def fixed_prompt_probes(reps: np.ndarray, labels: np.ndarray, folds: int = FOLDS) -> dict[str, np.ndarray]:
    """:func:`probe_correct` of the targets under each class prompt alone, averaged over prompts."""
    k = reps.shape[1] - 1
    runs = [probe_correct(reps[:, c], labels, folds) for c in range(k)]
    return {name: np.mean([r[name] for r in runs], axis=0) for name in runs[0]}


def bootstrap_ci(values: np.ndarray, n: int = BOOTSTRAP, seed: int = BOOTSTRAP_SEED) -> dict[str, float]:
    """Mean of per-image ``values`` with a percentile bootstrap interval over images."""
    v = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, len(v), size=(n, len(v)))].mean(1)
    tail = 100 * (1 - CI_LEVEL) / 2
    lo, hi = np.percentile(means, [tail, 100 - tail])
    return {"mean": float(v.mean()), "lo": float(lo), "hi": float(hi), "n": int(len(v))}


def measures(reps: np.ndarray, labels: np.ndarray, pixels: np.ndarray, folds: int = FOLDS) -> dict:
    """Every gate measure of one teacher on one image set, each with its 95% interval; the probes
    also as a paired difference from the same probe on the pixels."""
    labels = np.asarray(labels)
    fixed = fixed_prompt_probes(reps, labels, folds)
    uncond = probe_correct(reps[:, -1], labels, folds)
    pix = probe_correct(pixels.reshape(len(pixels), -1).astype(float), labels, folds)
    out = {
        "chance": 1.0 / (reps.shape[1] - 1),
        "matching": bootstrap_ci(matching_correct(reps, labels)),
        "prompt-effect": bootstrap_ci(prompt_effect_per_image(reps)),
    }
    for name in ("ncc", "linear"):
        out[f"targets-{name}"] = bootstrap_ci(fixed[name])
        out[f"unconditioned-{name}"] = bootstrap_ci(uncond[name])
        out[f"pixels-{name}"] = bootstrap_ci(pix[name])
        out[f"targets-minus-pixels-{name}"] = bootstrap_ci(fixed[name] - pix[name])
    return out


def passes(matching: dict[str, float], chance: float) -> bool:
    """The declared stop rule (design.md): stop if the label-free matching interval includes chance.
    An interval wholly below chance also passes: the nearest prompt is then systematically a
    wrong class, which takes per-image class knowledge too (see design.md, "Gate amendment")."""
    return not matching["lo"] <= chance <= matching["hi"]


def choose_setting(scores: dict[str, dict], min_effect: float, key: Callable[[dict], float]) -> str | None:
    """The setting (name -> measures of the deciding teacher) with the highest ``key`` among those
    whose prompt effect is at least ``min_effect``; None if none qualifies."""
    ok = {name: m for name, m in scores.items() if m["prompt-effect"]["mean"] >= min_effect}
    return max(ok, key=lambda name: key(ok[name])) if ok else None
