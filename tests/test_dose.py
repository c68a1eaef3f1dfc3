"""benchmarks/dose*.py: the gate's measures on hand-made features, the declared rules, and the
paired table recomputed from cells."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import dose_design as design  # noqa: E402
import dose_gate as gate  # noqa: E402


def _reps(uncond_towards: list[int]) -> np.ndarray:
    """3 classes, D = 3: prompt k's features are axis k; the unconditioned row leans towards
    ``uncond_towards[i]`` for image i."""
    n, k = len(uncond_towards), 3
    reps = np.zeros((n, k + 1, 3))
    for i, c in enumerate(uncond_towards):
        reps[i, :k] = np.eye(k)
        reps[i, k] = 0.2 + np.eye(k)[c]
    return reps


def test_label_free_matching_picks_the_prompt_nearest_the_unconditioned_features() -> None:
    reps = _reps([0, 1, 2, 2])
    labels = np.array([0, 1, 2, 0])
    assert gate.matching_correct(reps, labels).tolist() == [1.0, 1.0, 1.0, 0.0]
    assert gate.matching_correct(reps * 7.0, labels).tolist() == [1.0, 1.0, 1.0, 0.0]  # cosine: scale-free


def test_prompt_effect_is_zero_when_prompts_change_nothing_and_one_for_orthogonal_features() -> None:
    reps = _reps([0, 1])
    assert gate.prompt_effect_per_image(reps) == pytest.approx([1.0, 1.0])  # orthogonal prompt rows
    same = np.ones((2, 4, 3))
    same[:, -1] = [1.0, -1.0, 0.0]  # the unconditioned row is not a class prompt
    assert gate.prompt_effect_per_image(same) == pytest.approx([0.0, 0.0])


def test_probes_separate_separable_targets_and_not_noise() -> None:
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(3), 20)
    centres = 5.0 * np.eye(3)
    x = centres[labels] + 0.1 * rng.standard_normal((60, 3))
    got = gate.probe_correct(x, labels, folds=5)
    assert got["ncc"].mean() == 1.0 and got["linear"].mean() == 1.0
    noise = gate.probe_correct(rng.standard_normal((60, 3)), labels, folds=5)
    assert noise["ncc"].mean() < 0.6
    # A fixed prompt's targets: the image part carries the class; the prompt part is constant.
    reps = np.stack([x + 10 * np.eye(3)[c] for c in range(3)] + [x], axis=1)  # (60, 4, 3)
    assert gate.fixed_prompt_probes(reps, labels, folds=5)["ncc"].mean() == 1.0


def test_bootstrap_interval_and_the_stop_rule() -> None:
    ci = gate.bootstrap_ci(np.array([1.0] * 30 + [0.0] * 70))
    assert ci["mean"] == pytest.approx(0.3) and ci["lo"] < 0.3 < ci["hi"] and ci["n"] == 100
    assert 0.2 < ci["lo"] and ci["hi"] < 0.4  # binomial SE 0.046: about +-0.09
    assert gate.bootstrap_ci(np.ones(10)) == {"mean": 1.0, "lo": 1.0, "hi": 1.0, "n": 10}
    assert gate.passes({"lo": 0.11, "hi": 0.2}, 0.10) and not gate.passes({"lo": 0.10, "hi": 0.2}, 0.10)
    assert not gate.passes({"lo": 0.05, "hi": 0.15}, 0.10)  # includes chance: stop
    assert gate.passes({"lo": 0.02, "hi": 0.05}, 0.10)  # wholly below chance: excludes it


def test_the_setting_is_the_best_matching_among_settings_prompts_move() -> None:
    m = lambda effect, match: {"prompt-effect": {"mean": effect}, "matching": {"mean": match}}  # noqa: E731
    scores = {"a": m(0.2, 0.3), "b": m(0.001, 0.9), "c": m(0.06, 0.5)}
    key = lambda s: s["matching"]["mean"]  # noqa: E731
    assert gate.choose_setting(scores, 0.05, key) == "c"  # "b" scores higher, but prompts barely move it
    assert gate.choose_setting({"b": scores["b"]}, 0.05, key) is None


def test_blinded_pooled_sd_and_the_declared_seed_rule() -> None:
    diffs = {"x": [1.0, 3.0], "y": [10.0, 10.0, 10.0]}  # variances 2 and 0: the means do not enter
    assert design.pooled_sd(diffs) == pytest.approx(1.0)
    assert design.seeds_needed(None) == design.seeds_needed(4.1) == 20
    assert design.seeds_needed(4.11) == 30


ARMS = ("A-fedavg", "B-tdcl-big", "C-anchors-big", "D-tdcl-small")


def test_paired_json_is_recomputable_from_cells(monkeypatch: pytest.MonkeyPatch) -> None:
    import dose

    rng = np.random.default_rng(1)
    rows = []
    for seed in range(6):
        base = rng.uniform(0.5, 0.7, 30)
        for arm, shift in (
            ("A-fedavg", 0.0),
            ("B-tdcl-big", 0.03),
            ("C-anchors-big", 0.01),
            ("D-tdcl-small", 0.02),
        ):
            rows.append({"arm": arm, "seed": seed, "test": (base + shift + rng.normal(0, 0.01, 30)).tolist()})
    got = dose.compare(rows)
    assert [(r["a"], r["b"]) for r in got] == [
        ("B-tdcl-big", "C-anchors-big"),
        ("B-tdcl-big", "D-tdcl-small"),
    ]
    for r in got:
        per_seed = [
            100 * (np.mean(a["test"][10:30]) - np.mean(b["test"][10:30]))
            for a in rows
            for b in rows
            if a["arm"] == r["a"] and b["arm"] == r["b"] and a["seed"] == b["seed"]
        ]
        assert r["mean"] == pytest.approx(np.mean(per_seed)) and r["seeds"] == list(range(6))
        assert r["window"] == [11, 30] and r["lo"] < r["mean"] < r["hi"]
    ps = sorted(r["p"] for r in got)
    assert sorted(r["p-holm"] for r in got) == pytest.approx(
        [min(1, 2 * ps[0]), max(min(1, 2 * ps[0]), ps[1])]
    )
    assert got[0]["verdict"] == "helps" and got[0]["mean"] == pytest.approx(2.0, abs=0.5)
    assert not math.isnan(got[1]["p-holm"])
