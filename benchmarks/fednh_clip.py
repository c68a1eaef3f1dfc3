"""FedNH's gain, decomposed (issue 44 item 7): FedAvg with FedNH's gradient clipping beside FedNH.

    python benchmarks/fednh_clip.py run --out DIR     # recheck run2's cells, then FedAvg+clip (resumable)
    python benchmarks/fednh_clip.py table --out DIR   # docs/method_effect/fednh_clip/: cells, summary, README
    python benchmarks/fednh_clip.py run --out DIR2 --alphas 0.5   # one partition, on another machine:
    # `table --out DIR2` keeps the docs' cells of the other alphas when they came from the same commit

run2 (docs/method_effect/run2/) found FedNH (fednh.scale 20, fednh.max-grad-norm 10) far above
FedAvg, but FedNH clipped its local gradients at norm 10 and FedAvg did not. The arm
``fedavg-clip`` is run2's FedAvg cell with ``train.max-grad-norm = 10.0``, on FedNH's 6 seeds at
both of run2's partitions (rounds, window, settings: method_effect_design.py). ``run`` first reruns
run2's FedAvg and FedNH seed 0 at each alpha with run2's exact cell config: if any per-round curve
differs from run2's cells.json, run2's cells do not come from this code, and FedAvg and FedNH
seeds 0-5 are rerun here too, so every compared cell comes from the same code. ``table`` reports,
per alpha over paired seeds, FedNH - FedAvg, FedAvg+clip - FedAvg and FedNH - FedAvg+clip on
run2's primary endpoint (mean test accuracy over the window) with 95% t-intervals: described, not
tested (no Holm family, no verdict).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import method_effect as me
import method_effect_design as design
import numpy as np
from method_effect_stats import endpoints, fmt_paired, paired

ROOT = design.ROOT
RUN2 = ROOT / "docs" / "method_effect" / "run2" / "cells.json"
DOCS = ROOT / "docs" / "method_effect" / "fednh_clip"
CLIP = {"train.max-grad-norm": 10.0}  # FedNH's own clipping (fednh.max-grad-norm in run2)
BASE = {a.name: a for a in design.arms() if a.name in ("fedavg", "fednh")}
FEDAVG_CLIP = design.Arm("fedavg-clip", "fedavg", CLIP, reference=True)
SEEDS = range(design.REFERENCE_SEEDS)
CONTRASTS = (  # (arm, minus arm, what it measures)
    ("fednh", "fedavg", "FedNH - FedAvg"),
    ("fedavg-clip", "fedavg", "FedAvg+clip - FedAvg (clipping alone)"),
    ("fednh", "fedavg-clip", "FedNH - FedAvg+clip (FedNH's head beyond clipping)"),
)
DESCRIBED = ("primary", "final", "best", "last5")
# Passes over a list of cells: under heavy load `flwr run` can fail to start its local SuperLink
# within flwr's fixed 15 s (the cell fails at submit, nothing ran); a pass reruns only unfinished cells.
PASSES = 5


def arm_of(cell: dict) -> str | None:
    extra = {k: v for k, v in cell["grid"].items() if k not in ("partition.alpha", "num-server-rounds")}
    return FEDAVG_CLIP.name if extra == CLIP else me.design_arm(cell)


def entry(run: dict) -> dict:
    """A finished cell in run2's cells.json record format."""
    return {**me.entry(run), "arm": arm_of(run["cell"])}


def code_version() -> dict:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()

    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "tracked-changes": git("status", "--porcelain", "-uno"),
    }


def recheck(runs: list[dict], run2: list[dict]) -> dict:
    """This code's seed-0 FedAvg / FedNH cells against run2's: largest per-round difference (points)
    of the test and validation curves, and any difference of run config (design.differences)."""
    old = {(e["arm"], e["alpha"], e["seed"]): e for e in run2}
    rows = []
    for run in runs:
        new = entry(run)
        if new["arm"] not in BASE or new["seed"] != 0:
            continue
        was = old[(new["arm"], new["alpha"], 0)]
        gap = {k: 100 * float(np.abs(np.subtract(new[k], was[k])).max()) for k in ("test", "val")}
        diff = design.differences(was["config"], new["config"])
        same = gap["test"] == gap["val"] == 0 and not diff
        row = {"arm": new["arm"], "alpha": new["alpha"], "seed": 0, "same": same, "max-diff-points": gap}
        rows.append({**row, "config-diff": diff})
    return {
        "cells": rows,
        "identical": len(rows) == 2 * len(design.PARTITIONS) and all(r["same"] for r in rows),
    }


def earlier_check(here: list[dict]) -> list[dict]:
    """This code's FedAvg / FedNH cells against the earlier 72-cell run's (design.LEGACY_CELLS) where
    the design counts that cell as the same cell (design.reuse_of): largest per-round difference."""
    earlier = {(e["arm"], e["alpha"], e["seed"]): e for e in me.read_legacy(design.LEGACY_CELLS)}
    parts = {p.alpha: p for p in design.PARTITIONS}
    rows = []
    for e in here:
        if e["arm"] in BASE and (
            was := design.reuse_of(BASE[e["arm"]], parts[e["alpha"]], e["seed"], earlier).reuse
        ):
            gap = {k: 100 * float(np.abs(np.subtract(e[k], was[k])).max()) for k in ("test", "val")}
            rows.append({"arm": e["arm"], "alpha": e["alpha"], "seed": e["seed"], "max-diff-points": gap})
    return rows


def summarise(entries: list[dict]) -> dict:
    """Per alpha: each arm's endpoints (mean, SD, seeds) and the three paired contrasts on the
    primary endpoint (window of run2's partition) over the seeds both arms have, with the number of
    seeds whose two cells have identical curves (a clip that never engages changes nothing)."""
    out = {}
    for part in design.PARTITIONS:
        by: dict[str, dict[int, dict]] = {}
        curves: dict[tuple[str, int], tuple] = {}
        for e in entries:
            if e["alpha"] == part.alpha:
                by.setdefault(e["arm"], {})[e["seed"]] = endpoints(e["val"], e["test"], part.window)
                curves[e["arm"], e["seed"]] = (e["val"], e["test"])
        arms = {
            arm: {
                "seeds": sorted(cells),
                **{
                    k: {
                        "mean": float(np.mean(v := [c[k] for c in cells.values()])),
                        "sd": float(np.std(v, ddof=1)) if len(v) > 1 else float("nan"),
                    }
                    for k in DESCRIBED
                },
            }
            for arm, cells in sorted(by.items())
        }
        contrasts = []
        for a, b, what in CONTRASTS:
            x, y = by.get(a, {}), by.get(b, {})
            seeds = sorted(set(x) & set(y))
            t = paired([x[s]["primary"] - y[s]["primary"] for s in seeds])
            t["p-unadjusted"] = t.pop("p")
            t["identical-curves"] = sum(curves[a, s] == curves[b, s] for s in seeds)
            contrasts.append({"what": what, "arm": a, "minus": b, "seeds": seeds, **t})
        out[f"{part.alpha:g}"] = {
            "rounds": part.rounds,
            "window": list(part.window),
            "arms": arms,
            "contrasts": contrasts,
        }
    return out


def readme(summary: dict, check: dict, code: dict, source: str, earlier: list[dict] = ()) -> str:
    lines = [*_recheck(check, code, earlier), "", source, "", *_contrasts(summary), *_arms(summary)]
    lines += [
        "",
        "Files: `cells.json` (every cell run here, run2's record format: arm, alpha, seed, val, test, "
        "config), `summary.json` (the numbers above; `recheck`, `code`).",
        "",
    ]
    return "\n".join(lines)


def _recheck(check: dict, code: dict, earlier: list[dict]) -> list[str]:
    """The README's head: what was run, at which commit, and the recheck of run2's cells."""
    lines = [
        "# FedNH's gain, decomposed: FedAvg with FedNH's gradient clipping",
        "",
        "Issue 44 item 7. run2 ([../run2/](../run2/)) found FedNH (`fednh.scale = 20`, "
        "`fednh.max-grad-norm = 10`) far above FedAvg, but FedNH clipped local gradients at norm 10 and "
        "FedAvg did not. `fedavg-clip` is run2's FedAvg cell config plus `train.max-grad-norm = 10.0`; "
        "everything else (mnist-5k, 10 simulated nodes, 5 sampled per round, NID1 Dirichlet partitions, "
        "run2's rounds, window, lr 0.05, 1 local epoch) is run2's, on seeds 0-5 as run2's FedNH.",
        "",
        f"Every cell here ran at commit `{code['commit']}` "
        + (
            "(no tracked file changed"
            if not code["tracked-changes"]
            else f"(local changes: {code['tracked-changes']}"
        )
        + "; this driver, benchmarks/fednh_clip.py, came later): `python benchmarks/fednh_clip.py run "
        "--out DIR`, then `table --out DIR`.",
        "",
        "**Recheck**: run2's FedAvg and FedNH seed 0 at each alpha, rerun with run2's cell config at that "
        "commit; largest per-round difference from run2's cells.json (points):",
        "",
        "| arm | alpha | test | validation | config differences |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in check["cells"]:
        g, diff = r["max-diff-points"], "; ".join(r["config-diff"]) or "none"
        lines.append(f"| {r['arm']} | {r['alpha']:g} | {g['test']:.2f} | {g['val']:.2f} | {diff} |")
    if earlier:
        same = sum(r["max-diff-points"]["test"] == r["max-diff-points"]["val"] == 0 for r in earlier)
        worst = max(max(r["max-diff-points"].values()) for r in earlier)
        cells = ", ".join(f"{r['arm']} alpha {r['alpha']:g} seed {r['seed']}" for r in earlier)
        lines += [
            "",
            f"The same cells against the earlier 72-cell run ({design.LEGACY_COMMIT}, "
            f"[../cells.json](../cells.json)), where the design counts its cell as the same cell: "
            f"{same} of {len(earlier)} identical in every round (largest difference {worst:.2f} "
            f"points; {cells}).",
        ]
    return lines


def _contrasts(summary: dict) -> list[str]:
    """Per alpha, the paired differences on run2's primary endpoint."""
    lines = [
        "Per alpha, over paired seeds, on run2's primary endpoint (mean test accuracy over the window "
        "rounds), each difference's mean in points with a 95% t-interval and the sign count (+/-). "
        "**Described, not tested**: these are in no Holm family and carry no verdict. Last column: seeds "
        "whose two cells have the same validation and test accuracy in every round (FedAvg+clip = FedAvg: "
        "no local gradient norm reached 10, so the clip never changed a step).",
        "",
        "| alpha | window | difference | n | mean [95% CI] (+/-) | seeds with identical curves |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for alpha, s in summary.items():
        for c in s["contrasts"]:
            ci = fmt_paired(c) if c["n"] > 1 else f"{c['mean']:+.1f} (no interval)" if c["n"] else "-"
            w = f"{s['window'][0]}-{s['window'][1]}"
            lines.append(f"| {alpha} | {w} | {c['what']} | {c['n']} | {ci} | {c['identical-curves']} |")
    return lines


def _arms(summary: dict) -> list[str]:
    """Each arm's mean and SD over seeds."""
    lines = [
        "",
        "Each arm, mean ± SD over seeds (test accuracy, %):",
        "",
        "| alpha | arm | n | window mean | final | best | mean of last 5 |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for alpha, s in summary.items():
        for arm, a in s["arms"].items():
            sd = {k: "-" if len(a["seeds"]) < 2 else f"{a[k]['sd']:.1f}" for k in DESCRIBED}
            m = " | ".join(f"{a[k]['mean']:.1f} ± {sd[k]}" for k in DESCRIBED)
            lines.append(f"| {alpha} | {arm} | {len(a['seeds'])} | {m} |")
    return lines


def run(out: Path, timeout: float, alphas: tuple[float, ...]) -> int:
    """Per partition of `alphas` (alpha 0.05 first: its cells are the cheaper), the recheck's seed-0
    cells, then FedAvg+clip on every seed, with FedAvg and FedNH too once any recheck differs."""
    extra = {**design.SETTINGS, "keep-checkpoints": 1, "diffusion.cache-dir": str(out / "cache")}
    parts = [p for p in design.PARTITIONS if p.alpha in alphas]

    def lanes(cells: list) -> int:
        failed = 0
        for _ in range(PASSES):
            if not (failed := me.run_lanes(out / "run", cells, extra, 1, timeout)):
                break
        return failed

    failed = 0

    def checked() -> dict:
        check = recheck(me.load_runs(out / "run"), json.loads(RUN2.read_text()))
        (out / "recheck.json").write_text(json.dumps({**check, "code": code_version()}, indent=1) + "\n")
        print(json.dumps(check, indent=1), flush=True)
        return check

    for part in parts:
        if lanes([design.cell_of(BASE[a], part, 0) for a in BASE]):
            return 1
        check = checked()
        same = all(r["same"] for r in check["cells"])
        arms = [FEDAVG_CLIP] + ([] if same else list(BASE.values()))
        failed += lanes([design.cell_of(a, part, s) for s in SEEDS for a in arms])
    if not all(r["same"] for r in checked()["cells"]):  # a later recheck differed: base cells from here
        failed += lanes([design.cell_of(a, p, s) for p in parts for s in SEEDS for a in BASE.values()])
    return 1 if failed else 0


def merged(here: list[dict], check: dict, code: dict, docs: Path) -> tuple[list[dict], dict]:
    """This run's cells and recheck, plus the docs' earlier ones for the cells (and rechecks) this run
    did not make, where the earlier ones came from the same commit (a run resumed on a new machine
    for the alphas it had not finished); a cell run here replaces the earlier record of that cell."""
    if not (docs / "summary.json").exists():
        return here, check
    earlier = json.loads((docs / "summary.json").read_text())
    if earlier["code"] != code:
        raise SystemExit(f"{docs}: its cells came from {earlier['code']}, this run from {code}: not merged")
    key = lambda e: (e["arm"], e["alpha"], e["seed"])  # noqa: E731
    new = {key(e) for e in here} | {key(r) for r in check["cells"]}
    kept = [e for e in json.loads((docs / "cells.json").read_text()) if key(e) not in new]
    rows = [r for r in earlier["recheck"]["cells"] if key(r) not in new] + check["cells"]
    rows.sort(key=key)
    identical = len(rows) == 2 * len(design.PARTITIONS) and all(r["same"] for r in rows)
    return sorted(kept + here, key=key), {"cells": rows, "identical": identical}


def table(out: Path, docs: Path) -> None:
    saved = json.loads((out / "recheck.json").read_text())
    code = saved.pop("code")
    ran = [entry(r) for r in me.load_runs(out / "run")]
    here, saved = merged(ran, saved, code, docs)
    kept = sorted({e["alpha"] for e in here} - {e["alpha"] for e in ran})
    if saved["identical"]:
        run2 = [e for e in json.loads(RUN2.read_text()) if e["arm"] in BASE and e["seed"] in SEEDS]
        compared = run2 + [e for e in here if e["arm"] == FEDAVG_CLIP.name]
        source = (
            "The recheck reproduced run2's cells exactly: FedAvg and FedNH are run2's cells (seeds 0-5), "
            "FedAvg+clip the cells run here."
        )
    else:
        compared = here
        source = (
            "The recheck did NOT reproduce run2's cells, so FedAvg and FedNH seeds 0-5 are rerun here: "
            "every compared cell (all three arms) comes from the commit above, none from run2."
        )
    planned = len(CONTRASTS) * len(design.PARTITIONS) * len(SEEDS)  # 3 arms
    source += f" Cells compared: {len(compared)} of {planned} planned"
    if len(compared) < planned:
        source += " (the run is not finished: `run` again resumes it; n below is what had finished)"
    source += "."
    if kept:
        alphas = ", ".join(f"{a:g}" for a in kept)
        source += (
            f" The alpha {alphas} cells ran in an earlier sitting at the same commit, on another "
            "machine: this table keeps them from its own earlier record."
        )
    summary = summarise(compared)
    docs.mkdir(parents=True, exist_ok=True)
    (docs / "cells.json").write_text(json.dumps(here) + "\n")
    earlier = earlier_check(here)
    body = {"code": code, "recheck": saved, "earlier-run-check": earlier, "compared-cells": source}
    body["alphas"] = summary
    (docs / "summary.json").write_text(json.dumps(body, indent=1) + "\n")
    text = readme(summary, saved, code, source, earlier)
    (docs / "README.md").write_text(text)
    print(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("stage", choices=("run", "table"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "fednh_clip"))
    ap.add_argument(
        "--docs", default=str(DOCS), help="where `table` writes cells.json, summary.json, README.md"
    )
    ap.add_argument("--cell-timeout", type=float, default=1800)
    alphas = ",".join(f"{p.alpha:g}" for p in design.PARTITIONS)
    ap.add_argument("--alphas", default=alphas, help=f"`run`: the partitions to run (default {alphas})")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    if args.stage == "run":
        return run(out, args.cell_timeout, tuple(float(a) for a in args.alphas.split(",")))
    table(out, Path(args.docs).resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
