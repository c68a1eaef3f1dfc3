"""results.json -> plots and text tables, for one run or a sweep of runs (matplotlib, headless)."""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from feddifrc_app.files import atomic_write
from feddifrc_app.results import BEST_LABEL, Results, RoundRow, json_key, summary_text

if TYPE_CHECKING:
    from types import ModuleType

    from matplotlib.figure import Figure


def _pyplot() -> ModuleType:
    """pyplot on the headless backend (no display on servers / in Ray workers), imported when a
    plot is drawn: `feddifrc report` prints its table without loading matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Figure, path: Path) -> None:
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120, bbox_inches="tight"))
    _pyplot().close(fig)


def teacher_of(results: Results) -> dict[str, Any]:
    """The diffusion teacher the run's nodes ran ({} for a run without one): its ``model``,
    ``weights-sha256``, ``random-weights`` and ``devices`` (``"cuda float16"`` -> partition ids),
    the method's own key (its ``RESULTS``), read here without importing the method."""
    found = results.extra.get("teacher", {})
    if not isinstance(found, dict):
        raise TypeError(f"results.json key 'teacher' is a {type(found).__name__}, expected dict")
    return found


# Accuracy series of a run's rows, as plotted: label -> the row's value.
_CURVES: dict[str, Callable[[RoundRow], float | None]] = {
    "validation": lambda r: r.val_accuracy,
    "test": lambda r: r.test_accuracy,
    "federated (nodes' held-out data)": lambda r: r.federated_accuracy,
}


def platforms_text(results: Results) -> str | None:
    """Where the run computed (results.json's ``platforms``): the server's torch, CPU kernels and
    machine, then each of the nodes' with its partitions; None for a run that names none."""
    if not results.platforms:
        return None

    def where(p: dict[str, Any]) -> str:
        return f"torch {p.get('torch')} {p.get('cpu-kernels')} {p.get('machine')}"

    def parts(ids: list[int]) -> str:
        shown = ", ".join(map(str, ids[:8])) + (f", ... ({len(ids)} in all)" if len(ids) > 8 else "")
        return f"partition{'s' if len(ids) > 1 else ''} {shown}"

    p = results.platforms
    nodes = ", ".join(f"{where(n)} ({parts(n.get('partitions', []))})" for n in p.get("nodes", []))
    return f"platforms: server {where(p.get('server', {}))}; nodes {nodes}"


def plot_accuracy(results: Results, path: Path) -> None:
    """Validation and test accuracy per round (round 0 = the initial model) and, with federated
    evaluation, the nodes' example-weighted accuracy beside them; summary in the title."""
    s = results.summary or {}
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, value in _CURVES.items():
        rows = [r for r in results.rounds if value(r) is not None]
        if rows:
            ax.plot([r.round for r in rows], [100 * value(r) for r in rows], marker="o", ms=3, label=label)
    ax.legend(fontsize=8)
    ax.set_xlabel("round")
    ax.set_ylabel("accuracy (%)")
    title = f"{results.method or ''} / {results.strategy or ''} on {results.dataset or ''}"
    if s.get("final-accuracy") is not None:
        title += "\n" + summary_text(s)
        if s.get("test-at-val-best-accuracy") is not None:
            title += f"  at val-best round {s['val-best-round']}: {100 * s['test-at-val-best-accuracy']:.2f}"
        if s.get("final-federated-accuracy") is not None:
            title += f"\nfinal federated {100 * s['final-federated-accuracy']:.2f}"
    if teacher_of(results).get("random-weights"):
        title += "\n(teacher has RANDOM weights: not evidence that FedDifRC helps)"
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    _save(fig, path)


MAX_BARS = 60  # plot_label_distribution: clients drawn as bars, each with its tick


def plot_label_distribution(counts: np.ndarray, class_names: list[str], path: Path, title: str) -> None:
    """Stacked bars: per client (x) the number of training samples of each class."""
    m, c = counts.shape
    plt = _pyplot()
    # A bar and a tick per client up to MAX_BARS clients; beyond, one stacked area per class in a
    # figure of fixed width (5,000 clients as bars: a 3,000-inch figure and 50,000 patches).
    many = m > MAX_BARS
    fig, ax = plt.subplots(figsize=(min(max(5, 0.6 * m + 2), 0.6 * MAX_BARS + 2), 4))
    bottom = np.zeros(m)
    cmap = plt.get_cmap("tab20", max(c, 1))
    for k in range(c):
        label = class_names[k] if c <= 20 else None
        if many:
            ax.fill_between(np.arange(m), bottom, bottom + counts[:, k], color=cmap(k), label=label, lw=0)
        else:
            ax.bar(np.arange(m), counts[:, k], bottom=bottom, color=cmap(k), label=label)
        bottom += counts[:, k]
    if not many:
        ax.set_xticks(np.arange(m))
    ax.set_xlabel("client (partition id)")
    ax.set_ylabel("training samples")
    ax.set_title(title, fontsize=9)
    if c <= 20:
        ax.legend(fontsize=6, ncol=2, bbox_to_anchor=(1.01, 1), loc="upper left")
    _save(fig, path)


def _federated(results: Results) -> bool:
    return any(r.federated_accuracy is not None or r.evaluate_nodes for r in results.rounds)


# The per-round table's columns: row fields, then the loss parts the nodes reported (a method's
# terms are train-<its name>: CE, TDCL, NDCR, MOON's, ...), then the round's nodes and time.
_COLUMNS = ("round", "val_accuracy", "test_accuracy", "test_loss")
_LAST_COLUMNS = ("nodes", "failures", "seconds")
_NOT_LOSS_PARTS = ("train-accuracy", "train-seconds", "train-total")
_FEDERATED_COLUMNS = {"federated_accuracy": "fed-accuracy", "federated_loss": "fed-loss"}


def _loss_parts(results: Results) -> list[str]:
    """The ``train-<part>`` metrics the rows carry, in the order they first appear (CE if none)."""
    seen = {k: None for r in results.rounds for k in (r.train_metrics or {}) if k.startswith("train-")}
    return [k for k in seen if k not in _NOT_LOSS_PARTS] or ["train-ce"]


def _cell(r: RoundRow, column: str) -> Any:
    return getattr(r, column) if column.isidentifier() else (r.train_metrics or {}).get(column)


def format_table(results: Results) -> str:
    """A plain-text per-round table plus the summary line; with federated evaluation, its columns
    beside the central ones and a per-node table (``format_nodes``)."""
    keys = [*_COLUMNS, *_loss_parts(results), *_LAST_COLUMNS]
    if _federated(results):
        keys[3:3] = list(_FEDERATED_COLUMNS)
    lines = ["  ".join(f"{_FEDERATED_COLUMNS.get(k, json_key(k)):>13}" for k in keys)]
    for r in results.rounds:
        row = []
        for k in keys:
            v = _cell(r, k)
            if isinstance(v, list):
                v = len(v)
            row.append(f"{v:>13.4f}" if isinstance(v, float) else f"{'' if v is None else v!s:>13}")
        lines.append("  ".join(row))
    s = results.summary or {}
    if s.get("final-accuracy") is not None:
        lines.append(summary_text(s))
        if s.get("test-at-val-best-accuracy") is not None:
            lines[-1] += (
                f"  test at the best validation round ({s['val-best-round']}) "
                f"{100 * s['test-at-val-best-accuracy']:.2f}%"
            )
    if s.get("final-federated-accuracy") is not None:
        lines.append(f"final federated accuracy {100 * s['final-federated-accuracy']:.2f}%")
    if results.privacy:
        lines.append(privacy_line(results))
    if _federated(results):
        lines += ["", format_nodes(results)]
    return "\n".join(lines)


def privacy_line(results: Results) -> str:
    """strategy.dp's final (epsilon, delta) after the trained rounds, or why there is none."""
    p = results.privacy or {}
    if p.get("accountant") is None:
        return f"privacy: strategy.dp = {p.get('mode')}, no epsilon: {p.get('not-accounted', 'not recorded')}"
    rows = [r for r in results.rounds if r.holds("epsilon")]
    if not rows:
        return f"privacy: strategy.dp = {p['mode']}, no trained round yet"
    eps, secret = (_epsilon_text(e) for e in (rows[-1].epsilon, rows[-1].epsilon_if_sample_secret))
    return (
        f"privacy: strategy.dp = {p['mode']}, epsilon {eps} at delta {p['delta']:g} after round "
        f"{rows[-1].round} (node-level; {secret} if the rounds' samples were secret)"
    )


def _epsilon_text(e: float | None) -> str:
    """results.json writes an infinite epsilon (no noise) as null."""
    return "inf (no noise)" if e is None or e == float("inf") else f"{e:.4g}"


def _node_key(row: dict[str, Any]) -> tuple[int, int]:
    """A node's column: (0, partition id), or (1, node id) for a node with its own data folder
    (partition id -1: every such node has it)."""
    pid = row.get("partition-id")
    return (0, pid) if isinstance(pid, int) and pid >= 0 else (1, int(row.get("node") or 0))


def format_nodes(results: Results) -> str:
    """Per round, each node's federated accuracy (%) on its held-out data (``failed`` for a node
    whose evaluation failed, blank when it was not sampled); the header says how many examples
    each node holds out (``p<partition id>``, ``n<node id>``)."""
    held: dict[tuple[int, int], Any] = {}
    for r in results.rounds:
        for f in r.evaluate_failures or []:
            held.setdefault(_node_key(f), "?")
        for n in r.evaluate_nodes or []:
            held[_node_key(n)] = n["num-examples"]
    cols = sorted(held)
    names = [f"{'pn'[k]}{i}" for k, i in cols]
    lines = [
        "federated accuracy (%) per node; held-out examples: "
        + ", ".join(f"{name} {held[c]}" for name, c in zip(names, cols, strict=True)),
        "  ".join(f"{k:>8}" for k in ["round", *names]),
    ]
    for r in results.rounds:
        if r.evaluate_nodes is None:
            continue
        cell = {_node_key(n): f"{100 * n['accuracy']:.2f}" for n in r.evaluate_nodes}
        cell |= {_node_key(f): "failed" for f in r.evaluate_failures or []}
        lines.append("  ".join(f"{v:>8}" for v in [str(r.round), *(cell.get(c, "") for c in cols)]))
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


def _read_json(path: Path) -> tuple[Any, str]:
    """(parsed JSON, "") or (None, why it is not readable, naming the file)."""
    if not path.is_file():
        return None, f"no {path.name} ({path})"
    try:
        return json.loads(path.read_text()), ""
    except (OSError, ValueError) as e:
        return None, f"{path} is unreadable ({type(e).__name__}: {e})"


def completed_results(run_dir: Path, rounds: int | None = None) -> tuple[Results | None, str]:
    """(results.json, "") of a run that completed all its rounds, else (None, why not).

    ``rounds``: the configured number of rounds (default: config.json's ``num-server-rounds``).
    A run still running, interrupted, stopped, diverged or failed, or whose last round is not
    the configured one, is not a result (one home for this rule: the sweep and the table).
    """
    if rounds is None:
        config, why = _read_json(run_dir / "config.json")
        if config is None:
            return None, why
        rounds = config.get("num-server-rounds") if isinstance(config, dict) else None
        if not isinstance(rounds, int):
            return None, f"{run_dir / 'config.json'} has no integer num-server-rounds"
    path = run_dir / "results.json"
    obj, why = _read_json(path)
    if obj is None:
        return None, why
    try:
        r = Results.from_json(obj)
    except (AttributeError, TypeError) as e:  # valid JSON of another layout, named
        return None, f"{path} has an unexpected layout ({e})"
    try:
        last = r.rounds[-1].round if r.rounds else None
        summary_ok = all(isinstance(r.summary[k], (int, float)) for k in _SUMMARY)
    except (KeyError, TypeError):
        return None, f"{path} lacks rounds or summary"
    if r.status != "completed":
        return None, f"results.json status is {r.status!r}, not 'completed'"
    if last != rounds:
        return None, f"results.json ends at round {last}, the config asks for {rounds}"
    if not summary_ok:
        return None, f"{path} has no final/best/mean-last-5 accuracy"
    for row in r.evaluated():  # the table's curves read every scored row: a damaged one skips the run
        if row.test_accuracy is None or not math.isfinite(row.test_accuracy):
            return None, f"{path} round {row.round!r} has no finite test-accuracy ({row.test_accuracy!r})"
    return r, ""


# What `feddifrc sweep` writes in each entry of sweep.json (Sweep.record) and the table reads.
_ENTRY_TYPES = {"status": (str,), "conf": (str,), "grid": (dict,), "paper": (int, float, type(None))}
_REWRITE = "rerun the same `feddifrc sweep` command to rewrite it (finished runs are reused, not rerun)"


def _entry_problem(cell: Any) -> str:
    """Why a sweep.json entry is not one the sweep writes ("" = it is): the field and its type."""
    if not isinstance(cell, dict):
        return f"a {type(cell).__name__}, not an object"
    if "status" not in cell:
        return "no 'status'"
    for key, types in _ENTRY_TYPES.items():
        if key in cell and (not isinstance(cell[key], types) or isinstance(cell[key], bool)):
            return f"{key!r} is a {type(cell[key]).__name__} ({cell[key]!r:.40})"
    return ""


def collect(
    sweep_dir: Path,
) -> tuple[dict[tuple[str, str], dict[str, Any]], list[tuple[str, str]]]:
    """((method, setting) -> {"runs": [results.json ...], "paper": float | None}, [(cell, why
    skipped)]): only cells whose results.json is a completed run of the configured rounds."""
    path = sweep_dir / "sweep.json"
    state, why = _read_json(path)
    cells = state.get("cells") if isinstance(state, dict) else None
    if not isinstance(cells, dict):
        raise ValueError(why or f"{path} has no 'cells' object; is {sweep_dir} a `feddifrc sweep` folder?")
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    skipped: list[tuple[str, str]] = []
    for name, cell in sorted(cells.items()):
        run = sweep_dir / "runs" / name
        status = cell.get("status") if isinstance(cell, dict) else None
        if isinstance(status, str) and status != "completed":
            skipped.append((name, f"sweep.json status {status!r}"))
            continue
        if problem := _entry_problem(cell):
            skipped.append((name, f"sweep.json's entry is malformed ({problem}): {_REWRITE}"))
            continue
        r, why = completed_results(run)
        if r is None:
            skipped.append((name, why))
            continue
        config, _ = _read_json(run / "config.json")  # read by completed_results already
        try:
            setting = setting_label(config)
        except (KeyError, TypeError, ValueError):
            skipped.append((name, f"{run / 'config.json'} lacks dataset.name / partition.*"))
            continue
        g = groups.setdefault((method_label(cell.get("conf", ""), cell.get("grid", {})), setting), {})
        g.setdefault("runs", []).append(r)
        g.setdefault("names", []).append(name)
        g["paper"] = cell.get("paper")
    return groups, skipped


def _cell_text(runs: list[Results], key: str) -> str:
    v = np.array([100 * r.summary[key] for r in runs])
    if not np.isfinite(v).all():  # a hand-edited or foreign results.json: not a measurement
        return f"NOT FINITE ({', '.join(sorted({str(x) for x in v[~np.isfinite(v)]}))})"
    return f"{v.mean():.2f} ± {v.std(ddof=1) if len(v) > 1 else 0:.2f}"


_CSV_HEAD = [
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


def _table_rows(
    groups: dict[tuple[str, str], dict[str, Any]], methods: list[str], settings: list[str]
) -> tuple[list[str], list[list[str]]]:
    """(table.md's lines, table.csv's rows): a method per row, a setting per column."""
    head = "| method | " + " | ".join(settings) + " |"
    lines, rows = [head, "|" + " --- |" * (len(settings) + 1)], [_CSV_HEAD]
    for m in methods:
        entries = []
        for s in settings:
            g = groups.get((m, s))
            if g is None:
                entries.append("–")
                continue
            final, best, last5 = (_cell_text(g["runs"], k) for k in _SUMMARY)
            paper = f" (paper {g['paper']:.2f})" if g["paper"] is not None else ""
            warned = sum(bool(r.warnings) for r in g["runs"])  # listed after the table (warned_text)
            warned_mark = f" WARNED {warned} of {len(g['runs'])}" if warned else ""
            entries.append(f"{final} / {best} / {last5} (n={len(g['runs'])}){paper}{warned_mark}")
            nums = [np.array([100 * r.summary[k] for r in g["runs"]]) for k in _SUMMARY]
            stats = [
                f"{f(v):.4f}" for v in nums for f in (np.mean, lambda a: a.std(ddof=1) if len(a) > 1 else 0.0)
            ]
            rows.append([m, s, str(len(g["runs"])), *stats, "" if g["paper"] is None else str(g["paper"])])
        lines.append(f"| {m} | " + " | ".join(entries) + " |")
    return lines, rows


def warned_text(groups: dict[tuple[str, str], dict[str, Any]]) -> str:
    """``warned <cell>: <warning>`` for each warning of a tabled run (results.json's warnings: a
    model that learned nothing, DP noise far above what a model absorbs), one a line."""
    cells = sorted(
        ((n, r) for g in groups.values() for n, r in zip(g["names"], g["runs"], strict=True)),
        key=lambda cell: cell[0],
    )
    return "".join(f"warned {n}: {w}\n" for n, r in cells for w in r.warnings or [])


def write_sweep_table(sweep_dir: Path) -> str:
    """table.md, table.csv and curves.png in ``sweep_dir``; returns the markdown.

    Rows are methods, columns settings; each entry is mean ± std over seeds of the final,
    best (max over rounds: the paper's endpoint, beside its number where one exists) and
    mean-of-last-5 test accuracy (%).
    Only completed runs of the configured rounds count (:func:`completed_results`); every
    other cell is listed after the table with why, and every warning of a tabled run (an entry
    with such runs says ``WARNED k of n``). An unreadable sweep.json is a ValueError.
    """
    groups, skipped = collect(sweep_dir)
    # Every cell left out is named with why, in the printed text and in table.md.
    skip_text = "".join(f"skipped {name}: {why}\n" for name, why in skipped)
    skip_text = warned_text(groups) + skip_text
    if not groups:
        return "no cell of this sweep has completed yet\n" + skip_text
    methods = sorted({m for m, _ in groups}, key=lambda m: (m != "fedavg", m))
    settings = sorted({s for _, s in groups})
    lines, rows = _table_rows(groups, methods, settings)
    text = (
        f"final / {BEST_LABEL} / mean of last 5 test accuracy (%), mean ± std over seeds; "
        "(paper X) is the paper's number, the maximum test accuracy over rounds its public code "
        "reports: compare it with best\n\n"
        + "\n".join(lines)
        + "\n"
        + (f"\n{skip_text}" if skip_text else "")
    )
    atomic_write(sweep_dir / "table.md", lambda f: f.write(text), mode="w")
    atomic_write(sweep_dir / "table.csv", lambda f: csv.writer(f).writerows(rows), mode="w")
    _plot_curves(groups, settings, sweep_dir / "curves.png")
    return text


def _plot_curves(groups: dict[tuple[str, str], dict[str, Any]], settings: list[str], path: Path) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(settings), figsize=(6 * len(settings), 4.2), squeeze=False)
    for ax, s in zip(axes[0], settings, strict=True):
        for (m, s2), g in sorted(groups.items()):
            if s2 == s:
                scored = [{row.round: row.test_accuracy for row in r.evaluated()} for r in g["runs"]]
                x = sorted(set.intersection(*(set(d) for d in scored)))  # server.evaluate-every's rounds
                acc = np.array([[100 * d[k] for k in x] for d in scored])
                ax.plot(x, acc.mean(0), label=m)
        ax.set(title=f"{s} (mean over seeds)", xlabel="round", ylabel="test accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    _save(fig, path)
