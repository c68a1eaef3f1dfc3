"""The declared design of benchmarks/dose.py (the teacher-knowledge dose experiment), as data.

Does a teacher that knows more than the federation pass it on? mnist-5k-pool: 500 client digits
(10 nodes x 50, Dirichlet alpha 0.5), a 3,500-digit teacher pool (7x), the 1,000 test digits.
Teachers from ``feddifrc pretrain-teacher`` (same recipe, same steps; only the data differs):
T-big on the whole pool, T-small on 500 pool digits outside the student's validation split.
Everything here is fixed before the first federated cell; design.md says it in words.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOSE = ROOT / "docs" / "method_effect" / "dose"
TEACHERS = DOSE / "teachers"
CONFS = DOSE / "confs"
GATE = DOSE / "gate.json"

DATASET = "mnist-5k-pool"
# Every cell: 30 rounds, 5 of 10 nodes a round, 5 local epochs on ~50 images (about the SGD steps
# per round of 250 images x 1 epoch), run2's learning rate (chosen on validation by the pilot).
SETTINGS: dict[str, Any] = {
    "dataset.name": DATASET,
    "partition.name": "dirichlet",
    "partition.alpha": 0.5,
    "num-server-rounds": 30,
    "train.local-epochs": 5,
    "train.lr": 0.05,
    "fraction-train": 0.5,
    "min-nodes": 10,
}
WINDOW = (11, 30)  # the endpoint: mean test accuracy over rounds 11-30 (1-based, inclusive)
SEEDS = 20  # paired seeds 0..19: 80% power for 3 points if the paired SD is <= 4.0
REESTIMATE_AT = 10  # blinded re-estimate of the pooled paired SD after this many whole seeds
SD_LIMIT = 4.1  # above it, extend to EXTENDED_SEEDS
EXTENDED_SEEDS = 30
CELL_SECONDS = 190.0  # one 30-round cell on 2 idle cores (run2's 30-round cells)

# The gate (dose_gate.py): candidate feature settings, each where prompts should move features.
# Chosen on the pool's 500 validation digits: among settings whose T-big prompt effect is >= 0.05,
# the highest T-big label-free matching. Never a setting picked for NDCR; NDCR is off in every arm.
MIN_PROMPT_EFFECT = 0.05
CANDIDATES: dict[str, dict[str, Any]] = {
    "defaults (mean, up 1,2,3, t=100)": {
        "diffusion.pooling": "mean",
        "diffusion.blocks": "1,2,3",
        "diffusion.timestep": 100,
        "diffusion.channels": "64,32,32",
    },
    "probe's choice (mean, mid + up 0,1, t=25)": {
        "diffusion.pooling": "mean",
        "diffusion.blocks": "-1,0,1",
        "diffusion.timestep": 25,
        "diffusion.channels": "64,32,32",
    },
}
GATE_SEED = 0  # the teacher-noise seed of the gate's features


@dataclass(frozen=True)
class Teacher:
    name: str
    folder: Path
    pretrain: tuple[str, ...]  # feddifrc pretrain-teacher flags beyond --out / --name
    control: bool = False


TEACHER_LIST = (
    Teacher("t-big", TEACHERS / "t-big", ()),
    Teacher("t-small", TEACHERS / "t-small", ("--exclude-val", "--limit", "500")),
    Teacher("untrained", TEACHERS / "untrained", ("--vae-steps", "0", "--unet-steps", "0"), control=True),
)


@dataclass(frozen=True)
class Arm:
    name: str
    conf: dict[str, Any]  # written to confs/<name>.toml
    teacher: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)


def arms(setting: dict[str, Any]) -> tuple[Arm, ...]:
    """A FedAvg; B TDCL(T-big); C TDCL-anchors(T-big); D TDCL(T-small); E TDCL(the untrained
    control, amendment 2): TDCL only (NDCR off)."""
    tdcl = {"method": "feddifrc", "loss.ndcr-weight": 0.0, **setting}
    big, small, untrained = (str(TEACHERS / t) for t in ("t-big", "t-small", "untrained"))
    return (
        Arm("A-fedavg", {"method": "fedavg"}),
        Arm("B-tdcl-big", {**tdcl, "diffusion.model": big}, "t-big"),
        Arm("C-anchors-big", {**tdcl, "diffusion.model": big, "loss.tdcl-targets": "anchors"}, "t-big"),
        Arm("D-tdcl-small", {**tdcl, "diffusion.model": small}, "t-small"),
        Arm("E-tdcl-untrained", {**tdcl, "diffusion.model": untrained}, "untrained"),
    )


# (a, b, what): a - b per seed; the Holm family is these two tests only. A is a reference.
COMPARISONS = (
    ("B-tdcl-big", "C-anchors-big", "primary: T-big per-image targets vs its class anchors"),
    ("B-tdcl-big", "D-tdcl-small", "secondary: T-big vs T-small (does the dose matter?)"),
)
# Amendment 2 (declared after the family above was read, before any E cell): a family of its own,
# one test, so the closed family's Holm adjustment is untouched. E - A is described, not tested.
CONTROL = (("B-tdcl-big", "E-tdcl-untrained", "control: T-big vs the untrained teacher (is it knowledge?)"),)


def chosen_setting() -> dict[str, Any] | None:
    """The feature setting gate.json chose (None: no gate yet, or the gate stopped the experiment)."""
    if not GATE.is_file():
        return None
    gate = json.loads(GATE.read_text())
    if not gate.get("proceed") or gate.get("setting") not in CANDIDATES:
        return None
    return CANDIDATES[gate["setting"]]


def conf_path(arm: Arm) -> Path:
    return CONFS / f"{arm.name}.toml"


def pooled_sd(diffs: dict[str, list[float]]) -> float:
    """Blinded pooled SD of the per-seed differences of the declared comparisons: the root mean of
    their sample variances (each centred on its own mean, so no mean is revealed)."""
    var = [float(sum((d - sum(v) / len(v)) ** 2 for d in v) / (len(v) - 1)) for v in diffs.values()]
    return math.sqrt(sum(var) / len(var))


def seeds_needed(sd_at_reestimate: float | None) -> int:
    """The declared rule: 20 seeds, extended to 30 if the blinded pooled SD at 10 seeds is > 4.1."""
    return EXTENDED_SEEDS if sd_at_reestimate is not None and sd_at_reestimate > SD_LIMIT else SEEDS
