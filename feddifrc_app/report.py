"""results.json -> plots and a text table (matplotlib, headless)."""

from __future__ import annotations

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
    """Test accuracy per round (round 0 = the initial model), with the summary in the title."""
    rounds = [r["round"] for r in results["rounds"] if r.get("test-accuracy") is not None]
    accs = [100 * r["test-accuracy"] for r in results["rounds"] if r.get("test-accuracy") is not None]
    s = results.get("summary", {})
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(rounds, accs, marker="o", ms=3)
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy (%)")
    title = f"{results.get('method', '')} / {results.get('strategy', '')} on {results.get('dataset', '')}"
    if s.get("final-accuracy") is not None:
        title += (
            f"\nfinal {100 * s['final-accuracy']:.2f}  best {100 * s['best-accuracy']:.2f}  "
            f"mean-last-5 {100 * s['mean-last-5-accuracy']:.2f}"
        )
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
    keys = "round test-accuracy test-loss train-ce train-tdcl train-ndcr nodes failures seconds".split()
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
    return "\n".join(lines)
