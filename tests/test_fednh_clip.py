"""benchmarks/fednh_clip.py's arithmetic: arms, endpoints and paired differences of a hand-made
cells list (no runs)."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import fednh_clip as fc  # noqa: E402

ROUNDS = 16  # alpha 0.05's partition in run2: 16 rounds, window 7-16


def cell(arm: str, seed: int, offset: float) -> dict:
    """A cell whose round-i test accuracy is i / 100 + offset: window 7-16 mean 11.5 + 100 offset,
    final and best 16 + 100 offset, mean of the last 5 14 + 100 offset (points)."""
    test = [i / 100 + offset for i in range(1, ROUNDS + 1)]
    return {"arm": arm, "alpha": 0.05, "seed": seed, "val": test, "test": test, "config": {}}


FEDAVG = {0: 0.20, 1: 0.22, 2: 0.24}
CLIP_GAIN = {0: 0.08, 1: 0.10, 2: 0.12}  # FedAvg+clip - FedAvg: 8, 10, 12 points
NH_GAIN = {0: 0.20, 1: 0.20, 2: 0.23}  # FedNH - FedAvg: 20, 20, 23 points
CELLS = (
    [cell("fedavg", s, o) for s, o in FEDAVG.items()]
    + [cell("fedavg-clip", s, FEDAVG[s] + CLIP_GAIN[s]) for s in FEDAVG]
    + [cell("fednh", s, FEDAVG[s] + NH_GAIN[s]) for s in FEDAVG]
    + [cell("fednh", 3, 0.9)]  # no FedAvg partner: described, never in a difference
)


def test_arm_of_tells_the_clipped_fedavg_from_run2s_arms():
    grid = {"partition.alpha": 0.05, "num-server-rounds": 16}
    conf = str(ROOT / "conf" / "mnist5k-fedavg.toml")
    assert fc.arm_of({"conf": conf, "grid": {**grid, "train.max-grad-norm": 10.0}}) == "fedavg-clip"
    assert fc.arm_of({"conf": conf, "grid": grid}) == "fedavg"
    assert fc.arm_of({"conf": conf.replace("fedavg", "fednh"), "grid": grid}) == "fednh"
    assert fc.arm_of({"conf": conf, "grid": {**grid, "train.max-grad-norm": 5.0}}) is None


def test_differences_are_paired_by_seed_with_t_intervals():
    s = fc.summarise(CELLS)["0.05"]
    assert s["window"] == [7, 16]
    c = {x["arm"] + " - " + x["minus"]: x for x in s["contrasts"]}
    t2 = 4.302652729911275  # t(0.975, 2 df)
    clip = c["fedavg-clip - fedavg"]  # 8, 10, 12: mean 10, SD 2
    assert clip["seeds"] == [0, 1, 2] and clip["n"] == 3
    assert clip["mean"] == pytest.approx(10.0)
    assert clip["sd"] == pytest.approx(2.0)
    assert clip["lo"] == pytest.approx(10 - t2 * 2 / 3**0.5)
    assert clip["hi"] == pytest.approx(10 + t2 * 2 / 3**0.5)
    assert (clip["pos"], clip["neg"]) == (3, 0)
    nh = c["fednh - fedavg"]  # 20, 20, 23: seed 3 of FedNH has no partner
    assert nh["seeds"] == [0, 1, 2]
    assert nh["mean"] == pytest.approx(21.0)
    assert nh["sd"] == pytest.approx(3**0.5)
    head = c["fednh - fedavg-clip"]  # 12, 10, 11: the two differences above, subtracted
    assert head["mean"] == pytest.approx(11.0)
    assert head["sd"] == pytest.approx(1.0)
    assert head["mean"] == pytest.approx(nh["mean"] - clip["mean"])
    assert "p" not in head and head["p-unadjusted"] < 0.05
    assert [x["identical-curves"] for x in s["contrasts"]] == [0, 0, 0]


def test_a_clip_that_never_engages_shows_as_identical_curves():
    """FedAvg+clip whose curves equal FedAvg's (norm 10 never reached) differs by exactly 0."""
    cells = [cell("fedavg", s, o) for s, o in FEDAVG.items()] + [
        cell("fedavg-clip", s, o) for s, o in FEDAVG.items()
    ]
    clip = fc.summarise(cells)["0.05"]["contrasts"][1]
    assert clip["what"] == "FedAvg+clip - FedAvg (clipping alone)"
    assert (clip["n"], clip["identical-curves"], clip["mean"], clip["sd"]) == (3, 3, 0.0, 0.0)
    assert (clip["pos"], clip["neg"]) == (0, 0)


def test_each_arm_is_described_by_window_final_best_and_last5():
    arms = fc.summarise(CELLS)["0.05"]["arms"]
    fedavg = arms["fedavg"]  # offsets 20, 22, 24 points
    assert fedavg["seeds"] == [0, 1, 2]
    assert fedavg["primary"]["mean"] == pytest.approx(33.5)
    assert fedavg["primary"]["sd"] == pytest.approx(2.0)
    assert fedavg["final"]["mean"] == pytest.approx(38.0)
    assert fedavg["best"]["mean"] == pytest.approx(38.0)
    assert fedavg["last5"]["mean"] == pytest.approx(36.0)
    assert arms["fednh"]["seeds"] == [0, 1, 2, 3]  # described over all its cells
    assert arms["fednh"]["final"]["mean"] == pytest.approx((56 + 58 + 63 + 106) / 4)


def test_an_alpha_without_cells_has_empty_differences_and_the_readme_says_described():
    summary = fc.summarise(CELLS)
    assert summary["0.5"]["arms"] == {} and all(c["n"] == 0 for c in summary["0.5"]["contrasts"])
    check = {"cells": [], "identical": False}
    text = fc.readme(summary, check, {"commit": "b1f18ca", "tracked-changes": ""}, "rerun here")
    assert "**Described, not tested**" in text
    assert (
        "| 0.05 | 7-16 | FedAvg+clip - FedAvg (clipping alone) | 3 | +10.0 [+5.0, +15.0] (3/0) | 0 |" in text
    )
    assert "| 0.05 | fedavg | 3 | 33.5 ± 2.0 | 38.0 ± 2.0 | 38.0 ± 2.0 | 36.0 ± 2.0 |" in text
    assert "commit `b1f18ca` (no tracked file changed" in text


def _earlier(docs, code: dict, cells: list[dict], rows: list[dict]) -> None:
    docs.mkdir()
    (docs / "cells.json").write_text(json.dumps(cells))
    (docs / "summary.json").write_text(json.dumps({"code": code, "recheck": {"cells": rows}}))


def test_a_second_sitting_keeps_the_earlier_records_of_the_cells_it_did_not_run(tmp_path):
    code = {"commit": "abc1234", "tracked-changes": ""}
    row = {"arm": "fedavg", "alpha": 0.05, "seed": 0, "same": False}
    docs = tmp_path / "docs"
    _earlier(docs, code, CELLS[:3], [row, {**row, "arm": "fednh"}])
    new = {**cell("fedavg", 0, 0.5), "alpha": 0.5}  # this sitting's cell: another alpha
    check = {"cells": [{**row, "alpha": 0.5}, {**row, "arm": "fednh", "alpha": 0.5}], "identical": False}
    here, merged = fc.merged([new], check, code, docs)
    assert here == sorted([*CELLS[:3], new], key=lambda e: (e["arm"], e["alpha"], e["seed"]))
    assert [(r["arm"], r["alpha"]) for r in merged["cells"]] == [
        ("fedavg", 0.05),
        ("fedavg", 0.5),
        ("fednh", 0.05),
        ("fednh", 0.5),
    ]
    assert merged["identical"] is False  # four rechecks, none the same
    again = {**CELLS[0], "test": [0.0] * ROUNDS}  # a cell rerun here replaces its earlier record
    assert fc.merged([again], check, code, docs)[0][0] == again
    with pytest.raises(SystemExit, match="came from .*abc1234.*not merged"):
        fc.merged([new], check, {**code, "commit": "def5678"}, docs)
    assert fc.merged([new], check, code, tmp_path / "none") == ([new], check)  # nothing earlier
