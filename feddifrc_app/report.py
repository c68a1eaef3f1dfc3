"""results.json -> plots and text tables, for one run or a sweep of runs (matplotlib, headless)."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display on servers / in Ray workers
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from feddifrc_app.files import atomic_write  # noqa: E402


def _save(fig: plt.Figure, path: Path) -> None:
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120, bbox_inches="tight"))
    plt.close(fig)


def plot_accuracy(results: dict[str, Any], path: Path) -> None:
    """Validation and test accuracy per round (round 0 = the initial model), summary in the title."""
    s = results.get("summary", {})
    fig, ax = plt.subplots(figsize=(6, 4))
    for split in ("val", "test"):
        rows = [r for r in results["rounds"] if r.get(f"{split}-accuracy") is not None]
        if rows:
            ax.plot(
                [r["round"] for r in rows],
                [100 * r[f"{split}-accuracy"] for r in rows],
                marker="o",
                ms=3,
                label={"val": "validation", "test": "test"}[split],
            )
    ax.legend(fontsize=8)
    ax.set_xlabel("round")
    ax.set_ylabel("accuracy (%)")
    title = f"{results.get('method', '')} / {results.get('strategy', '')} on {results.get('dataset', '')}"
    if s.get("final-accuracy") is not None:
        title += (
            f"\nfinal {100 * s['final-accuracy']:.2f}  best {100 * s['best-accuracy']:.2f}  "
            f"mean-last-5 {100 * s['mean-last-5-accuracy']:.2f}"
        )
        if s.get("test-at-val-best-accuracy") is not None:
            title += f"  at val-best round {s['val-best-round']}: {100 * s['test-at-val-best-accuracy']:.2f}"
    if results.get("teacher", {}).get("random-weights"):
        title += "\n(teacher has RANDOM weights: not evidence that FedDifRC helps)"
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    _save(fig, path)


def plot_label_distribution(counts: np.ndarray, class_names: list[str], path: Path, title: str) -> None:
    """Stacked bars: per client (x) the number of training samples of each class."""
    m, c = counts.shape
    fig, ax = plt.subplots(figsize=(max(5, 0.6 * m + 2), 4))
    bottom = np.zeros(m)
    cmap = plt.get_cmap("tab20", max(c, 1))
    for k in range(c):
        label = class_names[k] if c <= 20 else None
        ax.bar(np.arange(m), counts[:, k], bottom=bottom, color=cmap(k), label=label)
        bottom += counts[:, k]
    ax.set_xticks(np.arange(m))
    ax.set_xlabel("client (partition id)")
    ax.set_ylabel("training samples")
    ax.set_title(title, fontsize=9)
    if c <= 20:
        ax.legend(fontsize=6, ncol=2, bbox_to_anchor=(1.01, 1), loc="upper left")
    _save(fig, path)


def format_table(results: dict[str, Any]) -> str:
    """A plain-text per-round table plus the summary line."""
    keys = "round val-accuracy test-accuracy test-loss train-ce train-tdcl train-ndcr nodes failures seconds"
    keys = keys.split()
    lines = ["  ".join(f"{k:>13}" for k in keys)]
    for r in results["rounds"]:
        row = []
        for k in keys:
            v = r.get(k, r.get("train-metrics", {}).get(k))
            if isinstance(v, list):
                v = len(v)
            row.append(f"{v:>13.4f}" if isinstance(v, float) else f"{'' if v is None else v!s:>13}")
        lines.append("  ".join(row))
    s = results.get("summary", {})
    if s.get("final-accuracy") is not None:
        lines.append(
            f"final {100 * s['final-accuracy']:.2f}%  best {100 * s['best-accuracy']:.2f}%  "
            f"mean of last 5 {100 * s['mean-last-5-accuracy']:.2f}%"
        )
        if s.get("test-at-val-best-accuracy") is not None:
            lines[-1] += (
                f"  test at the best validation round ({s['val-best-round']}) "
                f"{100 * s['test-at-val-best-accuracy']:.2f}%"
            )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- sweeps

_SUMMARY = ("final-accuracy", "best-accuracy", "mean-last-5-accuracy")
_DATASET_TAGS = re.compile(
    r"^(cifar10|cifar100|mnist5k|digits|tiny-imagenet|image-folder)-(nid1-a[0-9.]+-|nid2-|iid-)?"
)


def method_label(conf: str, grid: dict[str, Any]) -> str:
    """The row of a cell: its conf file's name without the dataset and partition tags, and any
    grid value that is not a setting (e.g. ``feddifrc [model=tiny-mnist-untrained]``)."""
    stem = Path(conf).stem if conf else "defaults"
    extra = [
        f"{k.rsplit('.', 1)[-1]}={Path(str(v)).name}"
        for k, v in sorted(grid.items())
        if not k.startswith(("partition.", "dataset."))
    ]
    return (_DATASET_TAGS.sub("", stem) or stem) + (f" [{', '.join(extra)}]" if extra else "")


def setting_label(config: dict[str, Any]) -> str:
    """The column of a cell: dataset and partition from its resolved config.json."""
    part = config["partition.name"]
    if part == "dirichlet":
        return f"{config['dataset.name']} NID1 alpha={config['partition.alpha']:g}"
    if part == "pathological":
        return f"{config['dataset.name']} {config['partition.classes-per-client']} classes/client"
    return f"{config['dataset.name']} iid"


def collect(sweep_dir: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """(method, setting) -> {"runs": [results.json ...], "paper": float | None} of finished cells."""
    cells = json.loads((sweep_dir / "sweep.json").read_text())["cells"]
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for name, cell in cells.items():
        run = sweep_dir / "runs" / name
        if cell["status"] != "completed" or not (run / "results.json").is_file():
            continue
        config = json.loads((run / "config.json").read_text())
        key = (method_label(cell["conf"], cell.get("grid", {})), setting_label(config))
        g = groups.setdefault(key, {"runs": [], "paper": None})
        g["runs"].append(json.loads((run / "results.json").read_text()))
        g["paper"] = cell.get("paper")
    return groups


def _cell_text(runs: list[dict[str, Any]], key: str) -> str:
    v = np.array([100 * r["summary"][key] for r in runs])
    return f"{v.mean():.2f} ± {v.std(ddof=1) if len(v) > 1 else 0:.2f}"


def write_sweep_table(sweep_dir: Path) -> str:
    """table.md, table.csv and curves.png in ``sweep_dir``; returns the markdown.

    Rows are methods, columns settings; each entry is mean ± std over seeds of the final,
    best and mean-of-last-5 test accuracy (%), with the paper's number where one exists.
    """
    groups = collect(sweep_dir)
    if not groups:
        return "no cell of this sweep has completed yet\n"
    methods = sorted({m for m, _ in groups}, key=lambda m: (m != "fedavg", m))
    settings = sorted({s for _, s in groups})
    head = "| method | " + " | ".join(settings) + " |"
    lines = [head, "|" + " --- |" * (len(settings) + 1)]
    rows = [
        [
            "method",
            "setting",
            "seeds",
            "final",
            "final-std",
            "best",
            "best-std",
            "last5",
            "last5-std",
            "paper",
        ]
    ]
    for m in methods:
        entries = []
        for s in settings:
            g = groups.get((m, s))
            if g is None:
                entries.append("–")
                continue
            final, best, last5 = (_cell_text(g["runs"], k) for k in _SUMMARY)
            paper = f" (paper {g['paper']:.2f})" if g["paper"] is not None else ""
            entries.append(f"{final} / {best} / {last5} (n={len(g['runs'])}){paper}")
            nums = [np.array([100 * r["summary"][k] for r in g["runs"]]) for k in _SUMMARY]
            stats = [
                f"{f(v):.4f}" for v in nums for f in (np.mean, lambda a: a.std(ddof=1) if len(a) > 1 else 0.0)
            ]
            rows.append([m, s, str(len(g["runs"])), *stats, "" if g["paper"] is None else str(g["paper"])])
        lines.append(f"| {m} | " + " | ".join(entries) + " |")
    text = (
        "final / best / mean of last 5 test accuracy (%), mean ± std over seeds\n\n" + "\n".join(lines) + "\n"
    )
    atomic_write(sweep_dir / "table.md", lambda f: f.write(text), mode="w")
    atomic_write(sweep_dir / "table.csv", lambda f: csv.writer(f).writerows(rows), mode="w")
    _plot_curves(groups, settings, sweep_dir / "curves.png")
    return text


def _plot_curves(groups: dict[tuple[str, str], dict[str, Any]], settings: list[str], path: Path) -> None:
    fig, axes = plt.subplots(1, len(settings), figsize=(6 * len(settings), 4.2), squeeze=False)
    for ax, s in zip(axes[0], settings, strict=True):
        for (m, s2), g in sorted(groups.items()):
            if s2 == s:
                n = min(len(r["rounds"]) for r in g["runs"])
                acc = np.array([[100 * row["test-accuracy"] for row in r["rounds"][:n]] for r in g["runs"]])
                ax.plot(acc.mean(0), label=m)
        ax.set(title=f"{s} (mean over seeds)", xlabel="round", ylabel="test accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    _save(fig, path)
