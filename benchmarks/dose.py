"""Does a teacher that knows more than the federation pass it on? The teacher-knowledge dose
experiment (design: dose_design.py and docs/method_effect/dose/design.md).

    python benchmarks/dose.py teachers   # T-big, T-small, the untrained control (pretrain-teacher)
    python benchmarks/dose.py gate       # gate.json: matching, prompt effect, probes; the setting
    python benchmarks/dose.py decide     # the declared rules again on gate.json's measures
    python benchmarks/dose.py confs      # the arms' conf files for the chosen setting
    python benchmarks/dose.py fill       # every cell's feature cache, filled once, in one process
    python benchmarks/dose.py plan       # the cells, what is done, the budget
    python benchmarks/dose.py run        # the paired cells (resumable at any cell)
    python benchmarks/dose.py table      # cells.json, paired.json, curves.png

Every cell is a real `flwr run .` in Flower's Ray simulation engine through `feddifrc sweep`'s
code (method_effect.run_lanes): a finished cell is reused only when its run config is identical,
an interrupted one resumes from its checkpoint.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import dose_design as design
import dose_gate as gate_measures
import numpy as np
from method_effect import TEST, VAL, curve, load_runs, plot_curves, run_lanes
from method_effect_stats import holm, paired, verdict, window_mean

from feddifrc_app.files import write_json
from feddifrc_app.tools.sweep import Cell, toml_value

OUT = design.ROOT / "benchmarks" / "out" / "dose"
TORCH_THREADS = 2  # extraction (gate and fill) always runs with this many threads


def pairs(settings: dict) -> str:
    return " ".join(f"{k}={toml_value(v)}" for k, v in settings.items())


# ------------------------------------------------------------------------------------ teachers


def train_teachers() -> dict:
    """Each missing teacher from `feddifrc pretrain-teacher` (same recipe and steps; only the data
    and, for the control, the steps differ), its CPU seconds recorded in teachers.json."""
    path, record = design.DOSE / "teachers.json", {}
    if path.is_file():
        record = json.loads(path.read_text())
    for t in design.TEACHER_LIST:
        if (t.folder / "feddifrc.json").is_file():  # built: never trained twice
            record.setdefault(t.name, {"command": "(not recorded)", "cpu_seconds": None})
            continue
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        wall = time.perf_counter()
        cmd = ["feddifrc", "pretrain-teacher", "--app", str(design.ROOT), "--out", str(t.folder)]
        cmd += [
            "--name",
            t.name,
            "--no-progress",
            *t.pretrain,
            "--run-config",
            f"dataset.name='{design.DATASET}'",
        ]
        subprocess.run(cmd, check=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        record[t.name] = {
            "command": " ".join(cmd[:2] + cmd[4:]),
            "cpu_seconds": round(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, 1),
            "wall_seconds": round(time.perf_counter() - wall, 1),
        }
        write_json(path, record)
    for t in design.TEACHER_LIST:  # what each one saw, from its own folder
        marker = json.loads((t.folder / "feddifrc.json").read_text())
        record[t.name] |= {"data": marker["data"], "random_weights": marker["random_weights"]}
    write_json(path, record)
    return record


# ---------------------------------------------------------------------------------------- gate


def teacher_config(folder: Path, setting: dict, seed: int, cache_dir: Path):
    from feddifrc_app.tools.run_config import load_app_config

    keys = {**design.SETTINGS, "method": "feddifrc", "loss.ndcr-weight": 0.0, **setting}
    keys |= {"diffusion.model": str(folder), "seed": seed, "diffusion.cache-dir": str(cache_dir)}
    return load_app_config(design.ROOT, [pairs(keys)])


def gate(out: Path) -> dict:
    """Every teacher x candidate setting, on the pool's 500 validation digits (the choice is made
    there) and on the clients' 500 (no teacher saw them): gate.json."""
    import torch
    from teacher_quality import teacher_features

    from feddifrc_app.data.registry import load_dataset

    torch.set_num_threads(TORCH_THREADS)
    result: dict = {"sets": {}, "settings": {}, "rule": {}}
    for name, setting in design.CANDIDATES.items():
        rows = result["settings"][name] = {}
        for t in design.TEACHER_LIST:
            cfg = teacher_config(t.folder, setting, design.GATE_SEED, out / "gate-cache")
            rows[t.name] = {}
            for split in ("val", "train"):
                data = load_dataset(cfg.dataset, split)
                result["sets"][split] = {"images": len(data), "fingerprint": data.fingerprint}
                raw, _, _ = teacher_features(cfg, out / "gate-cache", data)
                pixels = data.images[:, 0].numpy()
                rows[t.name][split] = gate_measures.measures(raw, data.labels, pixels)
                m = rows[t.name][split]
                print(
                    f"{name:45s} {t.name:10s} {split:5s} matching {m['matching']['mean']:.3f} "
                    f"[{m['matching']['lo']:.3f}, {m['matching']['hi']:.3f}]  prompt effect "
                    f"{m['prompt-effect']['mean']:.3f}  targets ncc {m['targets-ncc']['mean']:.3f} "
                    f"(pixels {m['pixels-ncc']['mean']:.3f})",
                    flush=True,
                )
    result["seed"], result["torch_threads"] = design.GATE_SEED, TORCH_THREADS
    return decide(result)


def decide(result: dict) -> dict:
    """The declared rules applied to the gate's measures: the setting, and whether cells run."""
    big_val = {name: rows["t-big"]["val"] for name, rows in result["settings"].items()}
    chosen = gate_measures.choose_setting(
        big_val, design.MIN_PROMPT_EFFECT, key=lambda m: m["matching"]["mean"]
    )
    matching = big_val[chosen]["matching"] if chosen else None
    result["setting"] = chosen
    result["proceed"] = bool(chosen) and gate_measures.passes(matching, big_val[chosen]["chance"])
    result["rule"] = {
        "setting": f"highest T-big label-free matching on the validation set among settings with "
        f"T-big prompt effect >= {design.MIN_PROMPT_EFFECT}",
        "stop": "stop if T-big's label-free matching 95% interval (validation set, chosen setting) "
        "includes chance (0.10); an interval wholly below chance excludes it (design.md, amendment)",
    }
    write_json(design.GATE, result)
    print(f"setting: {chosen}; proceed: {result['proceed']}")
    return result


# --------------------------------------------------------------------------------- cells


def write_confs() -> list[design.Arm]:
    setting = design.chosen_setting()
    if setting is None:
        raise SystemExit("dose: gate.json has no chosen setting, or the gate stopped the experiment")
    arms = design.arms(setting)
    design.CONFS.mkdir(parents=True, exist_ok=True)
    for arm in arms:
        text = "".join(f"{k} = {toml_value(v)}\n" for k, v in {**arm.conf}.items())
        design.conf_path(arm).write_text(f"# dose arm {arm.name} (benchmarks/dose_design.py)\n{text}")
    return list(arms)


def cells(seeds: int) -> list[Cell]:
    """Seed by seed, every arm (a run cut short keeps whole paired seeds)."""
    arms = design.arms(design.chosen_setting() or {})
    return [Cell(str(design.conf_path(a)), s, {}) for s in range(seeds) for a in arms]


def settings(out: Path) -> dict:
    return {**design.SETTINGS, "keep-checkpoints": 1, "diffusion.cache-dir": str(out / "cache")}


def fill(out: Path, seeds: int) -> dict:
    """Every teacher arm's features for every seed, extracted in THIS process (one layout, one
    thread count) before any cell: a cell then only reads them. cache.json: keys and hit checks."""
    import torch

    from feddifrc_app.tools.cli import main as feddifrc

    torch.set_num_threads(TORCH_THREADS)
    record = {}
    for arm in design.arms(design.chosen_setting() or {}):
        if arm.teacher is None or arm.teacher in record:
            continue
        for seed in range(seeds):
            args = ["--app", str(design.ROOT), "--cache-dir", str(out / "cache"), "--no-progress"]
            args += ["--run-config", pairs({**settings(out), **arm.conf, "seed": seed})]
            if feddifrc(["extract", *args]) != 0:
                raise SystemExit(f"dose fill: extraction failed for {arm.name} seed {seed}")
        record[arm.teacher] = {"seeds": seeds, "torch_threads": TORCH_THREADS}
    write_json(out / "cache.json", record)
    return record


def seeds_planned(out: Path) -> int:
    path = out / "reestimate.json"
    return json.loads(path.read_text())["seeds"] if path.is_file() else design.SEEDS


def entries(out: Path) -> list[dict]:
    arms = {str(design.conf_path(a)): a.name for a in design.arms(design.chosen_setting() or {})}
    rows = []
    for run in load_runs(out / "run"):
        arm = arms.get(run["cell"]["conf"])
        if arm is None:
            continue
        basis = run["results"].extra.get("basis", {})
        rows.append(
            {
                "arm": arm,
                "alpha": run["config"]["partition.alpha"],
                "seed": run["config"]["seed"],
                "test": curve(run, TEST).round(4).tolist(),
                "val": curve(run, VAL).round(4).tolist(),
                "basis": basis.get("fingerprint"),
                "config": run["config"],
                "platforms": run["results"].platforms,  # where it ran: cells compare on one kernel set
            }
        )
    return sorted(rows, key=lambda e: (e["seed"], e["arm"]))


def compare(rows: list[dict], family: tuple = design.COMPARISONS) -> list[dict]:
    """paired.json: one record per declared comparison of ``family``, Holm over these tests only."""
    by = {(e["arm"], e["seed"]): window_mean(e["test"], *design.WINDOW) for e in rows}
    out = []
    for a, b, what in family:
        seeds = sorted(s for (arm, s) in by if arm == a and (b, s) in by)
        t = paired([by[(a, s)] - by[(b, s)] for s in seeds])
        out.append(
            {"a": a, "b": b, "what": what, "alpha": design.SETTINGS["partition.alpha"],
             "window": list(design.WINDOW), "seeds": seeds, "mean": t["mean"], "lo": t["lo"],
             "hi": t["hi"], "sd": t["sd"], "p": t["p"], "pos": t["pos"], "neg": t["neg"]}
        )  # fmt: skip
    for row, p in zip(out, holm([r["p"] for r in out]), strict=True):
        row["p-holm"] = p
        row["verdict"] = verdict({"n": len(row["seeds"]), "mean": row["mean"]}, p)
    return out


def reestimate(out: Path, rows: list[dict]) -> None:
    """Once REESTIMATE_AT whole seeds are done: the blinded pooled SD and the seeds it implies."""
    path = out / "reestimate.json"
    have = {(e["arm"], e["seed"]) for e in rows}
    declared = {a for c in design.COMPARISONS for a in c[:2]}
    done = {s for s in range(design.REESTIMATE_AT) if all((a, s) in have for a in declared)}
    if path.is_file() or len(done) < design.REESTIMATE_AT:
        return
    by = {(e["arm"], e["seed"]): window_mean(e["test"], *design.WINDOW) for e in rows}
    diffs = {f"{a}-{b}": [by[(a, s)] - by[(b, s)] for s in sorted(done)] for a, b, _ in design.COMPARISONS}
    sd = design.pooled_sd(diffs)
    n = design.seeds_needed(sd)
    write_json(path, {"at_seeds": len(done), "pooled_sd": sd, "limit": design.SD_LIMIT, "seeds": n})
    print(f"blinded re-estimate at {len(done)} seeds: pooled paired SD {sd:.2f} -> {n} seeds")


def table(out: Path) -> None:
    rows = entries(out)
    design.DOSE.mkdir(parents=True, exist_ok=True)
    write_json(design.DOSE / "cells.json", rows)
    result = compare(rows)
    write_json(design.DOSE / "paired.json", result)
    control = compare(rows, design.CONTROL)  # amendment 2: its own family
    if any(r["seeds"] for r in control):
        write_json(design.DOSE / "paired-control.json", control)
    result += control
    for arm in sorted({e["arm"] for e in rows}):
        es = [e for e in rows if e["arm"] == arm]
        v = np.array([window_mean(e["test"], *design.WINDOW) for e in es])
        final = np.array([100 * e["test"][-1] for e in es])
        best = np.array([100 * max(e["test"]) for e in es])
        last5 = np.array([window_mean(e["test"], 26, 30) for e in es])
        sd = lambda x: f"{x.std(ddof=1):.1f}" if len(x) > 1 else "-"  # noqa: E731
        print(
            f"{arm:14s} n={len(es):2d} endpoint {v.mean():.1f} ± {sd(v)}  final {final.mean():.1f} ± "
            f"{sd(final)}  best {best.mean():.1f} ± {sd(best)}  last5 {last5.mean():.1f} ± {sd(last5)}"
        )
    for r in result:
        print(
            f"{r['what']}: {r['mean']:+.2f} [{r['lo']:+.2f}, {r['hi']:+.2f}] n={len(r['seeds'])} "
            f"p={r['p']:.3f} Holm {r['p-holm']:.3f}: {r['verdict']}"
        )
    if rows:
        plot_curves(rows, design.DOSE / "curves.png")


def run(out: Path, args) -> int:
    failed = 0
    while True:
        seeds = seeds_planned(out)
        fill(out, seeds)  # a no-op where filled: every cell's features exist before it runs
        todo = cells(seeds)
        failed = run_lanes(out / "run", todo, settings(out), 1, args.cell_timeout)
        reestimate(out, entries(out))
        if seeds_planned(out) == seeds or failed:
            break
    table(out)
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    stages = ("teachers", "gate", "decide", "confs", "fill", "plan", "run", "table")
    ap.add_argument("stage", choices=stages)
    ap.add_argument("--out", default=str(OUT), help="working folder (runs, caches)")
    ap.add_argument("--cell-timeout", type=float, default=1800)
    args = ap.parse_args()
    out = Path(args.out).resolve()
    if args.stage == "teachers":
        print(json.dumps(train_teachers(), indent=1))
    elif args.stage == "gate":
        gate(out)
    elif args.stage == "decide":  # the rules again on gate.json's measures (nothing extracted)
        decide(json.loads(design.GATE.read_text()))
    elif args.stage == "confs":
        print("\n".join(str(design.conf_path(a)) for a in write_confs()))
    elif args.stage == "fill":
        fill(out, seeds_planned(out))
    elif args.stage == "plan":
        n = len(cells(seeds_planned(out)))
        hours = n * design.CELL_SECONDS / 3600
        print(f"{n} cells x ~{design.CELL_SECONDS:.0f} s = ~{hours:.1f} h on 2 idle cores")
    elif args.stage == "run":
        return run(out, args)
    else:
        table(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
