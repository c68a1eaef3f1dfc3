"""results.json: one typed record, the only code that turns it into JSON and back.

The ServerApp writes it (``RunDir.save_results``); ``feddifrc report`` / ``status``, the sweep,
the table and resume read it (``RunDir.load_results``). A key is present on disk only once the
run has set it (a run that fails in setup has no ``summary``; only a FedDifRC run with
``diffusion.projection = "federated-pca"`` has a ``basis``), so every optional field is None
until set and None is never written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

# One row per evaluated round: "round", "val-accuracy", "val-loss", "test-accuracy", "test-loss"
# and, for a trained round, "nodes" (partition ids), "failures" ({"node", "partition-id",
# "reason"}), "train-metrics" (the strategy's aggregate) and "seconds". Round 0 is the initial model.
# With fraction-evaluate > 0 a trained round also has the nodes' scores of the new global model on
# their held-out data (federated_eval.py): "federated-accuracy" and "federated-loss"
# (example-weighted; None when no node replied), "evaluate-nodes" ({"node", "partition-id",
# "num-examples", "accuracy", "loss"}) and "evaluate-failures" (as "failures"). Under an
# accounted strategy.dp a trained round also has "dp-release", "epsilon" and
# "epsilon-if-sample-secret" (privacy_accounting.ROW_KEYS; an infinite epsilon is written null).
Round = dict[str, Any]


@dataclass
class Results:
    """What a run reports; fields in the order a run writes them, so a file keeps its key order.

    JSON keys are the field names with ``-`` for ``_`` (``label_counts`` -> ``"label-counts"``).
    """

    method: str | None = None
    strategy: str | None = None
    dataset: str | None = None
    partition: str | None = None
    rounds: list[Round] = field(default_factory=list)
    resumed: list[dict[str, int]] | None = None  # {"after-round", "run-id"} per resume
    basis: dict[str, Any] | None = None  # the federated PCA fit: mode, fingerprint, rows, nodes, widths
    setup_cache_misses: int | None = None  # teacher-cache misses while the nodes sent PCA statistics
    setup_seconds: float | None = None
    teacher: dict[str, Any] | None = None  # model, weights-sha256, random-weights, devices
    label_counts: dict[str, list[int]] | None = None  # partition id -> training samples per class
    privacy: dict[str, Any] | None = None  # strategy.dp's settings, weighting, delta, accountant
    status: str | None = None  # running, completed, diverged, stopped, failed
    process: dict[str, Any] | None = None  # pid and host of the ServerApp (`feddifrc status`)
    summary: dict[str, float | int | None] | None = None  # summarize(rounds), set on every save
    diverged_rounds: list[int] | None = None
    error: str | None = None  # why a stopped or failed run ended
    # Keys this code does not write (a file of another version, a hand edit): kept as they are.
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Results:
        """The record of a parsed results.json; a key of the wrong type is a TypeError naming it."""
        known = {_key(f.name): f.name for f in fields(cls) if f.name != "extra"}
        out = cls(extra={k: v for k, v in obj.items() if k not in known})
        for key, name in known.items():
            if key in obj:
                want = _TYPES[name]
                if not isinstance(obj[key], want) or isinstance(obj[key], bool) and want is not bool:
                    raise TypeError(
                        f"results.json key {key!r} is a {type(obj[key]).__name__}, expected "
                        f"{' or '.join(t.__name__ for t in _as_tuple(want))}"
                    )
                setattr(out, name, obj[key])
        return out

    def to_json(self) -> dict[str, Any]:
        """The JSON object: set keys in field order, then ``extra``; NaN and inf become null."""
        out = {_key(f.name): getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        out = {k: v for k, v in out.items() if v is not None} | self.extra
        return finite_or_none(out)


def _key(name: str) -> str:
    return name.replace("_", "-")


def _as_tuple(t: type | tuple[type, ...]) -> tuple[type, ...]:
    return t if isinstance(t, tuple) else (t,)


# What from_json accepts for each key (JSON has one number type for int and float).
_TYPES: dict[str, type | tuple[type, ...]] = {
    "method": str,
    "strategy": str,
    "dataset": str,
    "partition": str,
    "rounds": list,
    "resumed": list,
    "basis": dict,
    "setup_cache_misses": int,
    "setup_seconds": (int, float),
    "teacher": dict,
    "label_counts": dict,
    "privacy": dict,
    "status": str,
    "process": dict,
    "summary": dict,
    "diverged_rounds": list,
    "error": str,
}


# How "best-accuracy" is named wherever it is printed: the paper's public code reports the
# maximum test accuracy over rounds (a choice read off test), so a paper's number stands beside it.
BEST_LABEL = "best (max over rounds, the paper's endpoint)"


def percent(x: float | None) -> str:
    """``61.20%``; ``-`` when there is none, ``NOT FINITE`` for NaN or inf (never ``nan%``)."""
    if x is None:
        return "-"
    return f"{100 * x:.2f}%" if math.isfinite(x) else f"NOT FINITE ({x})"


def summary_text(s: dict[str, Any]) -> str:
    """``final 61.20%  best (max over rounds, the paper's endpoint) 63.05%  mean of last 5 62.10%``."""
    return (
        f"final {percent(s['final-accuracy'])}  {BEST_LABEL} {percent(s['best-accuracy'])}  "
        f"mean of last 5 {percent(s['mean-last-5-accuracy'])}"
    )


def summarize(rounds: list[Round]) -> dict[str, float | int | None]:
    """Test accuracy final, best and mean of the last 5 (and 10) trained rounds, reported together
    (the paper's code reports the max: selection on test), and the test accuracy at the round
    with the best VALIDATION accuracy (first such round), the one checkpoint choice that is not
    read off the test split; with federated evaluation, also the last federated accuracy.
    Round 0 (the initial model) counts only when no round has trained."""
    done = [r for r in rounds if r.get("test-accuracy") is not None]
    trained = [r for r in done if r["round"] >= 1] or done
    accs = [r["test-accuracy"] for r in trained]
    out: dict[str, float | int | None] = dict.fromkeys(
        ("final-accuracy", "best-accuracy", "mean-last-5-accuracy", "mean-last-10-accuracy")
    )
    if accs:
        out["final-accuracy"], out["best-accuracy"] = accs[-1], max(accs)
        out["mean-last-5-accuracy"] = sum(accs[-5:]) / len(accs[-5:])
        out["mean-last-10-accuracy"] = sum(accs[-10:]) / len(accs[-10:])
    val = [r for r in trained if r.get("val-accuracy") is not None]
    best = max(val, key=lambda r: r["val-accuracy"]) if val else None  # max() keeps the first
    out["val-best-round"] = best["round"] if best else None
    out["val-best-accuracy"] = best["val-accuracy"] if best else None
    out["test-at-val-best-accuracy"] = best["test-accuracy"] if best else None
    fed = [r["federated-accuracy"] for r in trained if r.get("federated-accuracy") is not None]
    if fed:  # only runs with federated evaluation have the key, so other summaries are unchanged
        out["final-federated-accuracy"] = fed[-1]
    return out


def finite_or_none(obj: Any) -> Any:
    """``obj`` with every NaN / inf float replaced by None, so results.json is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return obj
