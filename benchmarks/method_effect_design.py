"""The declared design of benchmarks/method_effect.py's comparison (issue 35): arms, partitions,
contrasts, seeds, the cells it runs, which cells of the earlier 72-cell run it reuses, and the
time budget. Everything here is read before any new result exists; `method_effect.py plan`
prints it without running anything.

A cell's identity is its run config (app defaults + conf file + settings + grid + seed), minus
the keys that cannot change its result (paths, checkpoint count) and the keys its method never
reads. A cell of the earlier run is reused only where that identity equals the planned cell's:
a key added since that run counts as equal only at the value declared in NEUTRAL_SINCE_LEGACY
(the value that reproduces the earlier behaviour); any other difference is printed as the reason.
"""

from __future__ import annotations

import json
import subprocess
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from feddifrc_app.config_changes import KEYS_ADDED_SINCE
from feddifrc_app.tools.sweep import Cell

ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------- the two options of other helpers
# The TDCL-anchors control (issue 35 item 1): its overrides live HERE ONLY; rename at merge if the
# option's key or value changes.
TDCL_ANCHORS: dict[str, Any] = {"loss.tdcl-targets": "anchors"}
# FedDifRC's NDCR target (issue 35 item 2), picked on mnist-5k's TRAIN split (1,000 digits, never
# test; docs/method-notes.md, "NDCR targets"): up_block 3's map unpooled (an 8 x 8 grid of its
# 32 px map) at t = 25 scores 0.815 nearest-centroid as a run fuses it, the only option at or above
# the centred pixels' 0.802 (t = 100: 0.751; t = 50: 0.786; today's target 0.550). It goes to
# EVERY teacher arm: timestep, blocks and pooling change the features TDCL reads as well as NDCR's,
# and "FedDifRC vs TDCL-only" measures the NDCR term alone only if both arms read the same features.
NDCR_TARGET: dict[str, Any] | None = {
    "diffusion.timestep": 25,
    "diffusion.blocks": "3",
    "diffusion.channels": "128",
    "diffusion.pooling": "grid",
    "diffusion.pool-grid": 8,
}
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arm:
    name: str
    conf: str  # conf/mnist5k-<conf>.toml
    overrides: dict[str, Any] = field(default_factory=dict)
    legacy: str | None = None  # its arm label in the earlier run's cells.json (reuse candidates)
    reference: bool = False  # a reference arm: REFERENCE_SEEDS seeds, not the key arms' count
    teacher: bool = False  # reads the teacher's features (so NDCR_TARGET applies)


TEACHER = {"diffusion.model": "tiny-mnist"}


def arms() -> tuple[Arm, ...]:
    """The arms, with the two options above applied (a function: NDCR_TARGET may be set later)."""
    t = {**TEACHER, **(NDCR_TARGET or {})}
    return (
        Arm("fedavg", "fedavg", {}, "fedavg"),
        Arm("tdcl-only", "tdcl-only", t, "tdcl-only [tiny-mnist]", teacher=True),
        Arm("tdcl-anchors", "tdcl-only", {**t, **TDCL_ANCHORS}, teacher=True),
        Arm("feddifrc", "feddifrc", t, "feddifrc [tiny-mnist]", teacher=True),
        Arm("fednh", "fednh", {}, "fednh", reference=True),
    )


@dataclass(frozen=True)
class Partition:
    alpha: float  # NID1 Dirichlet concentration
    rounds: int
    window: tuple[int, int]  # the primary endpoint's rounds (first, last), 1-based, inclusive
    seeds: int  # paired seeds 0..seeds-1 of every key arm


PARTITIONS = (Partition(0.05, 16, (7, 16), 11), Partition(0.5, 30, (21, 30), 16))
REFERENCE_SEEDS = 6  # FedNH, rerun with its corrected defaults (fednh.scale 20, max-grad-norm 10)

# (arm, minus arm, what it asks), at every partition; every row is one test in each endpoint's
# Holm family. The first four are the key contrasts, the last two references.
COMPARISONS = (
    ("tdcl-only", "tdcl-anchors", "TDCL-only vs TDCL-anchors: is it the teacher's knowledge?"),
    ("tdcl-only", "fedavg", "TDCL-only vs FedAvg"),
    ("feddifrc", "tdcl-only", "FedDifRC vs TDCL-only: what NDCR adds"),
    ("feddifrc", "fedavg", "FedDifRC vs FedAvg"),
    ("tdcl-anchors", "fedavg", "TDCL-anchors vs FedAvg (reference: anchors alone)"),
    ("fednh", "fedavg", "FedNH vs FedAvg (reference, 6 seeds)"),
)

# Every cell's settings beyond its conf file (the earlier run's, but for the rounds).
SETTINGS = {"train.local-epochs": 1, "train.lr": 0.05, "fraction-train": 0.5, "min-nodes": 10}
CELL_SECONDS = {16: 100.0, 30: 190.0}  # one cell on 2 idle cores (16 rounds measured; 30 estimated)
BUDGET_HOURS = 6.0

# The earlier 72-cell run: settings, and the commit whose defaults and conf files it ran with.
LEGACY_COMMIT = "e807f2b"
LEGACY_SETTINGS = {**SETTINGS, "num-server-rounds": 16}
LEGACY_CELLS = ROOT / "docs" / "method_effect" / "cells.json"
# Keys added since that run, with the value that reproduces it: the app's own list, and keys a
# resumed run may change (the app does not compare them) that cannot change a cell either.
NEUTRAL_SINCE_LEGACY: dict[str, Any] = {
    **KEYS_ADDED_SINCE,
    "min-nodes-timeout": 300.0,  # how long the server waits for nodes: not a result
    "max-frozen-rounds": 1,  # fails a frozen run; every earlier cell completed
    "server.device": "auto",
    # a cell's actor ran at the OMP_NUM_THREADS=1 Ray gives it (client-resources-num-cpus=1), as
    # train.threads = 0 reads it; no cell ran deterministic kernels (a CPU run has no other)
    "train.threads": 0,
    "train.deterministic": False,
}
# Keys that cannot change a cell's result.
NOT_RESULT_KEYS = {"outputs-dir", "run-name", "resume-from", "keep-checkpoints", "diffusion.cache-dir"} | {
    "tracking.backend",  # where the rows are also sent, not what they hold
    "tracking.dir",
    "tracking.project",
    "tracking.tags",
}
# Key prefixes only some methods read: a cell of another method ignores them.
METHOD_ONLY = {
    "fednh.": ("fednh",),
    "moon.": ("moon",),
    "ssl.": ("feddifrc-ssl",),
    "diffusion.": ("feddifrc", "feddifrc-ssl"),
    "loss.": ("feddifrc", "feddifrc-ssl"),
}


def flat_toml(text: str) -> dict[str, Any]:
    def walk(d: dict, prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out |= walk(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v}
        return out

    return walk(tomllib.loads(text))


def defaults_of(pyproject: str) -> dict[str, Any]:
    return {
        k.removeprefix("tool.flwr.app.config."): v
        for k, v in flat_toml(pyproject).items()
        if k.startswith("tool.flwr.app.config.")
    }


def grid(arm: Arm, part: Partition) -> dict[str, Any]:
    return {"partition.alpha": part.alpha, "num-server-rounds": part.rounds, **arm.overrides}


def seeds_of(arm: Arm, part: Partition) -> list[int]:
    return list(range(REFERENCE_SEEDS if arm.reference else part.seeds))


def cell_of(arm: Arm, part: Partition, seed: int) -> Cell:
    return Cell(str(ROOT / "conf" / f"mnist5k-{arm.conf}.toml"), seed, grid(arm, part))


def current_config(arm: Arm, part: Partition, seed: int) -> dict[str, Any]:
    """The planned cell's flat run config (what the sweep submits, before validation)."""
    defaults = defaults_of((ROOT / "pyproject.toml").read_text())
    conf = flat_toml((ROOT / "conf" / f"mnist5k-{arm.conf}.toml").read_text())
    return {**defaults, **conf, **SETTINGS, **grid(arm, part), "seed": seed}


def identity(config: dict[str, Any]) -> dict[str, Any]:
    """The keys that decide a cell's result (see the module docstring)."""
    method = config.get("method")
    return {
        k: v
        for k, v in config.items()
        if k not in NOT_RESULT_KEYS
        and not any(k.startswith(p) and method not in ms for p, ms in METHOD_ONLY.items())
    }


# ------------------------------------------------------------------ reusing the earlier run's cells

# The earlier run's arm labels this design may reuse: (conf file, grid beyond partition.alpha).
LEGACY_ARMS = {
    "fedavg": ("fedavg", {}),
    "tdcl-only [tiny-mnist]": ("tdcl-only", TEACHER),
    "feddifrc [tiny-mnist]": ("feddifrc", TEACHER),
    "fednh": ("fednh", {}),
}


class LegacyUnknown(Exception):
    """The earlier run's config cannot be rebuilt (no such label, no git, no such commit)."""


_SHOWN: dict[str, str] = {}


def git_show(path: str) -> str:
    """``path`` as it was at LEGACY_COMMIT."""
    if path not in _SHOWN:
        cp = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{LEGACY_COMMIT}:{path}"], capture_output=True, text=True
        )
        if cp.returncode != 0:
            raise LegacyUnknown(f"git show {LEGACY_COMMIT}:{path} failed: {cp.stderr.strip()[:200]}")
        _SHOWN[path] = cp.stdout
    return _SHOWN[path]


def recorded_config(entry: dict[str, Any]) -> dict[str, Any]:
    """A cells.json entry's run config: its own "config" (cells this design writes), else rebuilt
    from LEGACY_COMMIT's defaults and conf file with the earlier run's settings."""
    if "config" in entry:
        return entry["config"]
    if entry["arm"] not in LEGACY_ARMS:
        raise LegacyUnknown(f"earlier arm {entry['arm']!r} has no recorded config")
    conf, extra = LEGACY_ARMS[entry["arm"]]
    return {
        **defaults_of(git_show("pyproject.toml")),
        **flat_toml(git_show(f"conf/mnist5k-{conf}.toml")),
        **LEGACY_SETTINGS,
        "partition.alpha": entry["alpha"],
        **extra,
        "seed": entry["seed"],
    }


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Why a cell run with config ``old`` is not the cell ``new`` ([] = the same cell)."""
    a, b = identity(old), identity(new)
    out = []
    for k in sorted(a.keys() | b.keys()):
        if k in a and k in b:
            if a[k] != b[k]:
                out.append(f"{k}: {a[k]!r} -> {b[k]!r}")
        elif k in b:
            if k not in NEUTRAL_SINCE_LEGACY or NEUTRAL_SINCE_LEGACY[k] != b[k]:
                out.append(f"{k} = {b[k]!r} is new and not declared neutral at that value")
        else:
            out.append(f"{k} no longer exists")
    return out


# ------------------------------------------------------------------------------------ the plan


@dataclass
class Planned:
    arm: Arm
    part: Partition
    seed: int
    reuse: dict[str, Any] | None  # the earlier cells.json entry it reuses, or None: run it
    why_not: str = ""  # why no earlier cell is reused

    @property
    def cell(self) -> Cell:
        return cell_of(self.arm, self.part, self.seed)


def reuse_of(arm: Arm, part: Partition, seed: int, earlier: dict) -> Planned:
    if arm.teacher and NDCR_TARGET is None:
        return Planned(arm, part, seed, None, "NDCR target not chosen yet (NDCR_TARGET)")
    entry = earlier.get((arm.legacy, part.alpha, seed)) if arm.legacy else None
    if entry is None:
        return Planned(arm, part, seed, None, "new arm" if not arm.legacy else "no earlier cell")
    try:
        diff = differences(recorded_config(entry), current_config(arm, part, seed))
    except LegacyUnknown as e:
        diff = [str(e)]
    return Planned(arm, part, seed, None if diff else entry, "; ".join(diff))


def plan(entries: list[dict[str, Any]]) -> list[Planned]:
    """Every cell of the design, in running order: per partition, the key arms seed by seed (a run
    cut short keeps whole paired seeds), then the reference arms."""
    earlier = {(e["arm"], e["alpha"], e["seed"]): e for e in entries}
    out = []
    for part in PARTITIONS:
        for reference in (False, True):
            group = [a for a in arms() if a.reference == reference]
            for seed in range(max((len(seeds_of(a, part)) for a in group), default=0)):
                out += [reuse_of(a, part, seed, earlier) for a in group if seed in seeds_of(a, part)]
    return out


def cell_seconds(rounds: int) -> float:
    """CELL_SECONDS, linear in the rounds between (and beyond) its two points."""
    (r0, s0), (r1, s1) = sorted(CELL_SECONDS.items())
    return s0 + (rounds - r0) * (s1 - s0) / (r1 - r0)


def budget_seconds(planned: list[Planned]) -> float:
    return sum(cell_seconds(p.part.rounds) for p in planned if p.reuse is None)


def declared_design() -> list[str]:
    """The design, as `plan` and `run` print it before anything runs."""
    lines = ["Declared design (before any new result):"]
    for p in PARTITIONS:
        lines.append(
            f"  alpha {p.alpha:g}: {p.rounds} rounds; primary endpoint = mean test accuracy over rounds "
            f"{p.window[0]}-{p.window[1]}; key arms on seeds 0-{p.seeds - 1}, references on "
            f"0-{REFERENCE_SEEDS - 1}"
        )
    lines += [
        "  per seed: arm minus the other arm of the comparison; over seeds: mean, 95% paired t-interval,",
        "  two-sided paired t-test, sign count",
        "  secondary endpoint = mean test accuracy over the 5 rounds centred on the validation-best round",
        "  (first maximum), shifted (not shortened) to stay within rounds 1..R",
        "  Holm-Bonferroni over all comparisons of an endpoint (both alphas); 'helps' / 'hurts' only where",
        "  the adjusted primary test rejects at 0.05, else 'no detectable difference'",
        "  arms: " + ", ".join(f"{a.name} ({a.conf}.toml {json.dumps(a.overrides)})" for a in arms()),
        "  NDCR target (every teacher arm): "
        + ("NOT CHOSEN YET (NDCR_TARGET)" if NDCR_TARGET is None else json.dumps(NDCR_TARGET)),
        "  comparisons: " + "; ".join(what for _, _, what in COMPARISONS),
    ]
    return lines


def plan_text(planned: list[Planned], legacy: Path) -> list[str]:
    """The cells to run, the earlier cells reused (and why others are not), and the budget."""
    lines = ["Cells to run (in order):"]
    lines += [
        f"  run    {p.cell.name}  ~{cell_seconds(p.part.rounds):.0f} s  ({p.why_not})"
        for p in planned
        if p.reuse is None
    ]
    lines.append(f"Cells reused from {legacy}:")
    lines += [
        f"  reuse  {p.arm.name} alpha {p.part.alpha:g} seed {p.seed} (earlier arm {p.reuse['arm']!r})"
        for p in planned
        if p.reuse is not None
    ]
    run = [p for p in planned if p.reuse is None]
    total = budget_seconds(planned)
    for part in PARTITIONS:
        n = sum(p.part == part for p in run)
        lines.append(f"  alpha {part.alpha:g}: {n} cells x ~{cell_seconds(part.rounds):.0f} s")
    lines.append(
        f"Budget: {len(run)} cells to run, {len(planned) - len(run)} reused; ~{total / 3600:.2f} h on "
        f"2 idle cores (limit {BUDGET_HOURS:g} h){'' if total <= BUDGET_HOURS * 3600 else ': OVER BUDGET'}"
    )
    return lines
